"""OpenVINO GenAI's draft length (``num_assistant_tokens``) per EAGLE-3 head, chosen by measurement once per machine.

OpenVINO GenAI drafts a chain of exactly ``num_assistant_tokens`` tokens per cycle (its EAGLE-3 pipeline takes no
confidence cut: ``assistant_confidence_threshold`` must be 0), so the length is the one setting. As the llama.cpp
settings are (:mod:`selfspec.engines.llamacpp.settings`, on the same prompts: :mod:`selfspec.engines.sweep`),
every length of :data:`DRAFT_LENGTHS` runs on the calibration prompts, each run right after plain OpenVINO GenAI on
the same prompt, and the best median speedup wins. The choice and every point are cached under
``<cache root>/openvino-settings/`` per OpenVINO GenAI version, thread count, target IR and draft IR (their cache
names are content hashes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from selfspec.base.files import cache_root, write_json
from selfspec.engines.sweep import CALIBRATION_PROMPTS, CALIBRATION_TOKENS, SweepRecord, read_sweep

logger = logging.getLogger(__name__)

SWEEP_VERSION = 1
DRAFT_LENGTHS = (1, 2, 3, 4, 6)


@dataclass(frozen=True)
class DraftLengthPoint:
    """One draft length on the calibration prompts.

    Attributes:
        num_assistant_tokens: the draft length.
        speedup: median over the prompts of tokens/s over plain OpenVINO GenAI's (whole generate calls).
        tokens_per_step: generated tokens per target verification (tau).
        acceptance: accepted / drafted tokens (None: nothing drafted).
    """

    num_assistant_tokens: int
    speedup: float
    tokens_per_step: float
    acceptance: float | None


@dataclass(frozen=True)
class DraftLengthChoice(SweepRecord):
    """A finished sweep (the cache file): ``chosen`` and ``sweep`` per method."""

    chosen: dict[str, int]
    sweep: dict[str, list[DraftLengthPoint]]


Call = Callable[[str, list[int], int | None], dict]
"""``call(method, prompt_ids, num_assistant_tokens)``: one generate call of ``CALIBRATION_TOKENS`` tokens, the
worker's reply (:mod:`selfspec.engines.openvino.openvino_worker`); ``method`` ``""`` is the plain pipeline."""


def cache_key(version: str, threads: int | None, target_ir: Path, drafts: dict[str, Path]) -> str:
    """What a sweep depends on: OpenVINO GenAI's version, the threads, the target IR and each method's draft IR (their
    directory names, content hashes), the calibration prompts and lengths."""
    parts = [SWEEP_VERSION, version, threads, target_ir.name, sorted((m, d.name) for m, d in drafts.items())]
    parts += [CALIBRATION_PROMPTS, CALIBRATION_TOKENS, DRAFT_LENGTHS]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    return cache_root() / "openvino-settings" / f"{key}.json"


def read_cached(key: str) -> DraftLengthChoice | None:
    """The cached sweep for ``key``, or None (none, or one this selfspec cannot read: it is measured again)."""
    return read_sweep(DraftLengthChoice, cache_path(key), key, SWEEP_VERSION, "OpenVINO sweep")


def steps_of(reply: dict) -> tuple[int, int, int]:
    """``(verification steps, accepted, drafted)`` of a speculative reply, from its per-iteration batch sizes."""
    cycles = (reply.get("batch_sizes") or [1])[1:]
    return len(cycles), sum(b - 1 for b in cycles), int(reply.get("drafted") or 0)


def measure(method: str, k: int, prompts: Sequence[list[int]], call: Call) -> DraftLengthPoint:
    """One draft length on every calibration prompt, each right after a plain call on the same prompt."""
    ratios, steps, tokens, accepted, drafted = [], 0, 0, 0, 0
    for ids in prompts:
        base = call("", ids, None)
        spec = call(method, ids, k)
        ratios.append((len(spec["tokens"]) / spec["wall_s"]) / (len(base["tokens"]) / base["wall_s"]))
        n, a, d = steps_of(spec)
        steps, tokens, accepted, drafted = steps + n, tokens + len(spec["tokens"]) - 1, accepted + a, drafted + d
    return DraftLengthPoint(
        k, statistics.median(ratios), tokens / max(1, steps), accepted / drafted if drafted else None
    )


def choose_draft_lengths(
    key: str, methods: Sequence[str], prompts: Sequence[list[int]], call: Call, *, fresh: bool = False
) -> tuple[DraftLengthChoice, str]:
    """The draft length of every method, from the cache or measured now (:data:`DRAFT_LENGTHS`).

    Args:
        key: :func:`cache_key` of the run.
        methods: the speculative methods.
        prompts: the calibration prompts' token ids (chat template applied).
        call: one generate call (:data:`Call`).
        fresh: measure even when a cached sweep exists (and replace it).

    Returns:
        ``(choice, "cache" | "sweep")``.
    """
    cached = None if fresh else read_cached(key)
    if cached is not None and set(cached.chosen) >= set(methods):
        return cached, "cache"
    sweep = {}
    for method in methods:
        sweep[method] = [measure(method, k, prompts, call) for k in DRAFT_LENGTHS]
        for point in sweep[method]:
            logger.info("OpenVINO sweep %s: %s", method, point)
    chosen = {m: max(points, key=lambda p: p.speedup).num_assistant_tokens for m, points in sweep.items()}
    choice = DraftLengthChoice(SWEEP_VERSION, key, chosen, sweep)
    write_json(cache_path(key), dataclasses.asdict(choice))
    return choice, "sweep"
