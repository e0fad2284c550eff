"""The one bench driver every engine plugs into: every method on every prompt turn, interleaved, into a
:class:`~selfspec.bench.report.BenchReport`.

An engine (:class:`BenchEngine`: selfspec's own in :mod:`selfspec.bench.run`, the others in their folders under
``selfspec/engines/``, each with its record in :mod:`selfspec.engines.registry`) says only what is its own: its
methods, how it renders a prompt, how it runs one method on one prompt turn, which of its methods is the plain
reference and which its own decoding without drafts, its settings record and what only it measures.
The driver does the rest, the same for every engine:

* a warm-up over the first ``settings.warmup`` prompts, every method once;
* for every prompt turn, every method once, in an order rotated from turn to turn so none always runs first; a
  later turn of a question is conditioned on the reference's answer to the earlier ones, so every method sees the
  same prompt; a turn over :func:`prompt_limit` ends its question, with a log line;
* the speedups against the reference and the engine's own no-draft decoding, and (greedy) the exactness check
  against the engine's reference output (:func:`compare_to_reference`);
* the report: per-method summaries (:func:`summarize`), the settings and environment records.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import transformers
from tqdm.auto import tqdm

from selfspec.base.files import now_utc
from selfspec.bench.methods import BenchSettings
from selfspec.bench.report import (
    SCHEMA_VERSION,
    Aggregate,
    BenchReport,
    EnvironmentRecord,
    MethodRecord,
    MethodSummary,
    Mismatch,
    Result,
    Sample,
    SettingsRecord,
    Skipped,
)
from selfspec.prompts import BenchPrompt, Message

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One prompt turn as every method of a run is given it.

    Attributes:
        question_id, category: the question's.
        turn: its number in the question (1-based).
        ids: Long ``[T]``, the prompt's token ids as the target's tokenizer reads them (the prompt length of the
            report and of :func:`prompt_limit`); on the engine's device.
        text: the prompt text an engine that takes text is given; None for an engine that takes ids.
        warmup: a warm-up turn: run, but nothing of it is reported.
    """

    question_id: str
    category: str
    turn: int
    ids: torch.Tensor
    text: str | None = None
    warmup: bool = False


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One method's call on one turn: its :class:`~selfspec.bench.report.Result` (speedups and the comparison still
    None) and the text it produced (None for an engine that returns ids only)."""

    result: Result
    text: str | None = None


class BenchEngine(abc.ABC):
    """What an engine supplies to :func:`run_engine`.

    Attributes (set by the subclass): ``names`` (the methods, in report order; the reference and the engine
    reference among them), ``reference`` (the method speedups are against, whose answers later turns are
    conditioned on), ``engine_reference`` (the engine's own decoding without drafts: the second speedup),
    ``device`` (where the target runs, for the environment record).
    """

    names: list[str]
    reference: str
    engine_reference: str
    device: torch.device

    @abc.abstractmethod
    def prompt(self, messages: Sequence[Message]) -> tuple[torch.Tensor, str | None]:
        """The prompt of a chat: ``(ids Long [T] on the engine's device, text or None)`` (:class:`Turn`)."""

    @abc.abstractmethod
    def run(self, name: str, turn: Turn, settings: BenchSettings) -> Outcome:
        """Run method ``name`` once on ``turn`` with ``settings`` (its ``seed`` is the turn's,
        :meth:`turn_seed`), timed."""

    @abc.abstractmethod
    def method_records(self) -> dict[str, MethodRecord]:
        """The report's record of every method of ``names``."""

    @abc.abstractmethod
    def settings_record(self, settings: BenchSettings) -> SettingsRecord:
        """The report's settings record (:func:`settings_record` with the fields this engine changes)."""

    def turn_seed(self, settings: BenchSettings, index: int) -> int:
        """The seed of the ``index``-th measured turn: ``settings.seed + index`` (every turn samples afresh)."""
        return settings.seed + index

    def compare(
        self, sample: Sample, turn: Turn, outcomes: dict[str, Outcome], settings: BenchSettings
    ) -> tuple[Sample, list[Mismatch], list[Mismatch]]:
        """:func:`compare_to_reference` of one sample: every output against the reference's, token by token."""
        return compare_to_reference(sample, self.reference, self.engine_reference, settings.do_sample)

    def answer(self, outcome: Outcome, tokenizer: Any) -> str:
        """The reference's answer that later turns of a question are conditioned on: its tokens decoded without
        special tokens."""
        return tokenizer.decode(outcome.result.tokens, skip_special_tokens=True)

    def finish(self, report: BenchReport) -> BenchReport:
        """The report with what only this engine measures added (its own record field); by default ``report``."""
        return report


def run_engine(
    engine: BenchEngine,
    target: PreTrainedModel,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
) -> BenchReport:
    """Run every method of ``engine`` on every prompt turn, interleaved (the module docstring), and return the
    report.

    Args:
        engine: the engine and its methods.
        target: the target as ``transformers`` loads it: its context length (:func:`prompt_limit`) only.
        tokenizer: the engine's answers are rendered into later turns through ``engine.prompt``; passed to
            ``engine.answer``.
        prompts: the questions.
        settings: generation settings and report metadata.

    Returns:
        The :class:`BenchReport` (its :meth:`~BenchReport.check` passes).

    Raises:
        ValueError: no prompt turn fits ``max_prompt_tokens`` and the target's context (:func:`prompt_limit`;
            longer turns are skipped, each with a log line).
    """
    names = list(engine.names)
    limit = prompt_limit(target, settings)
    for prompt in prompts[: settings.warmup]:
        turn = _turn(engine, prompt, 1, prompt.first_turn_messages(), warmup=True)
        if limit is not None and turn.ids.numel() > limit:
            continue
        for name in names:
            engine.run(name, turn, settings)
            logger.info("warm-up %s done", name)
    played = play_turns(engine, tokenizer, prompts, settings, limit)
    if not played.samples:
        raise ValueError("no prompt turn was run: every prompt is longer than max_prompt_tokens, or no prompts")

    categories = sorted({s.category for s in played.samples})
    summary = {n: summarize(played.samples, n, categories, settings.do_sample) for n in names}
    report = BenchReport(
        schema_version=SCHEMA_VERSION,
        created_utc=now_utc(),
        settings=engine.settings_record(settings),
        environment=environment_record(engine.device),
        methods=engine.method_records(),
        categories=categories,
        samples=played.samples,
        skipped=played.skipped,
        mismatches=played.mismatches,
        ties=played.ties,
        summary=summary,
        llamacpp=None,
    )
    return engine.finish(report)


@dataclasses.dataclass
class Played:
    """What the interleaved loop of :func:`play_turns` gathers, in the order it ran.

    Attributes:
        samples: one per prompt turn run, every method's result in it.
        skipped: the turns over the prompt limit (each ends its question).
        mismatches / ties: outputs that differ from the reference's, and the differences at a near tie.
    """

    samples: list[Sample] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    mismatches: list[Mismatch] = dataclasses.field(default_factory=list)
    ties: list[Mismatch] = dataclasses.field(default_factory=list)


def play_turns(
    engine: BenchEngine,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    limit: int | None,
) -> Played:
    """Every method of ``engine`` once on every prompt turn, in an order rotated from turn to turn; a later turn of a
    question is conditioned on the reference's answer, and a turn over ``limit`` tokens ends its question. A ``tqdm``
    bar on stderr counts the prompts done of all, with the time left."""
    names = list(engine.names)
    played = Played()
    for prompt in tqdm(prompts, desc=f"bench ({len(names)} methods)", unit="prompt"):
        history: list[Message] = list(prompt.preamble)
        for number, content in enumerate(prompt.turns, start=1):
            messages = history + [{"role": "user", "content": content}]
            turn = _turn(engine, prompt, number, messages)
            if limit is not None and turn.ids.numel() > limit:
                logger.info(
                    "%s turn %d skipped: %d prompt tokens, over %d (max_prompt_tokens, or the target's "
                    "max_position_embeddings less max_new_tokens)",
                    prompt.question_id,
                    number,
                    turn.ids.numel(),
                    limit,
                )
                played.skipped.append(Skipped(prompt.question_id, number, turn.ids.numel()))
                break
            seed = engine.turn_seed(settings, len(played.samples))
            call_settings = dataclasses.replace(settings, seed=seed)
            k = len(played.samples) % len(names)
            outcomes = {name: engine.run(name, turn, call_settings) for name in names[k:] + names[:k]}
            results = {name: outcomes[name].result for name in names}
            sample = Sample(prompt.question_id, prompt.category, number, turn.ids.numel(), seed, results)
            sample, found, tied = engine.compare(sample, turn, outcomes, settings)
            played.mismatches += found
            played.ties += tied
            played.samples.append(sample)
            logger.info(
                "%s turn %d: %s",
                prompt.question_id,
                number,
                ", ".join(f"{n} {r.tokens_per_s:.1f} tok/s" for n, r in sample.results.items()),
            )
            answer = engine.answer(outcomes[engine.reference], tokenizer)
            history = messages + [{"role": "assistant", "content": answer}]
    return played


def _turn(
    engine: BenchEngine, prompt: BenchPrompt, number: int, messages: Sequence[Message], warmup: bool = False
) -> Turn:
    ids, text = engine.prompt(messages)
    return Turn(prompt.question_id, prompt.category, number, ids, text, warmup)


def prompt_limit(target: PreTrainedModel, settings: BenchSettings) -> int | None:
    """The longest prompt turn (tokens) the bench runs: ``settings.max_prompt_tokens``, and no more than leaves
    room for ``settings.max_new_tokens`` in the target's ``max_position_embeddings`` (when its config has one);
    None = no limit."""
    limits = [settings.max_prompt_tokens] if settings.max_prompt_tokens is not None else []
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        limits.append(max(0, context - settings.max_new_tokens))
    return min(limits) if limits else None


def first_difference(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (the shorter length if one is a prefix
    of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, tokens, strict=False)):  # lengths may differ
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def _token_at(tokens: Sequence[int], i: int) -> int | None:
    return tokens[i] if i < len(tokens) else None


def compare_to_reference(
    sample: Sample,
    reference: str,
    engine_reference: str,
    do_sample: bool,
    near_tie: Callable[[int], bool] | None = None,
    first_diff: Callable[[str], int | None] | None = None,
    exact_reference: str | None = None,
) -> tuple[Sample, list[Mismatch], list[Mismatch]]:
    """Fill ``speedup`` and ``engine_speedup`` (always) and ``matches_reference`` / ``first_diff`` /
    ``near_tie`` (greedy) for one sample.

    Args:
        sample: one prompt turn with every method's raw :class:`Result`.
        reference, engine_reference: the method names the two speedups are against.
        do_sample: sampled outputs legitimately differ (losslessness is a distribution property): no comparison.
        near_tie: ``near_tie(i)``: whether the reference's token at position i was a near-tie of the target;
            None: no difference is a near-tie (selfspec's engine, which must match exactly).
        first_diff: ``first_diff(method)``: where a method's output parts from the reference's (None: they
            agree); None: the first differing token (:func:`first_difference`).
        exact_reference: the method outputs are compared with (None: ``reference``).

    Returns:
        ``(sample, mismatches, ties)``: the filled sample, the greedy differences, and those at near-ties.
    """
    ref, engine = sample.results[reference], sample.results[engine_reference]
    exact = sample.results[exact_reference or reference]
    found, ties = [], []
    results = {}
    for name, rec in sample.results.items():
        speedup = rec.tokens_per_s / ref.tokens_per_s if ref.tokens_per_s > 0 else None
        engine_speedup = rec.tokens_per_s / engine.tokens_per_s if engine.tokens_per_s > 0 else None
        rec = dataclasses.replace(rec, speedup=speedup, engine_speedup=engine_speedup)
        if do_sample:
            results[name] = rec
            continue
        diff = first_difference(exact.tokens, rec.tokens) if first_diff is None else first_diff(name)
        tie = None if diff is None else bool(near_tie is not None and near_tie(diff))
        results[name] = dataclasses.replace(rec, matches_reference=diff is None, first_diff=diff, near_tie=tie)
        if diff is not None:
            where = (name, sample.question_id, sample.category, sample.turn, diff)
            (ties if tie else found).append(
                Mismatch(*where, _token_at(exact.tokens, diff), _token_at(rec.tokens, diff))
            )
    return dataclasses.replace(sample, results=results), found, ties


def memory_source(device: torch.device) -> str:
    """What ``peak_memory_mb`` measures on ``device`` when selfspec decodes there."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, reset before each call (per method)"
    return "resource.getrusage ru_maxrss: the process's high-water mark, shared by all methods"


def settings_record(
    settings: BenchSettings, target: PreTrainedModel, device: torch.device, eos: set[int]
) -> SettingsRecord:
    """The report's :class:`SettingsRecord` of a run of selfspec's engine on ``device``; another engine replaces the
    fields it does otherwise (``dataclasses.replace``)."""
    return SettingsRecord(
        target=settings.target_name or type(target).__name__,
        dtype=str(next(target.parameters()).dtype).removeprefix("torch."),
        device=str(device),
        threads=torch.get_num_threads(),
        max_new_tokens=settings.max_new_tokens,
        do_sample=settings.do_sample,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=0,
        seed=settings.seed,
        warmup=settings.warmup,
        max_prompt_tokens=settings.max_prompt_tokens,
        eos_token_ids=sorted(eos),
        reference=settings.reference,
        engine_reference=settings.engine_reference,
        engine="selfspec",
        timing="wall time of the whole call, prefill included (time.perf_counter; CUDA synchronised)",
        prompts_source=settings.prompts_source,
        tree_nodes=settings.tree_nodes,
        draft_model=settings.draft_model,
        memory_source=memory_source(device),
    )


def environment_record(device: torch.device) -> EnvironmentRecord:
    """The report's record of the software and machine the run had (``device``: the target's)."""
    return EnvironmentRecord(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        cpu_count=os.cpu_count() or 0,
        accelerator=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    )


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(samples: Sequence[Sample], method: str, categories: Sequence[str], do_sample: bool) -> MethodSummary:
    """Aggregate one method over every sample and per category (:class:`Aggregate`)."""
    return MethodSummary(
        overall=aggregate([s.results[method] for s in samples], do_sample),
        by_category={
            c: aggregate([s.results[method] for s in samples if s.category == c], do_sample) for c in categories
        },
    )


def _produced(record: Result) -> float:
    """Tokens a record's verification steps produced: the sum of its per-step counts, or (an engine that reports
    only totals) its tau times its steps."""
    if record.accepted_per_step is not None:
        return sum(record.accepted_per_step)
    return (record.tau or 0.0) * (record.steps or 0)


def aggregate(records: Sequence[Result], do_sample: bool) -> Aggregate:
    """One method over a set of prompt turns: medians of tokens/s and speedup, tau pooled over steps
    (accepted tokens per target verification forward), acceptance by depth, time shares, peak memory, and
    (greedy) the count of outputs differing from the reference."""
    with_stats = [r for r in records if r.steps is not None]
    steps = sum(r.steps for r in with_stats)
    by_depth = [r for r in with_stats if r.drafted_by_depth is not None and r.accepted_by_depth is not None]
    timed = [r for r in with_stats if r.draft_s is not None and r.verify_s is not None]
    wall = sum(r.wall_s for r in timed)
    depth = max((len(r.drafted_by_depth) for r in by_depth), default=0)
    accepted = [sum(r.accepted_by_depth[d] for r in by_depth if d < len(r.accepted_by_depth)) for d in range(depth)]
    drafted = [sum(r.drafted_by_depth[d] for r in by_depth if d < len(r.drafted_by_depth)) for d in range(depth)]
    rates = [a / d if d else None for a, d in zip(accepted, drafted, strict=True)]
    off = [r for r in with_stats if r.drafting_off_steps is not None and r.drafting_off_s is not None]
    off_steps, off_wall = sum(r.steps for r in off), sum(r.wall_s for r in off)
    sized = [r.steps_by_nodes for r in with_stats if r.steps_by_nodes is not None]
    by_nodes: dict[int, int] = {}
    for counts in sized:
        for nodes, n in counts.items():
            by_nodes[int(nodes)] = by_nodes.get(int(nodes), 0) + n
    return Aggregate(
        num_samples=len(records),
        median_tokens_per_s=_median([r.tokens_per_s for r in records]),
        speedup=_median([r.speedup for r in records]),
        engine_speedup=_median([r.engine_speedup for r in records]),
        tau=sum(_produced(r) for r in with_stats) / steps if steps else None,
        acceptance_by_depth=rates if by_depth else None,
        draft_share=sum(r.draft_s for r in timed) / wall if timed and wall > 0 else None,
        verify_share=sum(r.verify_s for r in timed) / wall if timed and wall > 0 else None,
        peak_memory_mb=max(r.peak_memory_mb for r in records) if records else None,
        mismatches=None if do_sample else sum(1 for r in records if r.matches_reference is False and not r.near_tie),
        near_ties=None if do_sample else sum(1 for r in records if r.near_tie),
        drafting_off_share=sum(r.drafting_off_steps for r in off) / off_steps if off_steps else None,
        drafting_off_time_share=sum(r.drafting_off_s for r in off) / off_wall if off and off_wall > 0 else None,
        steps_by_nodes={str(n): by_nodes[n] for n in sorted(by_nodes)} if sized else None,
    )
