"""What a bench run leaves behind: ``report.json``, ``report.md``, the plots, and the stdout summary."""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.bench.plots import write_plots
from selfspec.bench.report import Aggregate, BenchReport, TreeBudgetRecord


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _depth_text(rates: list[float | None] | None) -> str:
    return "-" if not rates else " / ".join(_fmt(r, ".2f") for r in rates)


_COLUMNS = (
    "tokens/s (median) | speedup (median) | tau | acceptance by depth | draft share | verify share | peak MiB | "
    "mismatches"
)


def _mismatch_text(agg: Aggregate) -> str:
    return "-" if agg.mismatches is None else f"{agg.mismatches}/{agg.num_samples}"


def _row(agg: Aggregate) -> str:
    return " | ".join(
        [
            str(agg.num_samples),
            _fmt(agg.median_tokens_per_s, ".1f"),
            _fmt(agg.speedup, ".2f", "x"),
            _fmt(agg.tau),
            _depth_text(agg.acceptance_by_depth),
            _fmt(agg.draft_share, ".0%"),
            _fmt(agg.verify_share, ".0%"),
            _fmt(agg.peak_memory_mb, ".0f"),
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
        speedup = _fmt(budget.expected_speedup, ".2f", "x")
        text += f": expected tau {budget.expected_tau:.2f}, expected speedup {speedup}"
    return text + ")"


def markdown_report(report: BenchReport) -> str:
    """``report.md``: settings, a table by method x category, an overall table, and the greedy mismatches."""
    s = report.settings
    mode = "greedy" if not s.do_sample else f"sampling T={s.temperature} top_p={s.top_p}"
    lines = [
        "# selfspec bench",
        "",
        f"Target `{s.target}` ({s.dtype}, {s.device}, {s.threads} threads), {mode}, "
        f"max {s.max_new_tokens} new tokens, prompts `{s.prompts_source or 'given in code'}` "
        f"({len(report.samples)} prompt turns), reference `{s.reference}`. Speedup: median over prompt "
        "turns of tokens/s divided by the reference's tokens/s on the same turn, same run.",
        "",
        "## By category",
        "",
        f"| method | category | n | {_COLUMNS} |",
        "|" + "---|" * 11,
    ]
    for name, summ in report.summary.items():
        for cat in report.categories:
            lines.append(f"| {name} | {cat} | {_row(summ.by_category[cat])} |")
    lines += ["", "## Overall", "", f"| method | n | {_COLUMNS} |", "|" + "---|" * 10]
    for name, summ in report.summary.items():
        lines.append(f"| {name} | {_row(summ.overall)} |")
    lines += ["", "## Methods", ""]
    lines += [f"- `{n}` ({m.kind}): {m.description}{_budget_text(m.tree_budget)}" for n, m in report.methods.items()]
    if not s.do_sample:
        lines += ["", "## Outputs differing from the reference (greedy)", ""]
        if report.mismatches:
            lines += ["| method | question | category | turn | first differing position |", "|---|---|---|---|---|"]
            for m in report.mismatches:
                lines.append(f"| {m.method} | {m.question_id} | {m.category} | {m.turn} | {m.first_diff} |")
        else:
            lines.append("None: every method produced the reference's tokens on every prompt turn.")
    if report.skipped:
        lines += ["", f"Skipped {len(report.skipped)} prompt turns longer than {s.max_prompt_tokens} tokens."]
    return "\n".join(lines) + "\n"


def summary_text(report: BenchReport) -> str:
    """The short stdout summary: reference tokens/s, then tau, speedup and mismatches per method."""
    ref = report.settings.reference
    overall = {n: s.overall for n, s in report.summary.items()}
    lines = [
        f"{ref}: {_fmt(overall[ref].median_tokens_per_s, '.1f')} tokens/s (median over "
        f"{overall[ref].num_samples} prompt turns)",
        f"{'method':<24} {'tau':>6} {'speedup':>8} {'tokens/s':>9} {'mismatches':>11}",
    ]
    for name, agg in overall.items():
        lines.append(
            f"{name:<24} {_fmt(agg.tau):>6} {_fmt(agg.speedup, '.2f', 'x'):>8} "
            f"{_fmt(agg.median_tokens_per_s, '.1f'):>9} {_mismatch_text(agg):>11}"
        )
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
