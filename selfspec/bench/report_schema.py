"""Older bench report layouts read in the current schema (:data:`selfspec.bench.report.SCHEMA_VERSION`), what they
did not measure left null, so that :meth:`selfspec.bench.report.BenchReport.from_dict` reads every report ever
written with one strict reader."""

from __future__ import annotations

from typing import Any


def upgrade(data: Any) -> Any:
    """An older report's layout in the current schema, what it did not measure null: schema 2 had no engine-only
    baseline, no near-tie check and the selfspec engine's wall-time timing; schema 3 no count of the steps without
    drafts; schema 4 no count of the steps by tree size. Any other layout is returned as it is."""
    if isinstance(data, dict) and data.get("schema_version") == 2:
        data = _upgrade_2(data)
    if isinstance(data, dict) and data.get("schema_version") == 3:
        data = _map_records(
            dict(data, schema_version=4),
            lambda r: dict(r, plain_steps=None, drafting_off_steps=None, drafting_off_s=None),
            lambda a: dict(a, drafting_off_share=None, drafting_off_time_share=None),
        )
    if isinstance(data, dict) and data.get("schema_version") == 4:
        data = _map_records(
            dict(data, schema_version=5),
            lambda r: dict(r, steps_by_nodes=None),
            lambda a: dict(a, steps_by_nodes=None),
        )
    return data


def _map_records(data: dict[str, Any], result: Any, agg: Any) -> dict[str, Any]:
    """``data`` with ``result`` applied to every sample's result and ``agg`` to every aggregate (objects only)."""

    def each(fn: Any, x: Any) -> Any:
        return fn(x) if isinstance(x, dict) else x

    data["samples"] = [
        dict(x, results={k: each(result, v) for k, v in (x.get("results") or {}).items()}) if isinstance(x, dict) else x
        for x in data.get("samples") or []
    ]
    data["summary"] = {
        name: dict(
            m,
            overall=each(agg, m.get("overall")),
            by_category={c: each(agg, a) for c, a in (m.get("by_category") or {}).items()},
        )
        if isinstance(m, dict)
        else m
        for name, m in (data.get("summary") or {}).items()
    }
    return data


def _upgrade_2(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-2 report's layout in schema 3."""
    data = dict(data, schema_version=3, ties=[], llamacpp=None)
    data["settings"] = dict(
        data.get("settings") or {},
        engine_reference=None,
        engine="selfspec",
        timing="wall time of the whole call, prefill included",
    )

    return _map_records(
        data,
        lambda r: dict(r, engine_speedup=None, near_tie=None),
        lambda a: dict(a, engine_speedup=None, near_ties=None if a.get("mismatches") is None else 0),
    )
