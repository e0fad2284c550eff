"""The bench's PNG plots: speedup by category, accepted tokens per step, acceptance rate by depth."""

from __future__ import annotations

from pathlib import Path

from selfspec.bench.report import BenchReport


def write_plots(report: BenchReport, out_dir: Path) -> list[Path]:
    """Write ``speedup.png`` (over the reference, and over the engine-only baseline), ``accepted_tokens_hist.png``
    and ``acceptance_by_depth.png`` into ``out_dir``
    (matplotlib, no pyplot state: a bare ``Figure`` renders with the Agg canvas). Returns the paths."""
    # matplotlib is imported here, not at module top: it is only needed when plots are written, and it
    # costs a second or two to import.
    from matplotlib.figure import Figure

    names = list(report.methods)
    groups = report.categories + ["overall"]
    paths = []

    s = report.settings
    fig = Figure(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(names)) / 2), 7.0))
    width = 0.8 / max(1, len(names))
    panels = (
        ("speedup", s.reference, "with the engine's kernels"),
        ("engine_speedup", s.engine_reference, "speculation"),
    )
    for ax, (field, against, what) in zip(fig.subplots(2, 1, sharex=True), panels, strict=True):
        for i, name in enumerate(names):
            summ = report.summary[name]
            aggs = [summ.by_category[c] for c in report.categories] + [summ.overall]
            vals = [a.speedup if field == "speedup" else a.engine_speedup for a in aggs]
            ax.bar([g + i * width for g in range(len(groups))], [v or 0.0 for v in vals], width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"vs {against} (median)")
        ax.set_title(f"Speedup over {against} ({what})")
    ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))], groups, rotation=30, ha="right")
    fig.axes[0].legend(fontsize="small")
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=100)

    spec_names = [n for n in names if any(s.results[n].accepted_per_step for s in report.samples)]
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.subplots()
    width = 0.8 / max(1, len(spec_names))
    for i, name in enumerate(spec_names):
        counts = [c for s in report.samples for c in (s.results[name].accepted_per_step or [])]
        values = range(1, max(counts) + 1)
        ax.bar(
            [v - 0.4 + (i + 0.5) * width for v in values],
            [counts.count(v) / len(counts) for v in values],
            width,
            label=name,
        )
    if not spec_names:
        ax.text(0.5, 0.5, "no speculative methods", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize="small")
    ax.set_xlabel("tokens produced per verification step (accepted drafts + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accepted tokens per step")
    fig.tight_layout()
    paths.append(out_dir / "accepted_tokens_hist.png")
    fig.savefig(paths[-1], dpi=100)

    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.subplots()
    plotted = False
    for name in names:
        rates = report.summary[name].overall.acceptance_by_depth
        if rates:
            values = [r if r is not None else float("nan") for r in rates]
            ax.plot(range(1, len(rates) + 1), values, marker="o", label=name)
            plotted = True
    if plotted:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no speculative methods", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("tree depth")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0.0, 1.05)
    ax.set_title("Acceptance rate by depth")
    fig.tight_layout()
    paths.append(out_dir / "acceptance_by_depth.png")
    fig.savefig(paths[-1], dpi=100)
    return paths
