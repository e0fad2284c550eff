"""llama.cpp's speculation settings, chosen by measurement once per machine, and what a cycle costs there.

llama.cpp's defaults suit none of our cases: its n-gram drafters match 12-24 tokens and draft 48-64
(``common_params_speculative_ngram_*``), which almost never fires on chat prompts, and its EAGLE-3 path runs
one head pass per drafted token (``--spec-draft-n-max``, default 3) whether or not the head is confident. So
the settings are swept, as selfspec's tree budget is: on :data:`CALIBRATION_PROMPTS`, every setting of a short
coordinate search (:func:`candidate_settings`) runs interleaved with plain llama.cpp, and the best median
speedup wins. The result (chosen settings, every point measured, and the cost decomposition from
``llama-bench``) is cached under ``<cache root>/llamacpp-settings/`` per build, thread count, target and head
file, so a machine pays once.

The cost decomposition puts a cycle in target-token units (one plain decode step = 1): the target's forward
over k tokens (``llama-bench -p k``) and the draft's time per cycle (llama.cpp's draft timer). A cycle that
costs X units and yields tau tokens beats plain decoding only when tau > X: ``break_even_tau``.
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
from selfspec.bench.report import CostDecomposition, LlamaCppSetting, SweepPoint
from selfspec.engines.sweep import CALIBRATION_PROMPTS, CALIBRATION_TOKENS, SweepRecord, read_sweep
from selfspec.llamacpp import Generation, LlamaCpp, build_info, completion, forward_costs

logger = logging.getLogger(__name__)

SWEEP_VERSION = 2
HEAD_SPEC_TYPE = "draft-eagle3"
BLOCK_SPEC_TYPES = ("draft-dflash", "draft-dspark")
NGRAM_SPEC_TYPES = ("ngram-simple", "ngram-mod")


def setting_args(setting: LlamaCppSetting, threads: int) -> list[str]:
    """``llama-speculative-simple`` arguments of a setting (``--spec-type`` and the draft file excluded).

    Raises:
        ValueError: an unknown ``spec_type``.
    """
    st = setting
    if st.spec_type.startswith("draft-"):
        args = ["--spec-draft-n-max", str(st.draft_max)]
        if st.p_min is not None:
            args += ["--spec-draft-p-min", f"{st.p_min:g}"]
        n = st.draft_threads or threads
        return args + ["--spec-draft-threads", str(n), "--spec-draft-threads-batch", str(n)]
    if st.spec_type == "ngram-simple":
        size = ["--spec-ngram-simple-size-n", str(st.ngram_size), "--spec-ngram-simple-size-m", str(st.draft_max)]
        return size + ["--spec-ngram-simple-min-hits", "1"]
    if st.spec_type == "ngram-mod":
        size = ["--spec-ngram-mod-n-match", str(st.ngram_size), "--spec-ngram-mod-n-max", str(st.draft_max)]
        return size + ["--spec-ngram-mod-n-min", "1"]
    raise ValueError(
        f"unknown llama.cpp spec type {st.spec_type!r}: use {HEAD_SPEC_TYPE}, {BLOCK_SPEC_TYPES} or {NGRAM_SPEC_TYPES}"
    )


def head_setting(
    draft_max: int = 3,
    p_min: float = 0.0,
    draft_threads: int | None = None,
    outtype: str = "f16",
    spec_type: str = HEAD_SPEC_TYPE,
):
    """A head's setting (llama.cpp's defaults but the head's GGUF type: ``n_max`` 3, ``p_min`` 0); ``spec_type``
    ``draft-eagle3``, or ``draft-dflash`` / ``draft-dspark`` for block heads (``p_min``: DSpark's confidence cut)."""
    return LlamaCppSetting(spec_type, draft_max, p_min, draft_threads, outtype, None)


def ngram_setting(spec_type: str, draft_max: int = 8, ngram_size: int = 3) -> LlamaCppSetting:
    """An n-gram drafter's setting: match ``ngram_size`` tokens, draft up to ``draft_max`` (drafts that fire on
    chat prompts, unlike llama.cpp's defaults of 12-24 and 48-64)."""
    return LlamaCppSetting(spec_type, draft_max, None, None, None, ngram_size)


def candidate_settings(spec_type: str, best: LlamaCppSetting | None, stage: int) -> list[LlamaCppSetting]:
    """The coordinate search: stage s varies one field of the best setting so far (heads: GGUF type, draft
    length, ``p_min``, draft threads; n-gram drafters: match length, draft length); [] past the last stage."""
    if spec_type == HEAD_SPEC_TYPE or spec_type in BLOCK_SPEC_TYPES:
        base = best or head_setting(spec_type=spec_type)
        # a block drafts its whole length in one forward: its lengths reach the block (llama.cpp clamps to it)
        lengths = (1, 2, 3, 4, 6) if spec_type == HEAD_SPEC_TYPE else (2, 3, 4, 6, 8)
        stages = [
            [dataclasses.replace(base, outtype=t) for t in ("f16", "q8_0")],
            [dataclasses.replace(base, draft_max=k) for k in lengths],
            # p_min reaches 0.95: on a CPU the cut is the strongest lever (it drafts only where acceptance is likely)
            [dataclasses.replace(base, p_min=p) for p in (0.0, 0.5, 0.8, 0.9, 0.95)],
            [dataclasses.replace(base, draft_threads=t) for t in (None, 1)],
        ]
    else:
        base = best or ngram_setting(spec_type)
        stages = [
            [dataclasses.replace(base, ngram_size=n) for n in (2, 3, 4, 5)],
            [dataclasses.replace(base, draft_max=k) for k in (2, 4, 8, 16)],
        ]
    return stages[stage] if stage < len(stages) else []


@dataclass(frozen=True)
class SettingsChoice(SweepRecord):
    """A finished sweep: ``chosen`` and ``sweep`` per method, and the cost decomposition (the cache file)."""

    chosen: dict[str, LlamaCppSetting]
    sweep: dict[str, list[SweepPoint]]
    token_ms: float
    forward_ms: list[float]
    draft_ms: dict[str, float | None]


def cache_key(build: LlamaCpp, target_gguf: Path, threads: int, methods: dict[str, Path | None]) -> str:
    """What a sweep depends on: the build, the target file, the threads, each method's spec type and head file
    (its bytes), the calibration prompts."""
    digest = hashlib.sha256()
    stamp = build_info(build)
    parts = [SWEEP_VERSION, stamp.get("sdist"), stamp.get("cpu"), str(build.root), target_gguf.name, threads]
    parts += [CALIBRATION_PROMPTS, CALIBRATION_TOKENS]
    digest.update(json.dumps(parts, default=str).encode())
    for name, head in sorted(methods.items(), key=lambda kv: kv[0]):
        digest.update(name.encode())
        if head is not None:
            digest.update(hashlib.sha256(head.read_bytes()).digest())
    return digest.hexdigest()[:20]


def cache_path(key: str) -> Path:
    return cache_root() / "llamacpp-settings" / f"{key}.json"


def read_cached(key: str) -> SettingsChoice | None:
    """The cached sweep for ``key``, or None (none, or one this selfspec cannot read: it is measured again)."""
    return read_sweep(SettingsChoice, cache_path(key), key, SWEEP_VERSION, "llama.cpp sweep")


Runner = Callable[[LlamaCppSetting, str], Generation]
"""``run(setting, prompt_text) -> Generation``: one speculative run of ``CALIBRATION_TOKENS`` tokens."""


def measure_point(
    setting: LlamaCppSetting, texts: Sequence[str], run: Runner, plain: Callable[[str], Generation]
) -> SweepPoint:
    """One setting on every calibration prompt, each run right after a plain run of the same prompt."""
    ratios, new, accepted, drafted, draft_s, calls = [], 0, 0, 0, 0.0, 0
    for text in texts:
        base = plain(text)
        g = run(setting, text)
        ratios.append(g.tokens_per_second / base.tokens_per_second)
        new, accepted, drafted = new + g.new_tokens, accepted + g.accepted, drafted + g.drafted
        if g.draft_seconds is not None and g.draft_calls:
            draft_s, calls = draft_s + g.draft_seconds, calls + g.draft_calls
    return SweepPoint(
        setting=setting,
        speedup=statistics.median(ratios),
        tokens_per_step=new / max(1, new - accepted),
        acceptance=accepted / drafted if drafted else None,
        draft_ms_per_cycle=1000.0 * draft_s / calls if calls else None,
    )


def sweep(spec_type: str, texts: Sequence[str], run: Runner, plain: Callable[[str], Generation]) -> list[SweepPoint]:
    """The coordinate search for one method (:func:`candidate_settings`): every point measured, in order; a
    setting met twice is measured once."""
    points: dict[LlamaCppSetting, SweepPoint] = {}
    best: SweepPoint | None = None
    for stage in range(8):
        candidates = candidate_settings(spec_type, best.setting if best else None, stage)
        if not candidates:
            break
        for st in candidates:
            if st not in points:
                points[st] = measure_point(st, texts, run, plain)
                logger.info("llama.cpp sweep %s: %s -> %.2fx", spec_type, st, points[st].speedup)
        best = max((points[st] for st in candidates), key=lambda p: p.speedup)
    return list(points.values())


def best_point(points: Sequence[SweepPoint]) -> SweepPoint:
    """The point of highest median speedup (the first measured among equals)."""
    return max(points, key=lambda p: p.speedup)


def choose_settings(
    build: LlamaCpp,
    target_gguf: Path,
    texts: Sequence[str],
    methods: dict[str, tuple[str, Path | None]],
    run: Callable[[str, LlamaCppSetting, str], Generation],
    *,
    threads: int,
    fresh: bool = False,
) -> tuple[SettingsChoice, str]:
    """The settings of every method, from the cache or measured now, with the cost decomposition.

    Args:
        build, target_gguf: the llama.cpp build and the target's GGUF.
        texts: the calibration prompts, rendered (chat template applied).
        methods: method name -> ``(spec_type, head file or None)``; the head file (any of its GGUFs) keys the cache.
        run: ``run(method, setting, text)``: one speculative run of ``CALIBRATION_TOKENS`` tokens.
        threads: the target's threads.
        fresh: measure even when a cached sweep exists (and replace it).

    Returns:
        ``(choice, "cache" | "sweep")``.
    """
    key = cache_key(build, target_gguf, threads, {m: head for m, (_, head) in methods.items()})
    cached = None if fresh else read_cached(key)
    if cached is not None:
        return cached, "cache"

    def plain(text: str) -> Generation:
        return completion(build, target_gguf, text, n_predict=CALIBRATION_TOKENS, threads=threads)

    points = {
        name: sweep(spec_type, texts, lambda st, text, name=name: run(name, st, text), plain)
        for name, (spec_type, _) in methods.items()
    }
    chosen = {name: best_point(pts).setting for name, pts in points.items()}
    longest = max([st.draft_max for st in chosen.values()] + [1]) + 1
    token_ms, forward_ms = forward_costs(build, target_gguf, max_tokens=longest, threads=threads)
    draft_ms = {name: best_point(pts).draft_ms_per_cycle for name, pts in points.items()}
    choice = SettingsChoice(SWEEP_VERSION, key, chosen, points, token_ms, forward_ms, draft_ms)
    write_json(cache_path(key), dataclasses.asdict(choice))
    return choice, "sweep"


def decomposition(choice: SettingsChoice, draft_ms: dict[str, float | None]) -> CostDecomposition:
    """The cost decomposition of ``choice`` in target-token units; ``draft_ms``: each method's measured draft
    time per cycle in the bench run (the sweep's where the run has none)."""
    unit = choice.token_ms
    verify = [ms / unit for ms in choice.forward_ms]
    draft_units = {
        name: (ms / unit if ms is not None else None)
        for name, ms in ((n, draft_ms.get(n) or choice.draft_ms.get(n)) for n in choice.chosen)
    }
    break_even = {}
    for name, st in choice.chosen.items():
        k = min(st.draft_max, len(verify) - 1)  # a cycle verifies the root and up to draft_max drafts
        break_even[name] = verify[k] + (draft_units[name] or 0.0)
    return CostDecomposition(token_ms=unit, verify_units=verify, draft_units=draft_units, break_even_tau=break_even)
