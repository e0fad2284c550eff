"""What a verification costs here, by tree size; cost profiles on disk.

A bigger draft tree accepts more tokens per step but costs more to verify, and how much more depends on
the device: on 2-core CPUs a 16-node verification costs 1.3-1.6 single-token passes, on an H200 128 nodes
cost ~1.2 (docs/ARCHITECTURE.md, "Facts this design rests on"). The budget choice
(:mod:`selfspec.decode.tuning.budget`, Sequoia-style, Chen et al. 2024, arXiv:2402.12374) needs both costs
measured on this machine:

* :class:`CostProfile`: median wall ms of one verification (:meth:`Verifier.forward_tree` +
  :meth:`Verifier.lm_logits`) by tree size, for this target on this device, dtype and thread count. On a
  CPU each size is measured with every kernel of :data:`~selfspec.base.cpu_linear.LINEAR_KERNELS`; the
  fastest is kept per size and becomes the verifier's kernel plan (:func:`tuned_verifier`), so decoding
  runs the way the cost was measured.
* a profile is trusted only when its medians are steady (:func:`~selfspec.decode.tuning.timing.measure_timings`:
  sizes interleaved, rounds repeated until every median's relative spread is inside the bound, or the
  measurement says the machine was busy and is kept out of the cache), and its costs are made
  non-decreasing in the number of nodes by a monotone fit (:func:`monotone_fit`, pool-adjacent-violators);
* the drafting cost by depth: :mod:`selfspec.decode.tuning.draft_costs`.

Both are cached as JSON under ``<cache root>/profiles`` (:func:`~selfspec.base.files.profiles_dir`),
keyed by :func:`cost_key`; the identity helpers here (:func:`cost_key`, :func:`profile_stem`) and the timing of
:mod:`selfspec.decode.tuning.timing` serve both.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base import cpu_linear
from selfspec.base.files import now_utc, profiles_dir, read_cached, read_dataclass, write_cached
from selfspec.base.fingerprint import target_fingerprint
from selfspec.decode import kv
from selfspec.decode.tuning import timing
from selfspec.decode.tuning.timing import TimingRule, measure_timings, monotone_fit
from selfspec.decode.verifier import Verifier

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DEFAULT_NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
DEFAULT_CONTEXT_LENGTH = 128
# 3: verify_ms is the fastest of the linear kernels measured; 4: verify_ms is the monotone fit of measured_ms, with
# each median's spread, the rounds and the seconds taken (a version-3 file is measured again, never mis-read)
COST_PROFILE_VERSION = 4
_COST_FORMAT = "selfspec-verify-cost"


# --------------------------------------------------------------------------------------------------
# What makes two measurements comparable


def _device_of(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def device_description(device: torch.device) -> str:
    """What a cost measurement ran on: ``"cuda:0 NVIDIA H200"`` or ``"cpu x86_64 (2 cpus)"``."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"{device.type} {platform.machine()} ({os.cpu_count() or 0} cpus)"


def cost_key(target: PreTrainedModel) -> dict[str, Any]:
    """The identity of a cost measurement: target fingerprint, device, dtype, torch threads, torch version.

    A cached profile is reused only when every field is equal.
    """
    return {
        "target_fingerprint": target_fingerprint(target),
        "device": device_description(_device_of(target)),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def profile_stem(key: Mapping[str, Any], device: torch.device) -> str:
    """The file name stem of a profile measured with ``key`` (:func:`cost_key`) on ``device``:
    ``"<fingerprint>-cpu-float32-t2"``."""
    slug = device.type + ("" if device.index is None else str(device.index))
    return f"{key['target_fingerprint']}-{slug}-{key['dtype']}-t{key['threads']}"


# --------------------------------------------------------------------------------------------------
# Verification cost


@dataclass(frozen=True)
class CostProfile:
    """Verification cost of one target on one machine, by tree size.

    Attributes:
        target_fingerprint, device, dtype, threads, torch: the measurement's identity (:func:`cost_key`).
        context_length: tokens in the KV cache before the tree.
        node_counts: tree sizes N measured (root included), strictly increasing, >= 1.
        verify_ms: median wall milliseconds of ``Verifier.forward_tree`` + ``Verifier.lm_logits`` at each size with the
            fastest linear kernel measured there (see ``kernels``).
        kernels: the kernel kept at each size, one of ``cpu_linear.LINEAR_KERNELS`` (all ``"linear"`` by default).
        kernel_ms: every measured curve, ``{kernel: [ms or None per node count]}``; ``"linear"`` is always
            there and complete (None where a kernel was not measured at that size).
        measured_ms: the medians of the kept kernels as measured; ``verify_ms`` is their monotone fit
            (:func:`monotone_fit`: a measured profile's cost never decreases with the number of nodes). Empty
            (the default) = ``verify_ms``.
        spread: the relative spread of each kept median (:func:`median_spread`; None where it is infinite: too
            few samples); empty = unknown (a profile not measured here: a nominal or per-row one).
        rounds: interleaved rounds the measurement took (0 = unknown).
        measure_s: wall seconds the measurement took (0.0 = unknown).
        disturbed: True when some median stayed outside the :class:`TimingRule`'s bound (a busy machine): such a
            profile is used for the process that measured it and never cached.
        created_utc: ISO 8601 time of the measurement.
    """

    target_fingerprint: str
    device: str
    dtype: str
    threads: int
    torch: str
    context_length: int
    node_counts: tuple[int, ...]
    verify_ms: tuple[float, ...]
    kernels: tuple[str, ...] = ()
    kernel_ms: Mapping[str, tuple[float | None, ...]] = field(default_factory=dict)
    measured_ms: tuple[float, ...] = ()
    spread: tuple[float | None, ...] = ()
    rounds: int = 0
    measure_s: float = 0.0
    disturbed: bool = False
    created_utc: str = ""

    def __post_init__(self) -> None:
        n = self.node_counts
        if not n or len(n) != len(self.verify_ms):
            raise ValueError("node_counts and verify_ms must be non-empty and of equal length")
        if not self.measured_ms:
            object.__setattr__(self, "measured_ms", tuple(self.verify_ms))
        if len(self.measured_ms) != len(n) or (self.spread and len(self.spread) != len(n)):
            raise ValueError("measured_ms (and spread, when given) must hold one value per node count")
        finite = (x is None or (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0) for x in self.spread)
        if not all(finite):
            raise ValueError("spread must hold finite non-negative numbers or None")
        if self.rounds < 0 or not self.measure_s >= 0:
            raise ValueError("rounds and measure_s must be non-negative")
        if self.threads < 1 or self.context_length < 1:
            raise ValueError("threads and context_length must be positive integers")
        if any(not isinstance(x, int) or x < 1 for x in n) or any(a >= b for a, b in zip(n, n[1:], strict=False)):
            raise ValueError(f"node_counts must be strictly increasing integers >= 1, got {list(n)}")
        if not self.kernels:
            object.__setattr__(self, "kernels", ("linear",) * len(n))
        curves = {k: tuple(v) for k, v in dict(self.kernel_ms).items()}
        curves.setdefault("linear", tuple(self.verify_ms))
        object.__setattr__(self, "kernel_ms", curves)
        if len(self.kernels) != len(n) or any(k not in cpu_linear.LINEAR_KERNELS for k in self.kernels):
            raise ValueError(
                f"kernels must name one of {cpu_linear.LINEAR_KERNELS} per node count, got {list(self.kernels)}"
            )

        def ok(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        if not all(ok(v) for v in self.verify_ms) or not all(ok(v) for v in self.measured_ms):
            raise ValueError("verify_ms and measured_ms must be finite positive numbers, one per node count")
        for name, values in curves.items():
            if (
                name not in cpu_linear.LINEAR_KERNELS
                or len(values) != len(n)
                or not all(v is None or ok(v) for v in values)
            ):
                raise ValueError(
                    f"kernel_ms[{name!r}] must be a known kernel with a finite positive ms or None per node count"
                )
        if any(v is None for v in curves["linear"]):
            raise ValueError("kernel_ms['linear'] must be measured at every node count")
        for i, kernel in enumerate(self.kernels):
            if kernel not in curves or curves[kernel][i] is None:
                raise ValueError(f"kernel {kernel!r} kept at {n[i]} nodes was not measured there")

    @property
    def verify_ms_linear(self) -> tuple[float, ...]:
        """The cost curve with plain ``linear`` everywhere."""
        return tuple(self.kernel_ms["linear"])

    def linear_only(self) -> CostProfile:
        """This profile as a verifier with plain ``linear`` everywhere decodes (no kernel plan: a drafter without
        heads): its ``linear`` curve as measured, ``verify_ms`` that curve's monotone fit."""
        lin = self.verify_ms_linear
        return replace(
            self,
            verify_ms=tuple(monotone_fit(lin)),
            kernels=("linear",) * len(lin),
            kernel_ms={"linear": lin},
            measured_ms=lin,
            spread=(),
        )

    def kernel_plan(self, max_nodes: int = 64) -> dict[int, str]:
        """The kernel of every tree size 1..``max_nodes`` for :meth:`~selfspec.decode.verifier.Verifier.set_plan`:
        a size takes the kernel measured at the largest measured size not above it (``"linear"`` below the
        smallest); ``"weight_first"`` stops at ``cpu_linear.WEIGHT_FIRST_MAX_ROWS``."""
        plan: dict[int, str] = {}
        for size in range(1, max_nodes + 1):
            below = [i for i, m in enumerate(self.node_counts) if m <= size]
            kernel = self.kernels[below[-1]] if below else "linear"
            if kernel != "linear" and cpu_linear.kernel_applies(kernel, size):
                plan[size] = kernel
        return plan

    @property
    def key(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("target_fingerprint", "device", "dtype", "threads", "torch")}

    @property
    def plain_step_ms(self) -> float:
        """ms of one plain decoding step: one token with plain ``linear`` (what ``generate`` does), from the
        1-node measurement; the cheapest measured size's cost when 1 node was not measured."""
        return float(self.kernel_ms["linear"][0] if self.node_counts[0] == 1 else self.verify_ms[0])

    def verify_cost_ms(self, num_nodes: float) -> float:
        """Expected ms to verify a tree of ``num_nodes`` nodes (root included).

        Piecewise-linear interpolation between ``verify_ms``, exact at measured sizes. Below the smallest size:
        that size's cost; above the largest: the last segment's slope. A measured profile's ``verify_ms`` is the
        monotone fit of its medians (:func:`monotone_fit`): single medians dip (BLAS picks kernels by shape, and a
        busy moment lands on one size: a profile on the 2-core development machine had 2 nodes dearer than 3), and
        a chooser that believed a dip would pick the size by its noise. So this cost never decreases with the
        tree, and the interpolation keeps that.
        """
        xs, ys = self.node_counts, self.verify_ms
        if num_nodes <= xs[0] or len(xs) == 1:
            return ys[0] if num_nodes <= xs[0] else ys[-1]
        for i in range(1, len(xs)):
            if num_nodes <= xs[i]:
                t = (num_nodes - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + t * (ys[i] - ys[i - 1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (num_nodes - xs[-1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _COST_FORMAT,
            "version": COST_PROFILE_VERSION,
            **self.key,
            "context_length": self.context_length,
            "node_counts": list(self.node_counts),
            "verify_ms": list(self.verify_ms),
            "kernels": list(self.kernels),
            "kernel_ms": {k: list(v) for k, v in self.kernel_ms.items()},
            "measured_ms": list(self.measured_ms),
            "spread": list(self.spread),
            "rounds": self.rounds,
            "measure_s": self.measure_s,
            "disturbed": self.disturbed,
            "created_utc": self.created_utc,
        }

    @classmethod
    def from_dict(cls, data: Any) -> CostProfile:
        """Parse :meth:`to_dict`'s layout strictly. Raises ValueError on anything else, a file of another version
        included (:func:`get_cost_profile` then measures again)."""
        return read_dataclass(cls, data, header={"format": _COST_FORMAT, "version": COST_PROFILE_VERSION})


def _profile_parents(num_nodes: int, chain: bool = False) -> torch.Tensor:
    """A bushy tree of ``num_nodes`` nodes (node i's parent is ``(i - 1) // 2``): from 3 nodes on it takes
    the tree-mask path of :meth:`Verifier.forward_tree`, as EAGLE-2 trees do. With ``chain``, a chain of
    ``num_nodes`` nodes (node i's parent is i - 1): what a target verified on chains only verifies
    (:attr:`Verifier.chains_only`, :mod:`selfspec.decode.state`)."""
    if chain:
        return torch.arange(-1, num_nodes - 1, dtype=torch.long)
    return torch.tensor([-1] + [(i - 1) // 2 for i in range(1, num_nodes)], dtype=torch.long)


def _default_repeats(num_nodes: int) -> int:
    return 11 if num_nodes <= 8 else 5 if num_nodes <= 16 else 3


def available_kernels(target: PreTrainedModel) -> tuple[str, ...]:
    """The linear kernels worth measuring for ``target`` where it is: all of ``cpu_linear.LINEAR_KERNELS``
    on a CPU (``"packed"`` only where :meth:`Verifier.packed_available`), ``("linear",)`` elsewhere."""
    if _device_of(target).type != "cpu":
        return ("linear",)
    return ("linear", "weight_first") + (("packed",) if Verifier(target).packed_available() else ())


@torch.inference_mode()
def measure_cost_profile(
    target: PreTrainedModel,
    node_counts: Sequence[int] = DEFAULT_NODE_COUNTS,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    repeats: int | None = None,
    kernels: Sequence[str] | None = None,
    progress: bool = False,
    rule: TimingRule | None = None,
) -> CostProfile:
    """Measure the verification cost curve of ``target`` where it is (device, dtype, threads).

    For each size N: the median wall ms of :meth:`Verifier.forward_tree` over a tree of N nodes (a chain of N for a
    target verified on chains only, :attr:`Verifier.chains_only`) plus
    :meth:`Verifier.lm_logits` over its N hidden states, on a ``DynamicCache`` prefilled with
    ``context_length`` random tokens (cropped back after every call); one untimed call per size first,
    sizes interleaved (CUDA synchronised around each call), in rounds until every median is steady
    (:func:`measure_timings` under ``rule``; the profile records each kept median's spread, the rounds and the
    seconds, and says ``disturbed`` when the rounds ran out). Each size is measured with every linear kernel in
    ``kernels`` (``"weight_first"`` only at 2..32 nodes), interleaved, and the fastest is kept per size; the kept
    medians' monotone fit (:func:`monotone_fit`) is the profile's ``verify_ms``. About 40 s a round for
    SmolLM2-135M on a 2-core CPU with the defaults. The measurement uses a verifier of its own: its packed weights
    are freed afterwards, and the target is not modified.

    Args:
        target: the frozen ``transformers`` causal LM.
        node_counts: tree sizes N (root included), e.g. ``(1, 2, 4, 8)``; sorted and deduplicated here.
        context_length: cached prefix length (tokens).
        repeats: timed calls per size and kernel; None = 11 up to 8 nodes, 5 up to 16, 3 beyond.
        kernels: the kernels to measure; None = :func:`available_kernels`. ``"linear"`` is always measured.
        progress: announce the measurement (a log line with its rough duration and memory) and show a
            progress bar.
        rule: when the medians are steady (:class:`~selfspec.decode.tuning.timing.TimingRule`); None =
            :data:`~selfspec.decode.tuning.timing.DEFAULT_TIMING_RULE`.

    Returns:
        :class:`CostProfile`.

    Raises:
        ValueError: empty or non-positive ``node_counts``, ``context_length < 1``, an unknown kernel.
        RuntimeError: ``"packed"`` asked for where it is not available.
    """
    sizes = sorted({int(n) for n in node_counts})
    if not sizes or sizes[0] < 1 or context_length < 1:
        raise ValueError("need node counts >= 1 and context_length >= 1")
    kernels = tuple(dict.fromkeys(("linear", *(available_kernels(target) if kernels is None else kernels))))
    if any(k not in cpu_linear.LINEAR_KERNELS for k in kernels):
        raise ValueError(f"unknown kernel in {list(kernels)}; choose from {', '.join(cpu_linear.LINEAR_KERNELS)}")
    device = _device_of(target)
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    verifier = Verifier(target)
    cache = verifier.new_cache()
    t0 = time.perf_counter()
    verifier.prefill(torch.randint(0, vocab, (context_length,), generator=gen).to(device), cache)
    prefill_s = time.perf_counter() - t0

    def verify(tokens: torch.Tensor, parents: torch.Tensor, kernel: str) -> Callable[[], None]:
        plan = {tokens.numel(): kernel}

        def step() -> None:
            verifier.set_plan(plan, keep_packed=True)  # packed once, kept between calls
            h = verifier.forward_tree(tokens, parents, cache, context_length)
            verifier.lm_logits(h)
            kv.crop_cache(cache, context_length)

        return step

    fns, reps = {}, {}
    for n in sizes:
        tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)
        parents = _profile_parents(n, chain=verifier.chains_only).to(device)
        for kernel in kernels:
            if cpu_linear.kernel_applies(kernel, n):
                fns[n, kernel] = verify(tokens, parents, kernel)
                reps[n, kernel] = repeats or _default_repeats(n)
    if progress:
        # A forward of a few nodes costs about what the prefill of 128 tokens costs per 16 tokens (CPU).
        calls = sum(r + 1 for r in reps.values())
        rough_s = calls * max(prefill_s * 16 / context_length, 1e-3)
        extra = verifier.linear_weight_bytes() if "packed" in kernels else 0
        logger.warning(
            "measuring this target's verification cost once (tree sizes %s, kernels %s; about %.0f s a round, "
            "up to %d rounds until the timings are steady; cached afterwards; pass tune='off' to skip)%s",
            ", ".join(map(str, sizes)),
            ", ".join(kernels),
            rough_s,
            (timing.DEFAULT_TIMING_RULE if rule is None else rule).max_rounds,
            f"; the packed kernel holds a second copy of the linear weights, {extra / 2**20:.0f} MiB" if extra else "",
        )
    try:
        timed = measure_timings(fns, reps, device, rule, desc="verification cost" if progress else None)
    finally:
        verifier.set_plan({})  # frees the packed copies
    medians = timed.medians
    kept = [min((k for k in kernels if (n, k) in medians), key=lambda k: medians[n, k]) for n in sizes]
    curves = {k: tuple(round(medians[n, k], 4) if (n, k) in medians else None for n in sizes) for k in kernels}
    measured = [round(medians[n, k], 4) for n, k in zip(sizes, kept, strict=True)]
    spread = [timed.spreads[n, k] for n, k in zip(sizes, kept, strict=True)]
    return CostProfile(
        **cost_key(target),
        context_length=context_length,
        node_counts=tuple(sizes),
        verify_ms=tuple(round(v, 4) for v in monotone_fit(measured)),
        kernels=tuple(kept),
        kernel_ms=curves,
        measured_ms=tuple(measured),
        spread=tuple(round(x, 4) if math.isfinite(x) else None for x in spread),
        rounds=timed.rounds,
        measure_s=round(timed.seconds, 3),
        disturbed=timed.disturbed,
        created_utc=now_utc(),
    )


def tuned_verifier(target: PreTrainedModel, cost: CostProfile) -> Verifier:
    """A :class:`Verifier` of ``target`` with ``cost``'s kernel plan (:meth:`CostProfile.kernel_plan`), so
    that verification runs the way its cost was measured. Packs weights when the plan has ``"packed"``.

    Raises:
        RuntimeError: the profile keeps ``"packed"`` but this torch cannot pack (a profile copied from
            another installation with the same torch version; measure again with ``refresh=True``).
    """
    return Verifier(target, cost.kernel_plan())


# Profiles measured on a busy machine (disturbed), by cache path: used by this process, never written.
_PROCESS_ONLY: dict[Path, CostProfile] = {}


def cost_profile_path(target: PreTrainedModel) -> Path:
    """Cache file of ``target``'s cost profile on its device / dtype / threads."""
    return profiles_dir() / f"verify-{profile_stem(cost_key(target), _device_of(target))}.json"


def get_cost_profile(
    target: PreTrainedModel,
    refresh: bool = False,
    node_counts: Sequence[int] = DEFAULT_NODE_COUNTS,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
) -> CostProfile:
    """The cached cost profile of ``target`` on this machine, measured (announced, and cached) when there
    is none.

    A cached file is used only if its identity (:func:`cost_key`: fingerprint, device, dtype, threads,
    torch version), ``node_counts`` and ``context_length`` all match; a corrupt or mismatched file, or one of
    another format version, is measured again with a warning and overwritten. A measurement that did not settle
    (``disturbed``: a busy machine) is not written: it serves this process (kept in memory, so it is not repeated
    by every caller) and the next process measures again. Never raises for a bad cache file.

    Args:
        target: the frozen target, on the device and in the dtype it will decode with; set the torch
            threads first.
        refresh: measure even if a matching profile is cached.
        node_counts, context_length: see :func:`measure_cost_profile`.

    Returns:
        :class:`CostProfile`.
    """
    path = cost_profile_path(target)
    wanted = tuple(sorted({int(n) for n in node_counts}))
    cached = None if refresh else read_cached(path, CostProfile.from_dict, "cost profile")
    if cached is not None:
        if cached.key != cost_key(target):
            logger.warning(
                "cost profile %s was measured for %s, not %s: measuring it again", path, cached.key, cost_key(target)
            )
        elif (cached.node_counts, cached.context_length) != (wanted, context_length):
            logger.info("cost profile %s covers other tree sizes: measuring it again", path)
        else:
            return cached
    held = None if refresh else _PROCESS_ONLY.get(path)
    if (
        held is not None
        and held.key == cost_key(target)
        and (held.node_counts, held.context_length)
        == (
            wanted,
            context_length,
        )
    ):
        return held
    profile = measure_cost_profile(target, wanted, context_length, progress=True)
    if profile.disturbed:
        _PROCESS_ONLY[path] = profile
        worst = max((x for x in profile.spread if x is not None), default=math.inf)
        logger.warning(
            "the verification cost did not settle in %d rounds (a median still varies by %s; the machine is busy): "
            "using it for this process only, not caching it; it is measured again on the next load",
            profile.rounds,
            f"{100 * worst:.1f} %" if math.isfinite(worst) else "an unknown amount",
        )
        return profile
    write_cached(path, profile.to_dict(), "cost profile")
    return profile
