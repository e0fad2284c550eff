"""selfspec's own bench engine: every method a callable on prompt ids, run in this process and timed here, on the
one bench driver (:func:`selfspec.bench.driver.run_engine`)."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from selfspec.bench.driver import BenchEngine, Outcome, Turn, run_engine, settings_record
from selfspec.bench.methods import BenchMethod, BenchSettings, MethodFn
from selfspec.bench.report import BenchReport, MethodRecord, Result, SettingsRecord
from selfspec.decode.loop import GenerationStats
from selfspec.prompts import BenchPrompt, Message, encode_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset (MiB); CPU: the process's peak RSS so far (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


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


def _result(tokens: list[int], stats: GenerationStats | None, wall_s: float, memory_mb: float, eos: set[int]) -> Result:
    """One call's record, before the comparison with the reference (``speedup`` etc. still None)."""
    spec = stats is not None
    return Result.of_call(
        tokens,
        wall_s,
        stats.finish_reason if spec else ("stop" if tokens and tokens[-1] in eos else "length"),
        peak_memory_mb=memory_mb,
        tau=stats.mean_accepted_tokens if spec and stats.steps else None,
        steps=stats.steps if spec else None,
        accepted_per_step=list(stats.accepted_per_step) if spec else None,
        accepted_by_depth=list(stats.accepted_by_depth) if spec else None,
        drafted_by_depth=list(stats.drafted_by_depth) if spec else None,
        tree_nodes=stats.tree_nodes if spec else None,
        prefill_s=stats.prefill_s if spec else None,
        draft_s=stats.draft_s if spec else None,
        verify_s=stats.verify_s if spec else None,
        plain_steps=stats.plain_steps if spec else None,
        drafting_off_steps=stats.drafting_off_steps if spec else None,
        drafting_off_s=stats.drafting_off_s if spec else None,
        steps_by_nodes={str(n): k for n, k in sorted(stats.steps_by_nodes.items())} if spec else None,
    )


class SelfspecEngine(BenchEngine):
    """The methods of one process (plain ``generate``, selfspec's drafters, custom callables) on the target's device:
    prompts as the chat template's token ids, each call timed as a whole (prefill included, CUDA synchronised).

    Args:
        target: the frozen target; its device, dtype and generation config are read.
        tokenizer: renders messages (``apply_chat_template``).
        methods: name -> :class:`BenchMethod`; must include ``settings.reference``.
        settings: the run's settings (the references' names, the stop ids).

    Raises:
        ValueError: the reference method is missing.
    """

    def __init__(
        self, target: PreTrainedModel, tokenizer: Any, methods: Mapping[str, BenchMethod], settings: BenchSettings
    ) -> None:
        if settings.reference not in methods:
            raise ValueError(f"methods must include the reference {settings.reference!r}: speedups are ratios to it")
        self.target, self.tokenizer, self.methods = target, tokenizer, dict(methods)
        self.names = list(methods)
        self.reference, self.engine_reference = settings.reference, settings.engine_reference
        self.device = next(target.parameters()).device
        self.eos = set(settings.stop_ids(target, tokenizer))

    def prompt(self, messages: Sequence[Message]) -> tuple[torch.Tensor, str | None]:
        return encode_messages(self.tokenizer, messages).to(self.device), None

    def run(self, name: str, turn: Turn, settings: BenchSettings) -> Outcome:
        return Outcome(_result(*_timed(self.methods[name], turn.ids, settings, self.device), self.eos))

    def method_records(self) -> dict[str, MethodRecord]:
        return {n: MethodRecord(m.kind, m.description, m.tree_budget) for n, m in self.methods.items()}

    def settings_record(self, settings: BenchSettings) -> SettingsRecord:
        return settings_record(settings, self.target, self.device, self.eos)


def run_bench(
    target: PreTrainedModel,
    tokenizer: Any,
    methods: Mapping[str, BenchMethod | MethodFn],
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
) -> BenchReport:
    """Run every method on every prompt turn, interleaved (:func:`selfspec.bench.driver.run_engine` on
    :class:`SelfspecEngine`), and return the report.

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
            target's context (:func:`~selfspec.bench.driver.prompt_limit`; longer turns are skipped, each with a
            log line).
    """
    methods = {
        n: m if isinstance(m, BenchMethod) else BenchMethod(m, "custom", "custom method") for n, m in methods.items()
    }
    return run_engine(SelfspecEngine(target, tokenizer, methods, settings), target, tokenizer, prompts, settings)
