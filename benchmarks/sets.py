"""Per prompt set: the median speedup and mean tau of every method of one ``selfspec bench`` report.

A bench over several prompt sets in one run takes one JSONL whose categories name the set first
(``mt_bench/writing``, ``humaneval``, ``gsm8k``); this groups the report's samples by that first part and
prints a Markdown table: per set, each method's median over prompts of (its tokens/s / the reference's on
the same prompt) and its mean tau, then the mean of the set medians.

    python -m benchmarks.sets runs/combo/out/report.json [--reference baseline]
"""

from __future__ import annotations

import argparse
import json
import statistics


def set_table(report: dict, reference: str = "baseline") -> str:
    """The Markdown table for a report dict (``report.json``): one row per set, one column per method but
    ``reference``, each cell the median per-prompt speedup over ``reference`` and the mean tau.

    Raises:
        KeyError: a sample lacks ``reference`` or a method.
    """
    groups: dict[str, list[dict]] = {}
    for sample in report["samples"]:
        groups.setdefault(sample["category"].split("/")[0], []).append(sample)
    methods = [m for m in report["samples"][0]["results"] if m != reference]
    lines = ["| set | n | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    medians: dict[str, list[float]] = {m: [] for m in methods}
    for name, samples in groups.items():
        cells = []
        for m in methods:
            ratios = [s["results"][m]["tokens_per_s"] / s["results"][reference]["tokens_per_s"] for s in samples]
            taus = [s["results"][m]["tau"] for s in samples if s["results"][m].get("tau")]
            medians[m].append(statistics.median(ratios))
            tau = f" (tau {statistics.mean(taus):.2f})" if taus else ""
            cells.append(f"{medians[m][-1]:.3f}x{tau}")
        lines.append(f"| {name} | {len(samples)} | " + " | ".join(cells) + " |")
    lines.append("| mean of sets | | " + " | ".join(f"{statistics.mean(v):.3f}x" for v in medians.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.sets REPORT [--reference NAME]``: print the table; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.sets", description=__doc__.splitlines()[0])
    p.add_argument("report", help="a selfspec bench report.json")
    p.add_argument("--reference", default="baseline", help="the method every speedup is taken against")
    args = p.parse_args(argv)
    with open(args.report) as f:
        print(set_table(json.load(f), args.reference))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
