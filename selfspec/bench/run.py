"""The measured run: every method on every prompt turn, interleaved, into a :class:`BenchReport`."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import transformers

from selfspec.bench.methods import BenchMethod, BenchSettings, MethodFn
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
from selfspec.decode.loop import GenerationStats
from selfspec.prompts import BenchPrompt, Message, encode_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset (MiB); CPU: the process's peak RSS so far (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def memory_source(device: torch.device) -> str:
    """What ``peak_memory_mb`` measures on ``device``."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, reset before each call (per method)"
    return "resource.getrusage ru_maxrss: the process's high-water mark, shared by all methods"


def _timed(
    method: BenchMethod, prompt_ids: torch.Tensor, settings: BenchSettings, device: torch.device
) -> tuple[list[int], GenerationStats | None, float, float]:
    """Run one method once. Returns ``(tokens, stats | None, wall_s, peak_memory_mb)``; CUDA is synchronised
    before and after so ``wall_s`` covers the GPU work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    result = method.run(prompt_ids, settings)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - t0
    tokens, stats = result if isinstance(result, tuple) else (result, None)
    return [int(t) for t in tokens], stats, wall_s, _peak_memory_mb(device)


def first_difference(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (the shorter length if one is a prefix
    of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, tokens, strict=False)):  # lengths may differ
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def _result(tokens: list[int], stats: GenerationStats | None, wall_s: float, memory_mb: float, eos: set[int]) -> Result:
    """One call's record, before the comparison with the reference (``speedup`` etc. still None)."""
    spec = stats is not None
    return Result(
        new_tokens=len(tokens),
        wall_s=wall_s,
        tokens_per_s=len(tokens) / wall_s if wall_s > 0 else 0.0,
        speedup=None,
        engine_speedup=None,
        peak_memory_mb=memory_mb,
        finish_reason=stats.finish_reason if spec else ("stop" if tokens and tokens[-1] in eos else "length"),
        tau=stats.mean_accepted_tokens if spec and stats.steps else None,
        steps=stats.steps if spec else None,
        accepted_per_step=list(stats.accepted_per_step) if spec else None,
        accepted_by_depth=list(stats.accepted_by_depth) if spec else None,
        drafted_by_depth=list(stats.drafted_by_depth) if spec else None,
        tree_nodes=stats.tree_nodes if spec else None,
        prefill_s=stats.prefill_s if spec else None,
        draft_s=stats.draft_s if spec else None,
        verify_s=stats.verify_s if spec else None,
        matches_reference=None,
        first_diff=None,
        near_tie=None,
        tokens=list(tokens),
    )


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


def prompt_limit(target: PreTrainedModel, settings: BenchSettings) -> int | None:
    """The longest prompt turn (tokens) the bench runs: ``settings.max_prompt_tokens``, and no more than leaves
    room for ``settings.max_new_tokens`` in the target's ``max_position_embeddings`` (when its config has one);
    None = no limit."""
    limits = [settings.max_prompt_tokens] if settings.max_prompt_tokens is not None else []
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        limits.append(max(0, context - settings.max_new_tokens))
    return min(limits) if limits else None


def run_bench(
    target: PreTrainedModel,
    tokenizer: Any,
    methods: Mapping[str, BenchMethod | MethodFn],
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
) -> BenchReport:
    """Run every method on every prompt turn, interleaved, and return the report.

    For each prompt turn every method runs once, in an order rotated from turn to turn so none always runs
    first, after a warm-up; a later turn of a question is conditioned on the reference's answer to the
    earlier ones, so every method sees the same token ids.

    Args:
        target: the frozen target; only its device, dtype and generation config are read here.
        tokenizer: renders messages (``apply_chat_template``) and decodes the reference answers that
            later turns are conditioned on (``decode``).
        methods: name -> :class:`BenchMethod` or a bare callable ``(prompt_ids [T], settings) ->
            (tokens, GenerationStats | None)``; must include ``settings.reference``.
        prompts: the questions.
        settings: generation settings and report metadata.

    Returns:
        The :class:`BenchReport` (its :meth:`~BenchReport.check` passes).

    Raises:
        ValueError: the reference method is missing, or no prompt turn fits ``max_prompt_tokens`` and the
            target's context (:func:`prompt_limit`; longer turns are skipped, each with a log line).
    """
    methods = {
        n: m if isinstance(m, BenchMethod) else BenchMethod(m, "custom", "custom method") for n, m in methods.items()
    }
    if settings.reference not in methods:
        raise ValueError(f"methods must include the reference {settings.reference!r}: speedups are ratios to it")
    device = _device(target)
    eos = set(settings.stop_ids(target, tokenizer))
    names = list(methods)

    limit = prompt_limit(target, settings)
    for prompt in prompts[: settings.warmup]:
        ids = encode_messages(tokenizer, prompt.first_turn_messages()).to(device)
        if limit is not None and ids.numel() > limit:
            continue
        for name in names:
            _timed(methods[name], ids, settings, device)
            logger.info("warm-up %s done", name)

    samples: list[Sample] = []
    skipped: list[Skipped] = []
    mismatches: list[Mismatch] = []
    for prompt in prompts:
        history: list[Message] = list(prompt.preamble)
        for turn, text in enumerate(prompt.turns, start=1):
            messages = history + [{"role": "user", "content": text}]
            ids = encode_messages(tokenizer, messages).to(device)
            if limit is not None and ids.numel() > limit:
                logger.info(
                    "%s turn %d skipped: %d prompt tokens, over %d (max_prompt_tokens, or the target's "
                    "max_position_embeddings less max_new_tokens)",
                    prompt.question_id,
                    turn,
                    ids.numel(),
                    limit,
                )
                skipped.append(Skipped(prompt.question_id, turn, ids.numel()))
                break
            seed = settings.seed + len(samples)
            call_settings = dataclasses.replace(settings, seed=seed)
            k = len(samples) % len(names)
            results = {}
            for name in names[k:] + names[:k]:
                results[name] = _result(*_timed(methods[name], ids, call_settings, device), eos)
            sample = Sample(
                prompt.question_id, prompt.category, turn, ids.numel(), seed, {name: results[name] for name in names}
            )
            sample, found, _ = compare_to_reference(
                sample, settings.reference, settings.engine_reference, settings.do_sample
            )
            mismatches += found
            samples.append(sample)
            logger.info(
                "%s turn %d: %s",
                prompt.question_id,
                turn,
                ", ".join(f"{n} {r.tokens_per_s:.1f} tok/s" for n, r in sample.results.items()),
            )
            answer = tokenizer.decode(sample.results[settings.reference].tokens, skip_special_tokens=True)
            history = messages + [{"role": "assistant", "content": answer}]
    if not samples:
        raise ValueError("no prompt turn was run: every prompt is longer than max_prompt_tokens, or no prompts")

    categories = sorted({s.category for s in samples})
    return BenchReport(
        schema_version=SCHEMA_VERSION,
        created_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        settings=settings_record(settings, target, device, eos),
        environment=environment_record(device),
        methods={n: MethodRecord(m.kind, m.description, m.tree_budget) for n, m in methods.items()},
        categories=categories,
        samples=samples,
        skipped=skipped,
        mismatches=mismatches,
        ties=[],
        summary={n: summarize(samples, n, categories, settings.do_sample) for n in names},
        llamacpp=None,
    )


def settings_record(
    settings: BenchSettings, target: PreTrainedModel, device: torch.device, eos: set[int]
) -> SettingsRecord:
    """The report's :class:`SettingsRecord` of a selfspec run (the llama.cpp engine replaces the fields that differ)."""
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
    )
