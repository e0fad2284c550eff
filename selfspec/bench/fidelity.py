"""``python -m selfspec.bench.fidelity``: does an exported head accept in each engine what it accepts in selfspec?

What is compared: one EAGLE-3 head, the same prompts and greedy settings, decoded as a chain of k draft tokens
(k = 1, 2, 3 by default: no tree, no confidence cut) in every engine of the registry that takes part
(:attr:`selfspec.engines.registry.Engine.chains`), each on the one bench driver
(:func:`selfspec.bench.driver.run_engine`) with its own plain decoding beside it. selfspec's own engine
(:data:`REFERENCE`) is the one the others are compared with: its EAGLE drafter with ``top_k=1``, ``depth=k``,
``total_tokens=k``; llama.cpp's ``draft-eagle3`` with ``--spec-draft-n-max k --spec-draft-p-min 0``; vLLM's
``num_speculative_tokens=k``; OpenVINO GenAI's ``num_assistant_tokens=k`` (each engine's ``chains``).

Why: the engines compute the head with their own code (vocabulary map, norms, fused layers, rotary positions). The
same greedy target and the same head should accept the same drafts; an engine that accepts less at some position
computes the head differently there. Every engine's report already carries, per prompt turn, the steps that drafted
a token at depth d (``drafted_by_depth``) and those whose accepted prefix reached it (``accepted_by_depth``):
selfspec's own statistics, vLLM's per-position counters, OpenVINO's per-iteration counts, llama.cpp's line per
verification step (``-lv 5``, :func:`selfspec.engines.llamacpp.bench.depth_counts`). :func:`fidelity_row` pools
them into acceptance per position, ``accepted[d] / drafted[d]``.

Noise bound: greedy decoding repeats exactly, so the noise is that of the finite set of drafts. Each position's
drafts are taken as Bernoulli trials; an engine is below selfspec at a position when selfspec's rate exceeds the
engine's by more than :data:`Z` pooled binomial standard errors, ``sqrt(p (1 - p) (1 / n_selfspec + 1 / n_engine))``
with ``p`` the two engines' pooled rate (:func:`shortfalls`). Drafts within one answer are correlated, so this bound
is, if anything, too narrow: a note is a lead to follow, the absence of one on few prompts proves little.

Outputs (``--out``): ``fidelity.json`` (:class:`FidelityReport`), ``fidelity.md`` (:func:`fidelity_markdown`) and each
engine's bench report as ``<engine>/report.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from selfspec.base.files import now_utc, write_json
from selfspec.bench.report import BenchReport
from selfspec.engines.registry import DEFAULT_ENGINE, EngineRun, engine, registered_engines

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from selfspec.bench.methods import BenchSettings
    from selfspec.prompts import BenchPrompt

logger = logging.getLogger(__name__)

REFERENCE = DEFAULT_ENGINE
"""The engine every other is compared with: selfspec's own decoding of the head."""
CHAIN_LENGTHS = (1, 2, 3)
Z = 2.0
"""Standard errors by which selfspec's acceptance must exceed an engine's before the engine is called below it."""


def chain_method(k: int) -> str:
    """The bench method name of the chain of ``k`` draft tokens: ``chain{k}``."""
    return f"chain{k}"


@dataclass(frozen=True)
class FidelityRow:
    """One engine at one chain length, pooled over the prompt turns.

    Attributes:
        engine: one of :func:`fidelity_engines`; chain_length: draft tokens per step (k).
        drafted, accepted: ``[d]``, d < k: steps that drafted a token at position d + 1, and steps whose accepted
            prefix reached it (counts of tokens).
        acceptance: ``[d]``: ``accepted[d] / drafted[d]`` (None where nothing was drafted).
        tau: tokens per target verification step (the engine's own report); None: not reported.
        outputs: prompt turns decoded; exact: of those, equal to the engine's plain output; near_ties: differing
            only at a near-tie of the target (reported apart, as the engines do).
        reference: the engine's plain method the outputs were compared with.
    """

    engine: str
    chain_length: int
    drafted: list[int]
    accepted: list[int]
    acceptance: list[float | None]
    tau: float | None
    outputs: int
    exact: int
    near_ties: int
    reference: str


@dataclass(frozen=True)
class Shortfall:
    """An engine's acceptance below selfspec's beyond the noise bound at one position.

    Attributes:
        engine, chain_length: the row; position: 1-based draft position.
        selfspec_rate, engine_rate: accepted / drafted at that position.
        standard_error: the pooled binomial standard error of the difference; z: the difference in those units.
    """

    engine: str
    chain_length: int
    position: int
    selfspec_rate: float
    engine_rate: float
    standard_error: float
    z: float


@dataclass(frozen=True)
class FidelityReport:
    """``fidelity.json``: the rows (engine x chain length), the shortfalls against selfspec, the noise bound (``z``
    standard errors) and what was run (head, target, prompts, ``max_new_tokens``, ``num_turns`` prompt turns)."""

    created_utc: str
    head: str
    target: str
    prompts: str
    max_new_tokens: int
    num_turns: int
    z: float
    rows: list[FidelityRow]
    shortfalls: list[Shortfall]


def fidelity_row(report: BenchReport, engine: str, chain_length: int, method: str | None = None) -> FidelityRow:
    """Pool one method of an engine's bench report into a :class:`FidelityRow`.

    Args:
        report: the engine's :class:`~selfspec.bench.report.BenchReport`.
        engine: its name (recorded; :func:`fidelity_engines`).
        chain_length: k, the draft tokens per step the method was run with.
        method: the method (default :func:`chain_method` of ``chain_length``).

    Raises:
        ValueError: the method is not in the report, a turn of it has no per-position counts (the engine did not
            report them: the message names the engine), or it drafted beyond ``chain_length`` (not a chain of k).
    """
    method = method or chain_method(chain_length)
    if method not in report.summary:
        raise ValueError(f"{engine}: no method {method!r} in the report (methods: {sorted(report.summary)})")
    drafted, accepted = [0] * chain_length, [0] * chain_length
    outputs = exact = ties = 0
    for sample in report.samples:
        r = sample.results[method]
        if r.drafted_by_depth is None or r.accepted_by_depth is None:
            raise ValueError(
                f"{engine}: method {method!r} reported no acceptance per draft position on {sample.question_id} turn "
                f"{sample.turn} (drafted_by_depth / accepted_by_depth); this engine's bench must fill them"
            )
        if len(r.drafted_by_depth) > chain_length and any(r.drafted_by_depth[chain_length:]):
            raise ValueError(
                f"{engine}: method {method!r} drafted {len(r.drafted_by_depth)} positions, more than its chain of "
                f"{chain_length}: it was not run as a chain of {chain_length}"
            )
        for d in range(min(chain_length, len(r.drafted_by_depth))):
            drafted[d] += r.drafted_by_depth[d]
            accepted[d] += r.accepted_by_depth[d] if d < len(r.accepted_by_depth) else 0
        outputs += 1
        exact += r.matches_reference is True
        ties += bool(r.near_tie)
    return FidelityRow(
        engine=engine,
        chain_length=chain_length,
        drafted=drafted,
        accepted=accepted,
        acceptance=[a / n if n else None for a, n in zip(accepted, drafted, strict=True)],
        tau=report.summary[method].overall.tau,
        outputs=outputs,
        exact=exact,
        near_ties=ties,
        reference=report.settings.reference,
    )


def pooled_standard_error(a1: int, n1: int, a2: int, n2: int) -> float:
    """The binomial standard error of ``a1 / n1 - a2 / n2`` under equal rates: ``sqrt(p (1 - p) (1 / n1 + 1 / n2))``,
    ``p = (a1 + a2) / (n1 + n2)``.

    Raises:
        ValueError: ``n1`` or ``n2`` is not positive.
    """
    if n1 <= 0 or n2 <= 0:
        raise ValueError(f"both sides need drafted tokens, got {n1} and {n2}")
    p = (a1 + a2) / (n1 + n2)
    return math.sqrt(p * (1.0 - p) * (1.0 / n1 + 1.0 / n2))


def shortfalls(rows: Sequence[FidelityRow], z: float = Z) -> list[Shortfall]:
    """Every (engine, chain length, position) where selfspec's acceptance exceeds the engine's by more than ``z``
    pooled standard errors (:func:`pooled_standard_error`); a position either side did not draft is skipped, and
    equal rates of 0 or 1 (standard error 0) are no shortfall."""
    ours = {r.chain_length: r for r in rows if r.engine == REFERENCE}
    found = []
    for row in rows:
        base = ours.get(row.chain_length)
        if row.engine == REFERENCE or base is None:
            continue
        for d in range(row.chain_length):
            n1, n2 = base.drafted[d], row.drafted[d]
            if not n1 or not n2:
                continue
            p1, p2 = base.accepted[d] / n1, row.accepted[d] / n2
            se = pooled_standard_error(base.accepted[d], n1, row.accepted[d], n2)
            if p1 - p2 > z * se and se > 0:  # se = 0 only when both rates are 0 or both are 1
                found.append(Shortfall(row.engine, row.chain_length, d + 1, p1, p2, se, (p1 - p2) / se))
    return found


def _rate(accepted: int, drafted: int) -> str:
    return f"{accepted / drafted:.2f} ({accepted}/{drafted})" if drafted else "-"


def fidelity_markdown(report: FidelityReport) -> str:
    """``fidelity.md``: one row per engine and chain length (acceptance per position as ``rate (accepted/drafted)``,
    tau, drafted and accepted totals, outputs equal to the engine's plain output), then a note per shortfall."""
    width = max((r.chain_length for r in report.rows), default=0)
    head = ["engine", "k", *(f"pos {d + 1}" for d in range(width)), "tau", "drafted", "accepted", "exact"]
    lines = [
        f"# Export fidelity: {report.head}",
        "",
        f"Target {report.target}, {report.num_turns} prompt turns of {report.prompts}, greedy, {report.max_new_tokens} "
        "new tokens; each head method a chain of k draft tokens (no tree, no confidence cut). Acceptance at a "
        "position: steps whose accepted prefix reached it / steps that drafted it. Exact: outputs equal to the "
        "engine's own plain output (near-ties of the target counted apart).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in report.rows:
        cells = [_rate(r.accepted[d], r.drafted[d]) if d < r.chain_length else "" for d in range(width)]
        exact = f"{r.exact}/{r.outputs}" + (f" (+{r.near_ties} near-tie)" if r.near_ties else "")
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        row = [r.engine, str(r.chain_length), *cells, tau, str(sum(r.drafted)), str(sum(r.accepted)), exact]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        f"Noise bound: an engine is below selfspec at a position when selfspec's rate exceeds its rate by more than "
        f"{report.z:g} pooled binomial standard errors of the two counts (drafts taken as independent trials).",
        "",
    ]
    if not report.shortfalls:
        lines.append("No engine accepts less than selfspec beyond that bound.")
    for s in report.shortfalls:
        lines.append(
            f"- **{s.engine}**, chain of {s.chain_length}, position {s.position}: {s.engine_rate:.2f} against "
            f"selfspec's {s.selfspec_rate:.2f}, {s.z:.1f} standard errors ({s.standard_error:.3f}) below: the "
            "engine computes the head differently here (vocabulary map, a norm, the fused layers, rotary positions)."
        )
    return "\n".join(lines) + "\n"


def build_report(
    reports: Mapping[str, BenchReport],
    chain_lengths: Sequence[int],
    *,
    head: str,
    target: str,
    prompts: str,
    z: float = Z,
) -> FidelityReport:
    """The :class:`FidelityReport` of every engine's bench report (engine -> report, in :func:`fidelity_engines`
    order), each holding the methods :func:`chain_method` of every length in ``chain_lengths``.

    Raises:
        ValueError: a report without per-position counts or a chain method (:func:`fidelity_row`), or no reports.
    """
    if not reports:
        raise ValueError("no engine reports to compare")
    known = fidelity_engines()
    order = [e for e in known if e in reports] + [e for e in reports if e not in known]
    rows = [fidelity_row(reports[e], e, k) for e in order for k in chain_lengths]
    first = reports[order[0]]
    return FidelityReport(
        created_utc=now_utc(),
        head=head,
        target=target,
        prompts=prompts,
        max_new_tokens=first.settings.max_new_tokens,
        num_turns=len(first.samples),
        z=z,
        rows=rows,
        shortfalls=shortfalls(rows, z),
    )


def write_fidelity(report: FidelityReport, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``fidelity.json`` and ``fidelity.md`` under ``out_dir``; returns their paths."""
    out = Path(out_dir)
    path = write_json(out / "fidelity.json", dataclasses.asdict(report))
    md = out / "fidelity.md"
    md.write_text(fidelity_markdown(report))
    return path, md


def fidelity_engines() -> tuple[str, ...]:
    """The registered engines that take part (those with :attr:`~selfspec.engines.registry.Engine.chains`),
    :data:`REFERENCE` first."""
    return tuple(name for name in registered_engines() if engine(name).chains is not None)


def missing_engines(engines: Sequence[str]) -> dict[str, str]:
    """Engine -> why it cannot run here, with the command that builds it, for each of ``engines`` that is not built
    (:attr:`~selfspec.engines.registry.Engine.missing`). Nothing is started."""
    return {name: why for name in engines if (why := engine(name).missing())}


def run_engine_chains(
    name: str,
    target: PreTrainedModel,
    tokenizer: Any,
    head: str,
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    chain_lengths: Sequence[int],
    *,
    target_name: str,
    threads: int | None = None,
) -> BenchReport:
    """One engine's bench of ``head`` as a chain of each length k in ``chain_lengths`` (methods
    :func:`chain_method`), beside the engine's plain decoding, on ``prompts`` with greedy ``settings``
    (:class:`~selfspec.bench.methods.BenchSettings`): the engine's own
    :attr:`~selfspec.engines.registry.Engine.chains`.

    Raises:
        ValueError: an unknown engine or one that takes no part, sampling, or selfspec sized the drafter other than
            a chain of k.
        RuntimeError: the engine is not built (the message names the command), or it failed.
        selfspec.export.common.ExportError: the engine cannot load the head.
    """
    if settings.do_sample:
        raise ValueError("export fidelity is measured greedily: pass --temperature 0")
    record = engine(name)
    if record.chains is None:
        raise ValueError(f"engine {name!r} takes no part in the fidelity report; choose among {fidelity_engines()}")
    why = record.missing()
    if why:
        raise RuntimeError(why)
    lengths = {chain_method(k): k for k in chain_lengths}
    run = EngineRun(target, tokenizer, prompts, settings, target_name, dict.fromkeys(lengths, head), threads)
    return record.chains(run, lengths)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m selfspec.bench.fidelity`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m selfspec.bench.fidelity",
        description="Acceptance per draft position of one EAGLE-3 head in "
        + ", ".join(engine(name).title for name in fidelity_engines())
        + " at equal chain lengths, greedy, side by side (fidelity.json, fidelity.md).",
    )
    p.add_argument("--heads", required=True, metavar="DIR", help="the EAGLE-3 head directory")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name, directory or Hub id")
    p.add_argument("--prompts", required=True, help="MT-bench/Spec-Bench JSONL file (or 'sharegpt-heldout')")
    p.add_argument("--num-prompts", type=int, default=None, help="first N questions (default: all)")
    p.add_argument("--max-turns", type=int, default=1, help="turns per question (default 1: first turns)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain-lengths", type=int, nargs="+", default=list(CHAIN_LENGTHS), metavar="K")
    p.add_argument(
        "--engines",
        nargs="+",
        choices=fidelity_engines(),
        default=list(fidelity_engines()),
        help="engines to compare (default: all; selfspec is always run, the others are compared with it)",
    )
    p.add_argument("--threads", type=int, default=None, help="threads of every engine (default: each engine's own)")
    p.add_argument("--warmup", type=int, default=1, help="prompts every method runs once, untimed, first")
    p.add_argument("--z", type=float, default=Z, help=f"noise bound in pooled standard errors (default {Z:g})")
    p.add_argument("--out", default="runs/fidelity", help="directory for fidelity.json, fidelity.md, <engine>/")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run every engine of ``--engines`` and write the report; 0 on success, 1 when an engine fails, 2 on bad
    arguments or an engine not built here (the message names the command that builds it)."""
    import torch

    from selfspec.bench.methods import BenchSettings
    from selfspec.console import parse_command
    from selfspec.export.common import ExportError
    from selfspec.prompts import load_prompts
    from selfspec.target import load_target

    parser = build_parser()
    args = parse_command(parser, argv)
    engines = [REFERENCE, *(e for e in fidelity_engines() if e in args.engines and e != REFERENCE)]
    if any(k < 1 for k in args.chain_lengths) or args.z <= 0:
        parser.error("--chain-lengths must be >= 1 and --z > 0")
    missing = missing_engines(engines)
    if missing:
        built = " ".join(e for e in engines if e not in missing)
        parser.error(
            "; ".join(f"{e}: {why}" for e, why in missing.items())
            + f". Build them, or compare only what is built here: --engines {built}"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    chain_lengths = sorted(set(args.chain_lengths))
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens, warmup=args.warmup, target_name=args.target, prompts_source=args.prompts
    )
    prompts = load_prompts(args.prompts, args.num_prompts, args.max_turns, head_dirs=[args.heads])
    target, tokenizer = load_target(args.target, dtype="float32", device="cpu")
    reports = {}
    out = Path(args.out)
    for name in engines:
        logger.info("fidelity: %s, chains of %s", name, chain_lengths)
        try:
            reports[name] = run_engine_chains(
                name, target, tokenizer, args.heads, prompts, settings, chain_lengths,
                target_name=args.target, threads=args.threads,
            )  # fmt: skip
        except (ValueError, ExportError) as err:
            parser.error(f"{name}: {err}")
        except RuntimeError as err:
            print(f"selfspec fidelity: {name} failed: {err}", file=sys.stderr)
            return 1
        write_json(out / name / "report.json", dataclasses.asdict(reports[name]))
    report = build_report(reports, chain_lengths, head=args.heads, target=args.target, prompts=args.prompts, z=args.z)
    paths = write_fidelity(report, out)
    print(fidelity_markdown(report))
    print(f"wrote {paths[0]}, {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
