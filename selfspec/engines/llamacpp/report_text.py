"""llama.cpp's own part of a bench report's text: the ``report.md`` section (build, chosen settings, verdicts, sweep,
cost decomposition) and the summary's verdict lines, from the report's ``llamacpp`` record."""

from __future__ import annotations

from selfspec.bench.outputs import fmt
from selfspec.bench.report import BenchReport, LlamaCppRecord

__all__ = ["llamacpp_lines", "report_lines", "summary_lines"]


def report_lines(report: BenchReport) -> list[str]:
    """The llama.cpp section of ``report.md`` (none without a ``llamacpp`` record)."""
    return llamacpp_lines(report.llamacpp) if report.llamacpp is not None else []


def summary_lines(report: BenchReport) -> list[str]:
    """One verdict line per speculative method for the stdout summary."""
    rec = report.llamacpp
    return [f"{name}: {text}" for name, text in rec.verdicts.items()] if rec is not None else []


def llamacpp_lines(rec: LlamaCppRecord) -> list[str]:
    """The llama.cpp section of ``report.md``: build, chosen settings, verdicts, sweep, cost decomposition."""
    lines = [
        "",
        "## llama.cpp",
        "",
        f"Build {rec.build}; target `{rec.target_gguf}`; settings chosen by {rec.chosen_by}.",
        "",
    ]
    lines += [
        "| method | spec type | draft max | p_min | draft threads | head GGUF | n-gram size |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, st in rec.chosen.items():
        cells = [
            st.spec_type,
            str(st.draft_max),
            fmt(st.p_min),
            fmt(st.draft_threads, "d"),
            st.outtype or "-",
        ]
        lines.append(f"| {name} | " + " | ".join([*cells, fmt(st.ngram_size, "d")]) + " |")
    lines += [""] + [f"- {name}: {text}" for name, text in rec.verdicts.items()]
    if rec.costs is not None:
        c = rec.costs
        verify = ", ".join(f"{k + 1}: {u:.2f}" for k, u in enumerate(c.verify_units))
        lines += [
            "",
            f"Cost decomposition (one target decode step = {c.token_ms:.2f} ms = 1 unit): a target forward over k "
            f"tokens costs {verify} units (llama-bench).",
        ]
        for name, units in c.draft_units.items():
            lines.append(
                f"- {name}: draft {fmt(units)} units per cycle (llama.cpp's draft timer); break-even tokens per "
                f"step {fmt(c.break_even_tau.get(name))}"
            )
    for name, points in rec.sweep.items():
        if not points:
            continue
        lines += ["", f"Sweep of {name} (calibration prompts, speedup over plain llama.cpp):", ""]
        lines += ["| draft max | p_min | draft threads | head GGUF | speedup | tokens/step | acceptance | draft ms |"]
        lines += ["|---|---|---|---|---|---|---|---|"]
        for pt in points:
            st = pt.setting
            lines.append(
                f"| {st.draft_max} | {fmt(st.p_min)} | {fmt(st.draft_threads, 'd')} | {st.outtype or '-'} | "
                f"{pt.speedup:.2f}x | {pt.tokens_per_step:.2f} | {fmt(pt.acceptance, '.1%')} | "
                f"{fmt(pt.draft_ms_per_cycle)} |"
            )
    return lines
