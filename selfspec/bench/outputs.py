"""What a bench run leaves behind: ``report.json``, ``report.md``, the plots, and the stdout summary."""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.bench.plots import write_plots
from selfspec.bench.report import Aggregate, BenchReport, TreeBudgetRecord
from selfspec.engines.registry import Engine, engine, engine_title


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _engine(name: str) -> Engine | None:
    """The engine that made a report, or None for one not registered in this process (nothing of its own is shown)."""
    try:
        return engine(name)
    except ValueError:
        return None


def _depth_text(rates: list[float | None] | None) -> str:
    return "-" if not rates else " / ".join(fmt(r, ".2f") for r in rates)


def _one_reference(report: BenchReport) -> bool:
    """True when the engine-only baseline is the reference itself (the vLLM and OpenVINO engines): one speedup
    column then, not the same one twice."""
    return report.settings.engine_reference == report.settings.reference


def _columns(report: BenchReport) -> str:
    s = report.settings
    engine = "" if _one_reference(report) else f" | speedup vs {s.engine_reference}"
    return (
        f"tokens/s (median) | speedup vs {s.reference}{engine} | tau | acceptance by depth "
        "| draft share | verify share | drafting off | peak MiB | mismatches"
    )


def _mismatch_text(agg: Aggregate) -> str:
    if agg.mismatches is None:
        return "-"
    ties = f" (+{agg.near_ties} at near-ties)" if agg.near_ties else ""
    return f"{agg.mismatches}/{agg.num_samples}{ties}"


def _row(agg: Aggregate, one_reference: bool = False) -> str:
    return " | ".join(
        [
            str(agg.num_samples),
            fmt(agg.median_tokens_per_s, ".1f"),
            fmt(agg.speedup, ".2f", "x"),
            *(() if one_reference else (fmt(agg.engine_speedup, ".2f", "x"),)),
            fmt(agg.tau),
            _depth_text(agg.acceptance_by_depth),
            fmt(agg.draft_share, ".0%"),
            fmt(agg.verify_share, ".0%"),
            fmt(agg.drafting_off_share, ".0%"),
            fmt(agg.peak_memory_mb, ".0f"),
            _mismatch_text(agg),
        ]
    )


def _budget_text(budget: TreeBudgetRecord | None) -> str:
    if budget is None:
        return ""
    text = (
        f"; EAGLE tree depth {budget.depth}, top_k {budget.top_k}, total_tokens {budget.total_tokens} "
        f"({budget.chosen_by}"
    )
    if budget.expected_tau is not None:
        speedup = fmt(budget.expected_speedup, ".2f", "x")
        text += f": expected tau {budget.expected_tau:.2f}, expected speedup {speedup}"
    return text + ")"


def _trees_used(agg: Aggregate) -> str:
    """The tree sizes a method verified, by share of its steps (the four most used), and their mean."""
    counts = {int(n): k for n, k in (agg.steps_by_nodes or {}).items()}
    total = sum(counts.values())
    if not total:
        return "-"
    most = sorted(sorted(counts, key=lambda n: -counts[n])[:4])
    shares = ", ".join(f"{n}: {counts[n] / total:.0%}" for n in most) + (", ..." if len(counts) > 4 else "")
    return f"{sum(n * k for n, k in counts.items()) / total:.1f} ({shares})"


def tree_lines(report: BenchReport) -> list[str]:
    """The ``report.md`` section on trees: per drafting method, the tree it was given or chose, the tau and speedup
    over the engine's own decoding without drafts its cost model expected against those measured, the tree sizes it
    verified (nodes, root included, by share of steps) and the steps and time with drafting switched off."""
    rows = []
    for name, summ in report.summary.items():
        agg, method = summ.overall, report.methods.get(name)
        if agg.tau is None or method is None:
            continue
        budget = method.tree_budget
        chosen = "its own" if budget is None else f"depth {budget.depth}, top_k {budget.top_k}, "
        chosen += "" if budget is None else f"{budget.total_tokens} tokens ({budget.chosen_by})"
        expected = (None, None) if budget is None else (budget.expected_tau, budget.expected_speedup)
        off = f"{fmt(agg.drafting_off_share, '.0%')} / {fmt(agg.drafting_off_time_share, '.0%')}"
        rows.append(
            f"| {name} | {chosen} | {fmt(expected[0])} / {fmt(agg.tau)} | {fmt(expected[1], '.2f', 'x')} / "
            f"{fmt(agg.engine_speedup, '.2f', 'x')} | {_trees_used(agg)} | {off} |"
        )
    if not rows:
        return []
    head = (
        f"| method | tree chosen | tau expected / measured | speedup vs {report.settings.engine_reference} "
        "expected / measured | nodes a step (sizes by share of steps) | drafting off (steps / time) |"
    )
    return ["", "## Trees: chosen, expected and measured", "", head, "|---|---|---|---|---|---|", *rows]


def markdown_report(report: BenchReport) -> str:
    """``report.md``: settings, a table by method x category, an overall table, the greedy mismatches and the
    engine's own section (:attr:`selfspec.engines.registry.Engine.report_lines`: llama.cpp's settings chosen, sweep
    and cost decomposition)."""
    s = report.settings
    one = _one_reference(report)
    mode = "greedy" if not s.do_sample else f"sampling T={s.temperature} top_p={s.top_p}"
    engine = engine_title(s.engine)
    lines = [
        f"# {engine} bench",
        "",
        f"Target `{s.target}` ({s.dtype}, {s.device}, {s.threads} threads), {mode}, "
        f"max {s.max_new_tokens} new tokens, prompts `{s.prompts_source or 'given in code'}` "
        f"({len(report.samples)} prompt turns), reference `{s.reference}`, engine-only baseline "
        f"`{s.engine_reference}`. Speedup: median over prompt turns of tokens/s divided by the reference's (or the "
        f"engine-only baseline's: the gain of speculation alone) tokens/s on the same turn, same run. tokens/s: "
        f"{s.timing}. Drafting off: the share of verification steps the live tree rule decoded without drafts.",
        "",
        "## By category",
        "",
        f"| method | category | n | {_columns(report)} |",
        "|" + "---|" * (13 - one),
    ]
    for name, summ in report.summary.items():
        for cat in report.categories:
            lines.append(f"| {name} | {cat} | {_row(summ.by_category[cat], one)} |")
    lines += ["", "## Overall", "", f"| method | n | {_columns(report)} |", "|" + "---|" * (12 - one)]
    for name, summ in report.summary.items():
        lines.append(f"| {name} | {_row(summ.overall, one)} |")
    lines += ["", "## Methods", ""]
    lines += [f"- `{n}` ({m.kind}): {m.description}{_budget_text(m.tree_budget)}" for n, m in report.methods.items()]
    lines += tree_lines(report)
    if not s.do_sample:
        lines += ["", "## Outputs differing from the reference (greedy)", ""]
        if report.mismatches:
            lines += ["| method | question | category | turn | first differing position |", "|---|---|---|---|---|"]
            for m in report.mismatches:
                lines.append(f"| {m.method} | {m.question_id} | {m.category} | {m.turn} | {m.first_diff} |")
        else:
            lines.append("None: every method produced the reference's tokens on every prompt turn.")
        if report.ties:
            lines += ["", "Outputs differing first at a near-tie of the target (reported, not counted):", ""]
            lines += [
                f"- {m.method}: question {m.question_id} turn {m.turn}, position {m.first_diff}" for m in report.ties
            ]
    own = _engine(s.engine)
    lines += own.report_lines(report) if own is not None else []
    if report.skipped:
        lines += ["", f"Skipped {len(report.skipped)} prompt turns longer than {s.max_prompt_tokens} tokens."]
    return "\n".join(lines) + "\n"


def summary_text(report: BenchReport) -> str:
    """The short stdout summary: reference tokens/s, then tau, both speedups and mismatches per method."""
    s = report.settings
    overall = {n: summ.overall for n, summ in report.summary.items()}
    ref = overall[s.reference]
    engine = overall[s.engine_reference] if s.engine_reference is not None else None
    lines = [
        f"{s.reference}: {fmt(ref.median_tokens_per_s, '.1f')} tokens/s, {s.engine_reference}: "
        f"{fmt(engine and engine.median_tokens_per_s, '.1f')} tokens/s (medians over {ref.num_samples} prompt turns)",
        f"{'method':<24} {'tau':>6} {'vs ' + s.reference:>14} {'vs ' + str(s.engine_reference):>14} {'tokens/s':>9} "
        f"{'mismatches':>11}",
    ]
    for name, agg in overall.items():
        lines.append(
            f"{name:<24} {fmt(agg.tau):>6} {fmt(agg.speedup, '.2f', 'x'):>14} "
            f"{fmt(agg.engine_speedup, '.2f', 'x'):>14} {fmt(agg.median_tokens_per_s, '.1f'):>9} "
            f"{_mismatch_text(agg):>11}"
        )
    own = _engine(report.settings.engine)
    lines += own.summary_lines(report) if own is not None else []
    return "\n".join(lines)


def write_report(report: BenchReport, out_dir: str | Path) -> dict[str, Path]:
    """Check ``report`` (its JSON layout read back strictly, :meth:`BenchReport.from_dict`) and write
    ``report.json``, ``report.md`` and the plots into ``out_dir``.

    Returns:
        ``{"json", "markdown", "speedup", "accepted_tokens_hist", "acceptance_by_depth"}`` -> path.

    Raises:
        ValueError: the report does not read back (e.g. a non-finite number), listing every problem.
    """
    layout = report.to_dict()
    BenchReport.from_dict(layout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(layout, allow_nan=False))  # compact: token lists are long
    paths["markdown"].write_text(markdown_report(report))
    for p in write_plots(report, out):
        paths[p.stem] = p
    return paths
