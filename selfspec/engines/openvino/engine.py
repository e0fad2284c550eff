"""OpenVINO GenAI's engine record: plain OpenVINO GenAI against each EAGLE-3 head converted by optimum-intel, the
draft length swept once per machine (:mod:`selfspec.engines.openvino.bench`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from selfspec.engines.registry import Engine, EngineOption, EngineOutput, EngineRun, register_engine, runtime_error_of

if TYPE_CHECKING:
    from selfspec.bench.report import BenchReport

__all__ = ["ENGINE", "RECORD_FILE", "bench", "chains", "missing"]

RECORD_FILE = "openvino.json"


def missing() -> str | None:
    """Why OpenVINO GenAI cannot run here (its venv is not built; the message names the command), or None."""
    from selfspec.export.openvino import openvino_python

    return runtime_error_of(openvino_python)


def _run(run: EngineRun, given: Mapping[str, int] | None) -> tuple[BenchReport, dict[str, Any]]:
    from selfspec.engines.openvino.bench import run_openvino_bench
    from selfspec.target import resolve_target

    return run_openvino_bench(
        run.target, run.tokenizer, run.prompts, run.settings, target_dir=Path(resolve_target(run.target_name)),
        heads=run.heads, given=given, fresh_sweep=bool(run.options.get("fresh_sweep")),
    )  # fmt: skip


def bench(run: EngineRun) -> EngineOutput:
    """``selfspec bench --engine openvino`` (:func:`selfspec.engines.openvino.bench.run_openvino_bench`); the
    engine's record (layer ids, draft lengths, OpenVINO's own counters) is written beside the report as
    :data:`RECORD_FILE`."""
    k = run.options.get("assistant_tokens")
    report, record = _run(run, {name: k for name in run.heads} if k else None)
    return EngineOutput(report, {RECORD_FILE: record})


def chains(run: EngineRun, lengths: Mapping[str, int]) -> BenchReport:
    """``num_assistant_tokens=k`` for each method."""
    return _run(run, dict(lengths))[0]


OPTIONS = (
    EngineOption("--assistant-tokens", {
        "type": int, "default": None,
        "help": "--engine openvino: num_assistant_tokens for every head instead of the swept draft length",
    }),
)  # fmt: skip
HELP = (
    "openvino: plain OpenVINO GenAI against each --heads (EAGLE-3, converted by optimum-intel), draft length swept "
    "once per machine (needs `python -m selfspec.engine_envs openvino`)"
)

ENGINE = register_engine(Engine(
    "openvino", "OpenVINO GenAI", bench, chains, missing, env="openvino", export_format="openvino",
    families=("eagle3",), eagle31=False, worker="selfspec/engines/openvino/openvino_worker.py",
    sweep="selfspec.engines.openvino.settings", options=OPTIONS, help=HELP,
))  # fmt: skip
