"""Tree budget sized to the machine: choose EAGLE-2's ``depth`` and ``total_tokens`` for the fastest decoding.

A bigger draft tree accepts more tokens per step but costs more to verify, and how much more depends on
the device: on a 2-core CPU a 16-node verification costs ~1.7 single-token passes, on an H200 128 nodes
cost ~1.2 (DESIGN.md section 6). Like Sequoia (Chen et al. 2024, "Sequoia: Scalable, Robust, and
Hardware-aware Speculative Decoding", arXiv:2402.12374), the budget is picked by maximising

    expected tokens per second = tau(d, N) / (draft_ms(d) + verify_ms(N + 1) + overhead_ms)

over EAGLE-2's two knobs (Li et al. 2024, arXiv:2406.16858): the draft depth d and the number N of
draft tokens kept after reranking (the verified tree has N + 1 nodes with the root). Three measurements:

* :class:`CostProfile`: median wall ms of one verification (``kv.forward_tree`` + ``kv.lm_logits``) by
  tree size, for this target on this device, dtype and thread count; cached as JSON under
  ``$SELFSPEC_CACHE/profiles`` (see :func:`profiles_dir`). On a CPU each size is measured with every
  linear kernel of :data:`~selfspec.decode.kv.LINEAR_KERNELS` (plain ``linear``, ``W @ x^T``, oneDNN on
  weights packed once); the fastest is kept per size and installed on the target
  (:func:`~selfspec.decode.kv.set_linear_kernels`), so decoding runs the way the cost was measured.
* the drafting cost by depth (:func:`measure_draft_cost`): ``EagleDrafter.propose`` at each depth.
* :class:`AcceptanceProfile`: ``tau[d][N]``, the mean tokens per step (accepted drafts + the bonus
  token) under greedy verification, for every d <= ``depth_max`` and N <= ``total_tokens_max``, from ONE
  greedy run with the largest budget (:func:`calibrate_acceptance`); stored next to the head as
  ``acceptance_profile.json``.

Why one big run tells what every smaller budget would have accepted: EAGLE-2 candidates at depth <= d do
not depend on ``total_tokens`` nor on deeper levels, and :func:`~selfspec.decode.eagle.select_nodes`
keeps the N best of them by cumulative draft log-probability with a stable sort, in which a parent
always ranks before its children. Greedy verification accepts the unique path that follows the target's
argmax. So a budget (d, N) keeps exactly the candidates of depth <= d whose rank among them is < N, and
accepts the big run's accepted path up to its first node outside that set (see :func:`step_acceptance`).

This module measures a model (like ``kv.py`` and ``generate.py``); the choice itself
(:func:`choose_tree_budget`) is a pure function of the profiles.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.decode import kv
from selfspec.decode.sampling import SamplingConfig

if TYPE_CHECKING:
    from selfspec.decode.eagle import EagleDrafter

logger = logging.getLogger(__name__)

DEFAULT_NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
DEFAULT_CONTEXT_LENGTH = 128
ACCEPTANCE_PROFILE_NAME = "acceptance_profile.json"
PROFILE_VERSION = 1
COST_PROFILE_VERSION = 3  # 3: verify_ms is the fastest of the linear kernels measured (kv.set_linear_kernels)
_COST_FORMAT = "selfspec-verify-cost"
_DRAFT_FORMAT = "selfspec-draft-cost"
_ACCEPTANCE_FORMAT = "selfspec-acceptance-profile"
_HEAD_FILES = ("model.safetensors", "draft_vocab.safetensors")


# --------------------------------------------------------------------------------------------------
# Where profiles live, and what makes two measurements comparable


def profiles_dir() -> Path:
    """Cache directory of cost profiles: ``$SELFSPEC_CACHE/profiles`` (default ``~/.cache/selfspec/profiles``)."""
    from selfspec.target import cache_dir

    return cache_dir() / "profiles"


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def device_description(device: torch.device) -> str:
    """What a cost measurement ran on: ``"cuda:0 NVIDIA H200"`` or ``"cpu x86_64 (2 cpus)"``."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"{device.type} {platform.machine()} ({os.cpu_count() or 0} cpus)"


def cost_key(target) -> dict[str, Any]:
    """The identity of a cost measurement: target fingerprint, device, dtype, torch threads, torch version.

    A cached profile is reused only when every field is equal.
    """
    from selfspec.heads.fingerprint import target_fingerprint

    device = _device_of(target)
    return {
        "target_fingerprint": target_fingerprint(target),
        "device": device_description(device),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _file_stem(key: Mapping[str, Any], device: torch.device) -> str:
    slug = device.type + ("" if device.index is None else str(device.index))
    return f"{key['target_fingerprint']}-{slug}-{key['dtype']}-t{key['threads']}"


def _now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict) -> Path:
    """Write atomically (temporary file + rename), so a killed process never leaves half a profile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved_medians(fns: Mapping[Any, Callable[[], None]], repeats: Mapping[Any, int], device) -> dict[Any, float]:
    """Median wall ms of each ``fns[k]()`` over ``repeats[k]`` calls, after one untimed call each.

    Calls are interleaved round by round (k1, k2, ..., k1, k2, ...) so that a load change on a busy
    machine shifts every size alike instead of biasing the sizes measured during it.
    """
    for fn in fns.values():
        fn()
    times: dict[Any, list[float]] = {k: [] for k in fns}
    for r in range(max(repeats.values())):
        for k, fn in fns.items():
            if r >= repeats[k]:
                continue
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


# --------------------------------------------------------------------------------------------------
# Verification cost


@dataclass(frozen=True)
class CostProfile:
    """Verification cost of one target on one machine, by tree size.

    Attributes:
        target_fingerprint, device, dtype, threads, torch: the measurement's identity (:func:`cost_key`).
        context_length: tokens in the KV cache before the tree.
        node_counts: tree sizes N measured (root included), strictly increasing, >= 1.
        verify_ms: median wall milliseconds of ``kv.forward_tree`` + ``kv.lm_logits`` at each size with the
            fastest linear kernel measured there (see ``kernels``).
        kernels: the kernel kept at each size, one of ``kv.LINEAR_KERNELS`` (all ``"linear"`` by default).
        kernel_ms: every measured curve, ``{kernel: [ms or None per node count]}``; ``"linear"`` is always
            there and complete (None where a kernel was not measured at that size).
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
    created_utc: str = ""

    def __post_init__(self) -> None:
        n = self.node_counts
        if not n or len(n) != len(self.verify_ms):
            raise ValueError("node_counts and verify_ms must be non-empty and of equal length")
        if any(not isinstance(x, int) or x < 1 for x in n) or any(a >= b for a, b in zip(n, n[1:])):
            raise ValueError(f"node_counts must be strictly increasing integers >= 1, got {list(n)}")
        if not self.kernels:
            object.__setattr__(self, "kernels", ("linear",) * len(n))
        curves = {k: tuple(v) for k, v in dict(self.kernel_ms).items()}
        curves.setdefault("linear", tuple(self.verify_ms))
        object.__setattr__(self, "kernel_ms", curves)
        if len(self.kernels) != len(n) or any(k not in kv.LINEAR_KERNELS for k in self.kernels):
            raise ValueError(f"kernels must name one of {kv.LINEAR_KERNELS} per node count, got {list(self.kernels)}")

        def ok(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        if not all(ok(v) for v in self.verify_ms):
            raise ValueError("verify_ms must be finite positive numbers, one per node count")
        for name, values in curves.items():
            if name not in kv.LINEAR_KERNELS or len(values) != len(n) or not all(v is None or ok(v) for v in values):
                raise ValueError(f"kernel_ms[{name!r}] must be a known kernel with a finite positive ms or None "
                                 "per node count")
        if any(v is None for v in curves["linear"]):
            raise ValueError("kernel_ms['linear'] must be measured at every node count")
        for i, kernel in enumerate(self.kernels):
            if kernel not in curves or curves[kernel][i] is None:
                raise ValueError(f"kernel {kernel!r} kept at {n[i]} nodes was not measured there")

    @property
    def verify_ms_linear(self) -> tuple[float, ...]:
        """The cost curve with plain ``linear`` everywhere."""
        return tuple(self.kernel_ms["linear"])

    def kernel_plan(self, max_nodes: int = 64) -> dict[int, str]:
        """The kernel of every tree size 1..``max_nodes`` for :func:`~selfspec.decode.kv.set_linear_kernels`:
        a size takes the kernel measured at the largest measured size not above it (``"linear"`` below the
        smallest); ``"weight_first"`` stops at ``kv.WEIGHT_FIRST_MAX_ROWS``."""
        plan: dict[int, str] = {}
        for size in range(1, max_nodes + 1):
            below = [i for i, m in enumerate(self.node_counts) if m <= size]
            kernel = self.kernels[below[-1]] if below else "linear"
            if kernel != "linear" and kv.kernel_applies(kernel, size):
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

        Piecewise-linear interpolation between the measured medians, exact at measured sizes. Below the
        smallest size: that size's cost; above the largest: the last segment's slope. The medians are not
        forced to grow with the size: on CPUs they do not (BLAS picks kernels by shape; on the 2-core
        development machine 3-node trees measured slower than 4-node ones in every profile), and a
        monotone fit then makes the cheaper size look dearer than it is.
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
            "format": _COST_FORMAT, "version": COST_PROFILE_VERSION, **self.key, "context_length": self.context_length,
            "node_counts": list(self.node_counts), "verify_ms": list(self.verify_ms), "kernels": list(self.kernels),
            "kernel_ms": {k: list(v) for k, v in self.kernel_ms.items()}, "created_utc": self.created_utc,
        }

    @classmethod
    def from_dict(cls, data: Any) -> CostProfile:
        """Parse :meth:`to_dict`'s layout. Raises ValueError on anything else."""
        if not isinstance(data, dict):
            raise ValueError("a cost profile is a JSON object")
        if data.get("format") != _COST_FORMAT or data.get("version") != COST_PROFILE_VERSION:
            raise ValueError(f"not a version-{COST_PROFILE_VERSION} {_COST_FORMAT} file")
        fields = dict(data)
        fields.pop("format")
        fields.pop("version")
        expected = set(cls.__dataclass_fields__)
        if set(fields) != expected:
            raise ValueError(f"keys {sorted(fields)} differ from {sorted(expected)}")
        for name in ("target_fingerprint", "device", "dtype", "torch", "created_utc"):
            if not isinstance(fields[name], str):
                raise ValueError(f"{name} must be a string")
        for name in ("threads", "context_length"):
            if not isinstance(fields[name], int) or isinstance(fields[name], bool) or fields[name] < 1:
                raise ValueError(f"{name} must be a positive integer")
        for name in ("node_counts", "verify_ms", "kernels"):
            if not isinstance(fields[name], list):
                raise ValueError(f"{name} must be a list")
            fields[name] = tuple(fields[name])
        curves = fields["kernel_ms"]
        if not isinstance(curves, dict) or not all(isinstance(v, list) for v in curves.values()):
            raise ValueError("kernel_ms must map kernel names to lists")
        fields["kernel_ms"] = {k: tuple(v) for k, v in curves.items()}
        return cls(**fields)


def _profile_parents(num_nodes: int) -> torch.Tensor:
    """A bushy tree of ``num_nodes`` nodes (node i's parent is ``(i - 1) // 2``): from 3 nodes on it takes
    the tree-mask path of :func:`~selfspec.decode.kv.forward_tree`, as EAGLE-2 trees do."""
    return torch.tensor([-1] + [(i - 1) // 2 for i in range(1, num_nodes)], dtype=torch.long)


def _default_repeats(num_nodes: int) -> int:
    return 11 if num_nodes <= 8 else 5 if num_nodes <= 16 else 3


def available_kernels(target) -> tuple[str, ...]:
    """The linear kernels worth measuring for ``target`` where it is: all of ``kv.LINEAR_KERNELS`` on a
    CPU (``"packed"`` only where :func:`~selfspec.decode.kv.packed_linears_available`), ``("linear",)``
    elsewhere."""
    if _device_of(target).type != "cpu":
        return ("linear",)
    return ("linear", "weight_first") + (("packed",) if kv.packed_linears_available(target) else ())


@torch.inference_mode()
def measure_cost_profile(
    target,
    node_counts: Sequence[int] = DEFAULT_NODE_COUNTS,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    repeats: int | None = None,
    kernels: Sequence[str] | None = None,
) -> CostProfile:
    """Measure the verification cost curve of ``target`` where it is (device, dtype, threads).

    For each size N: the median wall ms of ``kv.forward_tree`` over a tree of N nodes plus ``kv.lm_logits``
    over its N hidden states, on a ``DynamicCache`` prefilled with ``context_length`` random tokens (cropped
    back after every call); one untimed call per size first, sizes interleaved (CUDA synchronised around
    each call). Each size is measured with every linear kernel in ``kernels``
    (:func:`~selfspec.decode.kv.set_linear_kernels`; ``"weight_first"`` only at 2..32 nodes), interleaved,
    and the fastest is kept per size. About 40 s for SmolLM2-135M on a 2-core CPU with the defaults.
    The target's installed kernels are restored afterwards.

    Args:
        target: the frozen ``transformers`` causal LM.
        node_counts: tree sizes N (root included), e.g. ``(1, 2, 4, 8)``; sorted and deduplicated here.
        context_length: cached prefix length (tokens).
        repeats: timed calls per size and kernel; None = 11 up to 8 nodes, 5 up to 16, 3 beyond.
        kernels: the kernels to measure; None = :func:`available_kernels`. ``"linear"`` is always measured.

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
    if any(k not in kv.LINEAR_KERNELS for k in kernels):
        raise ValueError(f"unknown kernel in {list(kernels)}; choose from {', '.join(kv.LINEAR_KERNELS)}")
    device = _device_of(target)
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    cache = kv.new_cache(target)
    kv.prefill(target, torch.randint(0, vocab, (context_length,), generator=gen).to(device), cache)

    installed = kv.linear_kernels(target)

    def verify(tokens: torch.Tensor, parents: torch.Tensor, kernel: str) -> Callable[[], None]:
        plan = {tokens.numel(): kernel}

        def step() -> None:
            kv.set_linear_kernels(target, plan, keep_packed=True)  # packed once, kept between calls
            h = kv.forward_tree(target, tokens, parents, cache, context_length)
            kv.lm_logits(target, h)
            kv.crop_cache(cache, context_length)

        return step

    fns, reps = {}, {}
    for n in sizes:
        tokens, parents = torch.randint(0, vocab, (n,), generator=gen).to(device), _profile_parents(n).to(device)
        for kernel in kernels:
            if kv.kernel_applies(kernel, n):
                fns[n, kernel] = verify(tokens, parents, kernel)
                reps[n, kernel] = repeats or _default_repeats(n)
    try:
        medians = _interleaved_medians(fns, reps, device)
    finally:
        kv.set_linear_kernels(target, installed)
    kept = [min((k for k in kernels if (n, k) in medians), key=lambda k: medians[n, k]) for n in sizes]
    curves = {k: tuple(round(medians[n, k], 4) if (n, k) in medians else None for n in sizes) for k in kernels}
    return CostProfile(**cost_key(target), context_length=context_length, node_counts=tuple(sizes),
                       verify_ms=tuple(round(medians[n, k], 4) for n, k in zip(sizes, kept)), kernels=tuple(kept),
                       kernel_ms=curves, created_utc=_now_utc())


def use_cost_profile(target, refresh: bool = False) -> CostProfile:
    """:func:`get_cost_profile`, then install its linear kernels on the target
    (:func:`~selfspec.decode.kv.set_linear_kernels`), so that verification runs the way its cost was
    measured. Every drafter sized from the profile goes through here.

    Raises:
        RuntimeError: the profile keeps ``"packed"`` but this torch cannot pack (a profile copied from
            another installation with the same torch version; measure again with ``refresh=True``).
    """
    cost = get_cost_profile(target, refresh=refresh)
    kv.set_linear_kernels(target, cost.kernel_plan())
    return cost


def cost_profile_path(target) -> Path:
    """Cache file of ``target``'s cost profile on its device / dtype / threads."""
    return profiles_dir() / f"verify-{_file_stem(cost_key(target), _device_of(target))}.json"


def save_cost_profile(profile: CostProfile, path: str | Path) -> Path:
    """Write ``profile`` as JSON (atomically). Returns the path."""
    return _write_json(Path(path), profile.to_dict())


def load_cost_profile(path: str | Path) -> CostProfile:
    """Read a cost profile written by :func:`save_cost_profile`.

    Raises:
        ValueError: unreadable, not JSON, or not a valid profile (the message says which).
        OSError: the file does not exist or cannot be read.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON: {err}") from err
    return CostProfile.from_dict(data)


def get_cost_profile(
    target,
    refresh: bool = False,
    node_counts: Sequence[int] = DEFAULT_NODE_COUNTS,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
) -> CostProfile:
    """The cached cost profile of ``target`` on this machine, measured (and cached) when there is none.

    A cached file is used only if its identity (:func:`cost_key`: fingerprint, device, dtype, threads,
    torch version), ``node_counts`` and ``context_length`` all match; a corrupt or mismatched file is
    measured again with a warning and overwritten. Never raises for a bad cache file.

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
    if not refresh and path.exists():
        try:
            cached = load_cost_profile(path)
        except (OSError, ValueError, TypeError) as err:
            logger.warning("cost profile %s is unreadable (%s): measuring it again", path, err)
        else:
            if cached.key != cost_key(target):
                logger.warning("cost profile %s was measured for %s, not %s: measuring it again",
                               path, cached.key, cost_key(target))
            elif (cached.node_counts, cached.context_length) != (wanted, context_length):
                logger.info("cost profile %s covers other tree sizes: measuring it again", path)
            else:
                return cached
    logger.info("measuring verification cost by tree size (%s nodes) ...", ", ".join(map(str, wanted)))
    profile = measure_cost_profile(target, wanted, context_length)
    try:
        save_cost_profile(profile, path)
        logger.info("cost profile cached in %s", path)
    except OSError as err:
        logger.warning("cannot cache the cost profile in %s (%s); using it uncached", path, err)
    return profile


# --------------------------------------------------------------------------------------------------
# Drafting cost


@torch.inference_mode()
def measure_draft_cost(
    drafter: EagleDrafter,
    target,
    depths: Sequence[int],
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    repeats: int = 5,
) -> dict[int, float]:
    """Median wall ms of one :meth:`~selfspec.decode.eagle.EagleDrafter.propose` at each draft depth.

    The drafter is begun on ``context_length`` random tokens with the target's real features (one
    untimed propose feeds them); each timed call then feeds one accepted pair, as a decoding step with
    nothing accepted does, and grows the tree to the depth. ``drafter.depth`` is restored afterwards;
    the drafter's state is not (every generation calls ``begin`` first).

    Args:
        drafter: an :class:`~selfspec.decode.eagle.EagleDrafter` attached to ``target``.
        target: the frozen target.
        depths: draft depths d >= 1.
        context_length: prompt tokens before the draft.
        repeats: timed calls per depth.

    Returns:
        ``{depth: ms}``.

    Raises:
        ValueError: an empty ``depths`` or a depth < 1.
    """
    depths = sorted({int(d) for d in depths})
    if not depths or depths[0] < 1:
        raise ValueError("need draft depths >= 1")
    device = _device_of(target)
    gen = torch.Generator().manual_seed(1)
    context = torch.randint(0, target.config.vocab_size, (context_length + 1,), generator=gen).to(device)
    hidden = kv.prefill(target, context[:-1], kv.new_cache(target))  # the root, context[-1], is not cached
    greedy = SamplingConfig()
    saved = drafter.depth
    try:
        drafter.begin(context[:-1], hidden)
        drafter.depth = 1
        drafter.propose(context, greedy, None)  # feeds the prompt's pairs: the cache now holds a real context

        def at(depth: int) -> Callable[[], None]:
            def step() -> None:
                drafter.depth = depth
                drafter.accept(context[-1:], hidden[-1:])
                drafter.propose(context, greedy, None)

            return step

        medians = _interleaved_medians({d: at(d) for d in depths}, {d: repeats for d in depths}, device)
        return {d: round(ms, 4) for d, ms in medians.items()}
    finally:
        drafter.depth = saved


def draft_cost_path(drafter: EagleDrafter, target) -> Path:
    """Cache file of an EAGLE drafter's cost by depth (it depends on the head's shapes and ``top_k``, not on
    its weights)."""
    cfg = drafter.head.config
    stem = _file_stem(cost_key(target), _device_of(target))
    return profiles_dir() / f"draft-eagle-{stem}-k{drafter.top_k}-v{cfg.n_draft}-b{int(cfg.fc_bias)}.json"


def get_draft_cost(drafter: EagleDrafter, target, depths: Sequence[int], refresh: bool = False) -> dict[int, float]:
    """:func:`measure_draft_cost`, cached like :func:`get_cost_profile` (same identity plus the head's
    draft vocabulary size, ``fc`` bias and ``top_k``). A bad cache file is re-measured with a warning.

    Returns:
        ``{depth: ms}`` for every requested depth.
    """
    path = draft_cost_path(drafter, target)
    wanted = sorted({int(d) for d in depths})
    key = cost_key(target)
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("format") != _DRAFT_FORMAT or data.get("version") != PROFILE_VERSION:
                raise ValueError(f"not a version-{PROFILE_VERSION} {_DRAFT_FORMAT} file")
            ms = {int(d): float(v) for d, v in data["draft_ms"].items()}
            if any(not math.isfinite(v) or v <= 0 for v in ms.values()):
                raise ValueError("draft_ms must be positive numbers")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            logger.warning("draft cost profile %s is unreadable (%s): measuring it again", path, err)
        else:
            if data.get("key") != key:
                logger.warning("draft cost profile %s was measured for %s: measuring it again", path, data.get("key"))
            elif all(d in ms for d in wanted):
                return {d: ms[d] for d in wanted}
    logger.info("measuring EAGLE drafting cost at depths %s ...", wanted)
    ms = measure_draft_cost(drafter, target, wanted)
    try:
        _write_json(path, {"format": _DRAFT_FORMAT, "version": PROFILE_VERSION, "key": key, "top_k": drafter.top_k,
                           "draft_ms": {str(d): v for d, v in ms.items()}, "created_utc": _now_utc()})
    except OSError as err:
        logger.warning("cannot cache the draft cost in %s (%s)", path, err)
    return ms


# --------------------------------------------------------------------------------------------------
# Acceptance, measured


def num_candidates(top_k: int, depth: int) -> int:
    """Candidates an EAGLE-2 drafter creates: ``top_k`` at depth 1, ``top_k ** 2`` at each further depth."""
    return top_k + (depth - 1) * top_k * top_k


def candidate_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth (>= 1) of each candidate. ``parents``: LongTensor ``[M]`` (-1 = child of the root, else an
    earlier index) -> LongTensor ``[M]``."""
    p = parents.tolist()
    depth = [0] * len(p)
    for i, parent in enumerate(p):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    return torch.tensor(depth, dtype=torch.long)


def step_acceptance(
    candidates: Mapping[str, torch.Tensor],
    accepted_nodes: torch.Tensor,
    next_token: int,
    depth_max: int,
    total_tokens_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens that each smaller budget would have accepted in one greedy step of a big-budget drafter.

    Let ``p_1 .. p_a`` be the accepted path (as candidates) and ``rank_d(c)`` the position of candidate c
    in the stable descending sort of the scores of the candidates of depth <= d (what
    :func:`~selfspec.decode.eagle.select_nodes` does). Budget (d, N) keeps ``{c : depth(c) <= d,
    rank_d(c) < N}`` and, since ancestors rank first, accepts ``#{i <= min(a, d) : rank_d(p_i) < N}``
    drafts. One more when it keeps ``c*``, the candidate child of ``p_a`` whose token is the big step's
    bonus token (the target's argmax at ``p_a``): the big tree dropped it, a smaller one may not. Beyond
    ``c*`` the target's argmax is unknown, so when the budget also keeps a child of ``c*`` the count is a
    lower bound, flagged in ``inexact``. This happens only when the budget keeps a candidate the big tree
    dropped, i.e. never for ``d = depth_max``.

    Args:
        candidates: ``EagleDrafter.last_candidates`` of the step: ``tokens`` (target ids), ``parents``,
            ``scores`` (cumulative draft log-probabilities), ``kept`` (candidate index of tree node i + 1),
            each ``[M]``.
        accepted_nodes: LongTensor ``[A]`` of accepted tree nodes, root first (``VerifyResult``).
        next_token: the bonus token of the step (argmax of the target at the last accepted node).
        depth_max, total_tokens_max: the table's extent (the big budget the step was drafted with).

    Returns:
        ``(accepted, inexact)``: LongTensor ``[depth_max, total_tokens_max]`` of accepted drafts (bonus token
        not counted), ``accepted[d - 1, N - 1]`` for budget (d, N); BoolTensor of the same shape.
    """
    scores = candidates["scores"].detach().float().cpu()
    parents = candidates["parents"].cpu()
    tokens = candidates["tokens"].cpu()
    kept = candidates["kept"].cpu()
    depth = candidate_depths(parents)
    path = kept[accepted_nodes.cpu()[1:] - 1]  # candidate index of each accepted draft, depth 1, 2, ...
    last = int(path[-1]) if path.numel() else -1
    match = ((parents == last) & (tokens == int(next_token))).nonzero().flatten()
    c_star = int(match[0]) if match.numel() else None
    m = scores.numel()
    budgets = torch.arange(1, total_tokens_max + 1)
    accepted = torch.zeros(depth_max, total_tokens_max, dtype=torch.long)
    inexact = torch.zeros(depth_max, total_tokens_max, dtype=torch.bool)
    for d in range(1, depth_max + 1):
        in_d = depth <= d
        idx = in_d.nonzero().flatten()
        order = torch.sort(-scores[idx], stable=True).indices
        rank = torch.full((m,), m, dtype=torch.long)
        rank[idx[order]] = torch.arange(idx.numel())
        path_ranks = rank[path[:d]]
        accepted[d - 1] = (path_ranks.unsqueeze(0) < budgets.unsqueeze(1)).sum(1)
        if c_star is not None and int(depth[c_star]) <= d:
            hit = int(rank[c_star]) < budgets
            accepted[d - 1] += hit.long()
            kids = (parents == c_star) & in_d
            if bool(kids.any()):
                inexact[d - 1] = hit & (int(rank[kids].min()) < budgets)
    return accepted, inexact


@dataclass(frozen=True)
class AcceptanceProfile:
    """Measured greedy acceptance of one EAGLE head for every smaller tree budget.

    Attributes:
        top_k: the drafter's ``top_k`` (candidates depend on it: the table holds for this value only).
        tau: ``tau[d - 1][N - 1]``, mean tokens per verification step (accepted drafts + the bonus
            token) with depth d and ``total_tokens`` N, ``[depth_max][total_tokens_max]``, each in ``[1, d + 1]``.
        inexact_steps: ``[depth_max][total_tokens_max]`` steps whose count is a lower bound (see
            :func:`step_acceptance`); 0 = exact for the steps of the calibration run.
        steps: verification steps measured.
        prompts: prompts decoded.
        max_new_tokens: cap per prompt during calibration.
        target_fingerprint: the target's :func:`~selfspec.heads.fingerprint.target_fingerprint`.
        head_digest: :func:`head_files_digest` of the head directory when saved there ("" = unknown).
        created_utc: ISO 8601 time.

    Approximation: a smaller budget accepts differently, so its later steps start from other contexts;
    the table is the per-step mean over the big run's contexts (exact step by step, not run by run).
    """

    top_k: int
    tau: tuple[tuple[float, ...], ...]
    inexact_steps: tuple[tuple[int, ...], ...]
    steps: int
    prompts: int
    max_new_tokens: int
    target_fingerprint: str = ""
    head_digest: str = ""
    created_utc: str = ""

    @property
    def depth_max(self) -> int:
        return len(self.tau)

    @property
    def total_tokens_max(self) -> int:
        return len(self.tau[0])

    def tau_at(self, depth: int, total_tokens: int) -> float:
        """tau of budget (depth, total_tokens); ``total_tokens`` beyond the candidates a depth creates is
        the same tree as all of them. Raises ValueError outside the table."""
        n = min(total_tokens, num_candidates(self.top_k, depth))
        if not (1 <= depth <= self.depth_max and 1 <= n <= self.total_tokens_max):
            raise ValueError(f"budget (depth {depth}, total_tokens {total_tokens}) is outside the measured "
                             f"table (depth <= {self.depth_max}, total_tokens <= {self.total_tokens_max})")
        return self.tau[depth - 1][n - 1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _ACCEPTANCE_FORMAT, "version": PROFILE_VERSION, "head_type": "eagle", "verification": "greedy",
            "top_k": self.top_k, "depth_max": self.depth_max, "total_tokens_max": self.total_tokens_max,
            "steps": self.steps, "prompts": self.prompts, "max_new_tokens": self.max_new_tokens,
            "target_fingerprint": self.target_fingerprint, "head_digest": self.head_digest,
            "created_utc": self.created_utc,
            "tau": [list(row) for row in self.tau], "inexact_steps": [list(row) for row in self.inexact_steps],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "acceptance profile") -> AcceptanceProfile:
        """Parse :meth:`to_dict`'s layout strictly.

        Raises:
            HeadFormatError: any missing, unknown, mistyped or inconsistent field; the message names it and
                says how to regenerate the file.
        """
        from selfspec.heads.config import HeadFormatError

        def bad(problem: str) -> HeadFormatError:
            return HeadFormatError(
                f"{where}: {problem}. Regenerate it with `selfspec tune-tree --target TARGET --heads HEAD_DIR` "
                f"(or delete it to decode with the default tree budget)."
            )

        if not isinstance(data, dict):
            raise bad("must hold a JSON object")
        expected = {"format", "version", "head_type", "verification", "top_k", "depth_max", "total_tokens_max",
                    "steps", "prompts", "max_new_tokens", "target_fingerprint", "head_digest", "created_utc", "tau",
                    "inexact_steps"}
        missing, unknown = sorted(expected - set(data)), sorted(set(data) - expected)
        if missing or unknown:
            raise bad(f"missing keys {missing}, unknown keys {unknown}")
        if data["format"] != _ACCEPTANCE_FORMAT or data["version"] != PROFILE_VERSION:
            raise bad(f"format/version must be {_ACCEPTANCE_FORMAT!r}/{PROFILE_VERSION}")
        if data["head_type"] != "eagle" or data["verification"] != "greedy":
            raise bad("head_type must be 'eagle' and verification 'greedy'")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for name in ("top_k", "depth_max", "total_tokens_max", "steps", "prompts", "max_new_tokens"):
            if not is_int(data[name]) or data[name] < 1:
                raise bad(f"{name} must be a positive integer")
        for name in ("target_fingerprint", "head_digest", "created_utc"):
            if not isinstance(data[name], str):
                raise bad(f"{name} must be a string")
        depth_max, n_max, steps = data["depth_max"], data["total_tokens_max"], data["steps"]
        for name in ("tau", "inexact_steps"):
            table = data[name]
            if not isinstance(table, list) or len(table) != depth_max or any(
                not isinstance(row, list) or len(row) != n_max for row in table
            ):
                raise bad(f"{name} must be a [depth_max={depth_max}][total_tokens_max={n_max}] list of lists")
        for d, row in enumerate(data["tau"], start=1):
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in row):
                raise bad(f"tau[{d - 1}] must hold finite numbers")
            if any(not 1.0 - 1e-9 <= x <= d + 1 + 1e-9 for x in row):
                raise bad(f"tau[{d - 1}] (depth {d}) must lie in [1, {d + 1}]")
            if any(b < a - 1e-9 for a, b in zip(row, row[1:])):
                raise bad(f"tau[{d - 1}] must not decrease with total_tokens")
        for d, row in enumerate(data["inexact_steps"]):
            if any(not is_int(x) or not 0 <= x <= steps for x in row):
                raise bad(f"inexact_steps[{d}] must hold integers in [0, steps={steps}]")
        return cls(
            top_k=data["top_k"],
            tau=tuple(tuple(float(x) for x in row) for row in data["tau"]),
            inexact_steps=tuple(tuple(row) for row in data["inexact_steps"]),
            steps=steps,
            prompts=data["prompts"],
            max_new_tokens=data["max_new_tokens"],
            target_fingerprint=data["target_fingerprint"],
            head_digest=data["head_digest"],
            created_utc=data["created_utc"],
        )


def head_files_digest(head_dir: str | Path) -> str:
    """sha256 (16 hex characters) of the tensors in a head directory's weight files (names, dtypes, shapes,
    bytes; not the files' bytes, whose safetensors header order varies between saves of the same weights),
    so that a profile does not outlive a retraining.

    Raises:
        HeadFormatError: a weight file exists but cannot be read.
    """
    from selfspec.heads.config import read_safetensors

    h = hashlib.sha256()
    for name in _HEAD_FILES:
        path = Path(head_dir) / name
        if not path.is_file():
            continue
        h.update(name.encode())
        tensors = read_safetensors(path)
        for key in sorted(tensors):
            t = tensors[key]
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def save_acceptance_profile(profile: AcceptanceProfile, head_dir: str | Path) -> Path:
    """Write ``<head_dir>/acceptance_profile.json`` (atomically), stamped with the head files' digest.

    The head loaders read only their own named files, so the extra file does not disturb them.

    Returns:
        The file's path.
    """
    from dataclasses import replace

    stamped = replace(profile, head_digest=head_files_digest(head_dir))
    return _write_json(Path(head_dir) / ACCEPTANCE_PROFILE_NAME, stamped.to_dict())


def load_acceptance_profile(head_dir: str | Path, target=None) -> AcceptanceProfile | None:
    """Read ``<head_dir>/acceptance_profile.json``.

    Args:
        head_dir: the head directory.
        target: when given, a profile measured on another target is ignored (with a warning).

    Returns:
        The profile; None when there is none, or (with a warning) when it was measured for other head
        weights than the directory now holds (the head was retrained) or for another target.

    Raises:
        HeadFormatError: the file exists but is not a valid profile (the message says how to regenerate it).
    """
    from selfspec.heads.config import HeadFormatError

    path = Path(head_dir) / ACCEPTANCE_PROFILE_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeadFormatError(
            f"cannot read {path} ({err}). Regenerate it with `selfspec tune-tree --target TARGET --heads {head_dir}` "
            "(or delete it to decode with the default tree budget)."
        ) from err
    profile = AcceptanceProfile.from_dict(data, where=str(path))
    if profile.head_digest and profile.head_digest != head_files_digest(head_dir):
        logger.warning("%s was measured for other head weights (retrained since?): ignoring it; "
                       "rerun `selfspec tune-tree --heads %s`", path, head_dir)
        return None
    if target is not None and profile.target_fingerprint:
        from selfspec.heads.fingerprint import target_fingerprint

        if profile.target_fingerprint != target_fingerprint(target):
            logger.warning("%s was measured on another target: ignoring it", path)
            return None
    return profile


def calibrate_acceptance(
    target,
    drafter: EagleDrafter,
    prompts_ids: Sequence[torch.Tensor],
    max_new_tokens: int = 64,
    total_tokens_max: int = 48,
    depth_max: int = 6,
    eos_token_id: int | Sequence[int] | None = None,
) -> AcceptanceProfile:
    """Measure ``tau[d][N]`` for every budget up to (``depth_max``, ``total_tokens_max``) in one greedy run.

    Decodes every prompt greedily with :func:`~selfspec.decode.generate.speculative_generate`, the drafter
    set to the big budget, and turns each step into the accepted count of every smaller budget with
    :func:`step_acceptance` (exact per step; see there for the lower-bound case). ``tau`` is the mean
    over all steps of all prompts of accepted drafts + 1. The drafter's ``depth`` and ``total_tokens`` are
    restored afterwards. Cost: one big-tree decode of ``max_new_tokens`` per prompt.

    Args:
        target: the frozen target.
        drafter: an :class:`~selfspec.decode.eagle.EagleDrafter` on ``target`` (its ``top_k`` is profiled).
        prompts_ids: LongTensors ``[T]``, one per prompt (e.g. chat-templated held-out prompts).
        max_new_tokens: new tokens per prompt.
        total_tokens_max: N_max, largest ``total_tokens`` in the table.
        depth_max: largest depth in the table.
        eos_token_id: stop ids (as in decoding), None = none.

    Returns:
        :class:`AcceptanceProfile` (``head_digest`` empty: :func:`save_acceptance_profile` stamps it).

    Raises:
        ValueError: no prompts, non-positive sizes, or no verification step ran (every prompt stopped at
            its first token).
    """
    from selfspec.decode.generate import speculative_generate
    from selfspec.heads.fingerprint import target_fingerprint

    if not prompts_ids:
        raise ValueError("calibrate_acceptance needs at least one prompt")
    if depth_max < 1 or total_tokens_max < 1:
        raise ValueError("depth_max and total_tokens_max must be >= 1")
    accepted = torch.zeros(depth_max, total_tokens_max, dtype=torch.long)
    inexact = torch.zeros(depth_max, total_tokens_max, dtype=torch.long)
    steps = 0

    def on_step(tree, result) -> None:
        nonlocal steps
        a, x = step_acceptance(drafter.last_candidates, result.accepted_nodes, result.next_token, depth_max,
                               total_tokens_max)
        accepted.add_(a)
        inexact.add_(x.long())
        steps += 1

    saved = (drafter.depth, drafter.total_tokens)
    drafter.depth, drafter.total_tokens = depth_max, total_tokens_max
    try:
        for ids in prompts_ids:
            speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                 step_callback=on_step)
    finally:
        drafter.depth, drafter.total_tokens = saved
    if steps == 0:
        raise ValueError("no verification step ran: raise max_new_tokens (every prompt stopped at its first token)")
    tau = 1.0 + accepted.double() / steps
    return AcceptanceProfile(
        top_k=drafter.top_k,
        tau=tuple(tuple(float(x) for x in row) for row in tau.tolist()),
        inexact_steps=tuple(tuple(int(x) for x in row) for row in inexact.tolist()),
        steps=steps,
        prompts=len(prompts_ids),
        max_new_tokens=max_new_tokens,
        target_fingerprint=target_fingerprint(target),
        created_utc=_now_utc(),
    )


# --------------------------------------------------------------------------------------------------
# The choice


@dataclass(frozen=True)
class BudgetOption:
    """One candidate budget and its expected cost and throughput (times in ms)."""

    depth: int
    total_tokens: int
    tau: float
    draft_ms: float
    verify_ms: float
    cycle_ms: float
    tokens_per_s: float
    speedup: float


@dataclass(frozen=True)
class TreeBudget:
    """The chosen EAGLE-2 budget.

    Attributes:
        depth, total_tokens, top_k: the drafter settings.
        expected_tau: tau of the budget (from the acceptance profile).
        expected_cycle_ms: draft + verify (+ overhead) ms of one step.
        expected_speedup: ``(tau / cycle_ms) / (1 / plain_step_ms)``.
        plain_step_ms: the cost of one plain decoding step (one token, plain ``linear``).
        table: every budget considered, in (depth, total_tokens) order.
    """

    depth: int
    total_tokens: int
    top_k: int
    expected_tau: float
    expected_cycle_ms: float
    expected_speedup: float
    plain_step_ms: float
    table: tuple[BudgetOption, ...] = ()

    def summary(self) -> dict[str, Any]:
        """The budget without its table (for reports)."""
        return {"depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens,
                "expected_tau": self.expected_tau, "expected_cycle_ms": self.expected_cycle_ms,
                "expected_speedup": self.expected_speedup, "plain_step_ms": self.plain_step_ms}


def choose_tree_budget(
    cost: CostProfile,
    acceptance: AcceptanceProfile,
    draft_ms_by_depth: Mapping[int, float],
    plain_step_ms: float | None = None,
    overhead_ms: float = 0.0,
    depth: int | None = None,
    total_tokens: int | None = None,
) -> TreeBudget:
    """The (depth d, total_tokens N) maximising expected tokens per second (Sequoia-style hardware-aware sizing).

    ``tokens_per_s(d, N) = 1000 * tau(d, N) / (draft_ms(d) + verify_ms(n + 1) + overhead_ms)`` with
    ``n = min(N, candidates(d))`` (a budget above what a depth creates keeps them all, so only
    ``N <= candidates(d)`` is listed) and ``verify_ms`` interpolated linearly between measured sizes
    (:meth:`CostProfile.verify_cost_ms`). Ties go to the smaller tree.

    Args:
        cost: the verification cost profile.
        acceptance: the acceptance profile.
        draft_ms_by_depth: ``{depth: ms}`` of one draft at that depth, for every depth considered.
        plain_step_ms: ms of one plain decoding step; None = ``cost.plain_step_ms``.
        overhead_ms: per-step cost outside draft and verify forwards (acceptance, KV compaction).
        depth: fix the depth (user override); None = choose.
        total_tokens: fix N (user override); None = choose.

    Returns:
        :class:`TreeBudget` with the whole table.

    Raises:
        ValueError: a fixed value outside the acceptance table, or a depth without a draft cost.
    """
    depths = [depth] if depth is not None else list(range(1, acceptance.depth_max + 1))
    plain = cost.plain_step_ms if plain_step_ms is None else plain_step_ms
    options: list[BudgetOption] = []
    for d in depths:
        if not 1 <= d <= acceptance.depth_max:
            raise ValueError(f"depth {d} is outside the acceptance profile (1..{acceptance.depth_max})")
        if d not in draft_ms_by_depth:
            raise ValueError(f"no draft cost for depth {d}")
        n_cand = num_candidates(acceptance.top_k, d)
        if total_tokens is not None:
            if min(total_tokens, n_cand) > acceptance.total_tokens_max:
                continue
            budgets = [total_tokens]
        else:
            budgets = list(range(1, min(n_cand, acceptance.total_tokens_max) + 1))
        for n in budgets:
            tau = acceptance.tau_at(d, n)
            verify = cost.verify_cost_ms(min(n, n_cand) + 1)
            cycle = float(draft_ms_by_depth[d]) + verify + overhead_ms
            tps = 1e3 * tau / cycle
            options.append(BudgetOption(d, n, tau, float(draft_ms_by_depth[d]), verify, cycle, tps, tau * plain / cycle))
    if not options:
        raise ValueError(f"total_tokens {total_tokens} is outside the acceptance profile "
                         f"(total_tokens <= {acceptance.total_tokens_max}) at every depth considered")
    best = max(options, key=lambda o: (o.tokens_per_s, -o.cycle_ms))
    return TreeBudget(best.depth, best.total_tokens, acceptance.top_k, best.tau, best.cycle_ms, best.speedup, plain,
                      tuple(options))


def tune_tree_budget(
    target,
    drafter: EagleDrafter,
    acceptance: AcceptanceProfile,
    depth: int | None = None,
    total_tokens: int | None = None,
    refresh: bool = False,
    overhead_ms: float = 0.0,
) -> TreeBudget:
    """Choose the budget for ``drafter`` on ``target`` here: cached (or measured) verification and drafting
    costs, then :func:`choose_tree_budget`. Does not change the drafter; installs the cost profile's
    linear kernels on the target (:func:`~selfspec.decode.kv.set_linear_kernels`), so that verification
    runs the way its cost was measured.

    Raises:
        ValueError: ``acceptance`` was profiled with another ``top_k`` than the drafter's, or see
            :func:`choose_tree_budget`.
    """
    if acceptance.top_k != drafter.top_k:
        raise ValueError(f"the acceptance profile was measured with top_k={acceptance.top_k}, "
                         f"the drafter uses top_k={drafter.top_k}")
    cost = use_cost_profile(target, refresh=refresh)
    depths = [depth] if depth is not None else range(1, acceptance.depth_max + 1)
    draft = get_draft_cost(drafter, target, depths, refresh=refresh)
    return choose_tree_budget(cost, acceptance, draft, overhead_ms=overhead_ms, depth=depth, total_tokens=total_tokens)


@dataclass(frozen=True)
class MedusaTreeSize:
    """The Medusa tree size chosen for a machine (:func:`choose_medusa_tree_nodes`).

    Attributes:
        num_nodes: tree nodes N, root included.
        expected_tau: ``1 + sum`` of the chosen paths' estimated acceptance (from the heads' accuracies).
        expected_cycle_ms: ``draft_ms + verify_ms(N)``.
        expected_speedup: ``expected_tau * plain_step_ms / expected_cycle_ms``.
        table: ``(N, expected_tau, expected_speedup)`` for every size considered.
    """

    num_nodes: int
    expected_tau: float
    expected_cycle_ms: float
    expected_speedup: float
    table: tuple[tuple[int, float, float], ...]


def choose_medusa_tree_nodes(
    cost: CostProfile, topk_accuracy: Sequence[Sequence[float]], max_nodes: int = 32, draft_ms: float = 0.0
) -> MedusaTreeSize:
    """Size a Medusa tree to the machine: the N in ``2..max_nodes`` maximising
    ``tau(N) / (draft_ms + verify_ms(N))``.

    ``tau(N)`` is Medusa's own estimate for its greedy tree of N nodes
    (:func:`~selfspec.decode.tree.greedy_tree_scores`: products of the heads' held-out top-k
    accuracies, as if heads erred independently), and ``verify_ms`` is
    :meth:`CostProfile.verify_cost_ms`. Medusa's drafting (one pass of small heads over one hidden
    state) measured 2-3 % of a step on the 2-core CPU, hence ``draft_ms = 0`` by default. Ties go to
    the smaller tree.

    Args:
        cost: the target's verification cost profile on this machine.
        topk_accuracy: ``[K][k]`` cumulative top-1..top-k accuracies per head (the heads' config).
        max_nodes: the largest tree considered (root included), >= 2.
        draft_ms: drafting cost per step, ms.

    Returns:
        :class:`MedusaTreeSize`.

    Raises:
        ValueError: ``max_nodes < 2``, or no accuracies.
    """
    from selfspec.decode.tree import greedy_tree_scores

    if max_nodes < 2:
        raise ValueError("max_nodes must be >= 2")
    if not topk_accuracy or not topk_accuracy[0]:
        raise ValueError("need the heads' top-k accuracies (head_topk_accuracy in their config)")
    scores = [score for _, score in greedy_tree_scores(topk_accuracy, max_nodes)]
    plain = cost.plain_step_ms
    table, best = [], None
    for n in range(2, len(scores) + 2):
        tau = 1.0 + sum(scores[: n - 1])
        cycle = draft_ms + cost.verify_cost_ms(n)
        option = (n, tau, tau * plain / cycle)
        table.append(option)
        if best is None or option[2] > best[2]:
            best = option
    n, tau, speedup = best
    return MedusaTreeSize(n, tau, draft_ms + cost.verify_cost_ms(n), speedup, tuple(table))


def budget_table_text(budget: TreeBudget, columns: Sequence[int] = DEFAULT_NODE_COUNTS) -> str:
    """Plain-text tables of expected tau and speedup by depth (rows) and ``total_tokens`` (columns)."""
    cells = {(o.depth, o.total_tokens): o for o in budget.table}
    depths = sorted({o.depth for o in budget.table})
    cols = sorted({n for n in columns if any((d, n) in cells for d in depths)} | {budget.total_tokens})
    lines = []
    for title, attr, fmt in (("expected tau", "tau", "{:.2f}"), ("expected speedup", "speedup", "{:.2f}x")):
        lines.append(f"{title} (rows: depth, columns: total_tokens; * = chosen)")
        lines.append("depth " + "".join(f"{n:>8}" for n in cols))
        for d in depths:
            row = []
            for n in cols:
                o = cells.get((d, n))
                text = "-" if o is None else fmt.format(getattr(o, attr))
                row.append(f"{text + ('*' if (d, n) == (budget.depth, budget.total_tokens) else ''):>8}")
            lines.append(f"{d:>5} " + "".join(row))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
