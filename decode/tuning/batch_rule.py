"""How big each row's draft tree should be at batch size B, measured on this machine, down to no tree at all.

At batch 1 verifying a tree costs little more than one plain step, because a decode step is bound by
reading the weights; as the batch grows the target's forward fills with real work and the extra tree nodes
stop being nearly free (the serving rule of adaptive speculation under batching). So the rule needs the
verification cost by batch size and tree size, measured here: :class:`BatchCostProfile` holds the median ms
of one :meth:`~selfspec.decode.verifier.Verifier.forward_block` plus the logits, for B rows of N nodes each.

Per row, a step at batch B costs ``verify_ms(B, N) / B + draft_ms`` (rows draft one after another) and
yields tau tokens; plain decoding costs ``verify_ms(B, 1) / B`` a token. :class:`BatchTreeRule` picks, for
each batch size, the tree that maximises tokens per second per row, or no speculation (depth 0) when
nothing beats plain decoding:

* for an EAGLE head with an acceptance profile, the EAGLE-2 budget (depth, total_tokens) of
  :func:`~selfspec.decode.tuning.budget.choose_tree` over the EAGLE budgets on the per-row cost curve of batch B;
* for any other drafter, a depth cap chosen from the acceptance by depth measured so far in the same
  call (how often the accepted path reached each depth) and the measured draft time.

Profiles are cached as JSON under ``<cache root>/profiles`` like the batch-1 cost profile.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.files import now_utc, profiles_dir, read_cached, read_dataclass, record_dict, write_cached
from selfspec.decode.loop import TreeCap
from selfspec.decode.tuning.budget import choose_tree, eagle_trees
from selfspec.decode.tuning.costs import CostProfile, cost_key, interleaved_medians, profile_stem
from selfspec.decode.verifier import Verifier

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from selfspec.decode.tuning.calibration import AcceptanceProfile

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
BATCH_NODE_COUNTS = (1, 2, 4, 8, 16, 32)
_HEADER = {"format": "selfspec-batch-verify-cost", "version": 1}


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys); constant below the first point, the last slope beyond the last."""
    if x <= xs[0] or len(xs) == 1:
        return float(ys[0] if x <= xs[0] else ys[-1])
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return float(ys[i - 1] + t * (ys[i] - ys[i - 1]))
    return float(ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1]))


@dataclass(frozen=True)
class BatchCostProfile:
    """Verification cost of one target here by batch size and tree size.

    Attributes:
        key: the measurement's identity (:func:`~selfspec.decode.tuning.costs.cost_key`).
        context_length: tokens cached per row before the tree.
        batch_sizes: B measured, strictly increasing.
        node_counts: N measured per row (root included), strictly increasing.
        verify_ms: ``verify_ms[i][j]``: median wall ms of one block forward plus logits of
            ``batch_sizes[i]`` rows of ``node_counts[j]`` nodes.
        created_utc: ISO 8601 time of the measurement.
    """

    key: Mapping[str, Any]
    context_length: int
    batch_sizes: tuple[int, ...]
    node_counts: tuple[int, ...]
    verify_ms: tuple[tuple[float, ...], ...]
    created_utc: str = ""

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "node_counts"):
            v = getattr(self, name)
            if not v or any(not isinstance(x, int) or x < 1 for x in v) or list(v) != sorted(set(v)):
                raise ValueError(f"{name} must be strictly increasing integers >= 1, got {list(v)}")
        ok = len(self.verify_ms) == len(self.batch_sizes) and all(
            len(r) == len(self.node_counts)
            and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in r)
            for r in self.verify_ms
        )
        if not ok:
            raise ValueError("verify_ms must hold one finite positive ms per (batch size, node count)")

    def step_ms(self, batch: int, nodes: float) -> float:
        """Expected ms of one forward of ``batch`` rows of ``nodes`` nodes each (interpolated in both)."""
        per_batch = [_interp(self.node_counts, row, nodes) for row in self.verify_ms]
        return max(1e-6, _interp(self.batch_sizes, per_batch, batch))

    def per_row_profile(self, batch: int) -> CostProfile:
        """The cost curve of one row at batch ``batch`` (``step_ms(batch, N) / batch`` by N), in the
        :class:`~selfspec.decode.tuning.costs.CostProfile` form the budget choice reads."""
        return CostProfile(
            **dict(self.key),
            context_length=self.context_length,
            node_counts=self.node_counts,
            verify_ms=tuple(self.step_ms(batch, n) / batch for n in self.node_counts),
        )

    def to_dict(self) -> dict[str, Any]:
        return record_dict(self, _HEADER)

    @classmethod
    def from_dict(cls, data: Any) -> BatchCostProfile:
        """Parse :meth:`to_dict`'s layout strictly. Raises ValueError on anything else."""
        return read_dataclass(cls, data, "batch cost profile", header=_HEADER)


@torch.inference_mode()
def measure_batch_cost_profile(
    target: PreTrainedModel,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    node_counts: Sequence[int] = BATCH_NODE_COUNTS,
    context_length: int = 128,
    repeats: int = 3,
    verifier: Verifier | None = None,
) -> BatchCostProfile:
    """Measure :class:`BatchCostProfile` for ``target`` where it is (device, dtype, threads).

    For each batch size B, B rows of ``context_length`` random tokens are cached; then each tree size N
    (a bushy tree, node i's parent ``(i - 1) // 2``) is timed as one :meth:`Verifier.forward_block` plus
    :meth:`Verifier.lm_logits` over the B * N hidden states, the cache cropped back after every call;
    sizes interleaved, one untimed call each, the median of ``repeats``. About 30 s for SmolLM2-135M on
    a 2-core CPU with the defaults. ``verifier``: the one that will decode (its kernel plan is timed with
    it); None = a plain one. The target is not modified.

    Raises:
        ValueError: empty or non-positive sizes, ``context_length < 1``.
    """
    bs, ns = sorted({int(b) for b in batch_sizes}), sorted({int(n) for n in node_counts})
    if not bs or not ns or bs[0] < 1 or ns[0] < 1 or context_length < 1:
        raise ValueError("need batch sizes >= 1, node counts >= 1 and context_length >= 1")
    from selfspec.decode.batch_cache import SlotTable  # the block forward's cache bookkeeping

    device = next(target.parameters()).device
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    verifier = verifier or Verifier(target)
    rows: list[list[float]] = []
    for b in bs:
        cache, table = verifier.new_cache(), SlotTable(b)
        tokens = torch.randint(0, vocab, (b, context_length), generator=gen).to(device)
        positions = torch.arange(context_length).expand(b, -1)
        chain = torch.arange(-1, context_length - 1)
        verifier.forward_block(tokens, positions, table.positions, [chain] * b, cache)
        table.keep(cache, [torch.arange(context_length)] * b, positions)

        def step(n: int, cache=cache, table=table, b=b):
            toks = torch.randint(0, vocab, (b, n), generator=gen).to(device)
            parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n)])
            depths = torch.tensor([0] + [int(math.log2(i + 1)) for i in range(1, n)])
            pos = (depths + context_length).expand(b, -1)

            def run() -> None:
                h = verifier.forward_block(toks, pos, table.positions, [parents] * b, cache)
                verifier.lm_logits(h.reshape(b * n, -1))
                for layer in cache.layers:
                    layer.crop(context_length - layer.get_seq_length())

            return run

        medians = interleaved_medians({n: step(n) for n in ns}, {n: repeats for n in ns}, device)
        rows.append([round(medians[n], 4) for n in ns])
    return BatchCostProfile(cost_key(target), context_length, tuple(bs), tuple(ns), tuple(map(tuple, rows)), now_utc())


def batch_cost_path(target: PreTrainedModel) -> Path:
    """Where the batch cost profile of ``target`` here is cached."""
    return profiles_dir() / f"batch-verify-{profile_stem(cost_key(target), next(target.parameters()).device)}.json"


def get_batch_cost_profile(
    target: PreTrainedModel, refresh: bool = False, verifier: Verifier | None = None
) -> BatchCostProfile:
    """The cached :class:`BatchCostProfile` of ``target`` here, measured (and cached) when missing, stale
    (another key) or unreadable (with a warning). ``verifier``: the one that decodes, timed with its kernel
    plan (the plan follows from the target's cached batch-1 cost profile, so one file serves it)."""
    path = batch_cost_path(target)
    cached = None if refresh else read_cached(path, BatchCostProfile.from_dict, "batch cost profile")
    if cached is not None and dict(cached.key) == cost_key(target):
        return cached
    logger.warning("measuring this target's verification cost by batch size once (about 30 s; cached afterwards)")
    profile = measure_batch_cost_profile(target, verifier=verifier)
    write_cached(path, profile.to_dict(), "batch cost profile")
    return profile


class BatchTreeRule:
    """Per-batch-size tree sizes from the measured costs (see module docstring); a
    :class:`~selfspec.decode.loop.TreePolicy` of the decode loop.

    Args:
        cost: the :class:`BatchCostProfile` of the target here.
        acceptance: an EAGLE head's acceptance profile (then ``draft_ms_by_depth`` too); None = the online
            rule for any drafter.
        draft_ms_by_depth: ``{depth: ms}`` of one EAGLE draft per row.
        max_depth: deepest depth the online rule may allow (the drafter's own depth).
    """

    def __init__(
        self,
        cost: BatchCostProfile,
        acceptance: AcceptanceProfile | None = None,
        draft_ms_by_depth: Mapping[int, float] | None = None,
        max_depth: int | None = None,
    ) -> None:
        if acceptance is not None and not draft_ms_by_depth:
            raise ValueError("an acceptance profile needs the drafting cost by depth (draft_ms_by_depth)")
        self.cost = cost
        self.acceptance = acceptance
        self.draft_ms_by_depth = dict(draft_ms_by_depth or {})
        self.max_depth = max_depth
        self._fixed: dict[int, TreeCap] = {}
        self._drafted: list[int] = []  # steps whose tree reached depth d + 1
        self._reached: list[int] = []  # steps whose accepted path reached depth d + 1
        self._nodes_upto: list[float] = []  # sum over trees of nodes at depth <= d + 1
        self._nodes_sum = 0.0  # sum over trees of their draft nodes
        self._trees = 0
        self._draft_ms = 0.0

    def __call__(self, batch: int) -> TreeCap:
        """The cap for a step with ``batch`` rows decoding."""
        if self.acceptance is not None:
            if batch not in self._fixed:
                self._fixed[batch] = self._eagle_cap(batch)
            return self._fixed[batch]
        return self._online_cap(batch)

    def _eagle_cap(self, batch: int) -> TreeCap:
        trees = eagle_trees(self.acceptance, self.draft_ms_by_depth)
        size = choose_tree(self.cost.per_row_profile(batch), trees)
        if size.expected_speedup <= 1.0:
            return TreeCap(depth=0, expected_speedup=1.0)
        return TreeCap(size.shape.depth, size.shape.tokens, expected_speedup=size.expected_speedup)

    def _online_cap(self, batch: int) -> TreeCap:
        if not self._trees:
            return TreeCap(depth=self.max_depth)  # nothing measured yet: the drafter's own tree
        plain = self.cost.step_ms(batch, 1) / batch
        best, best_rate, tokens = 0, 1.0 / plain, 1.0
        for d in range(1, len(self._drafted) + 1):
            if self._drafted[d - 1] == 0:
                break
            tokens += self._reached[d - 1] / self._drafted[d - 1]
            nodes = 1.0 + self._nodes_upto[d - 1] / self._trees
            rate = tokens / (self.cost.step_ms(batch, nodes) / batch + self._draft_ms)
            if rate > best_rate:
                best, best_rate = d, rate
        return TreeCap(depth=best, expected_speedup=best_rate * plain)

    def observe(self, depths: torch.Tensor, accepted_depth: int, draft_s: float) -> None:
        """Record one drafted row-step: its tree's node depths ``[N]`` (CPU), how deep its accepted path
        went, and the seconds its drafting took (a tree of the root alone tells nothing and is skipped)."""
        deepest = int(depths.max())
        if deepest == 0:
            return
        while len(self._drafted) < deepest:
            self._drafted.append(0)
            self._reached.append(0)
            self._nodes_upto.append(self._nodes_sum)  # every earlier tree was shallower: all its nodes fit
        counts = torch.bincount(depths, minlength=deepest + 1).tolist()
        upto = 0
        for d in range(1, len(self._drafted) + 1):
            if d <= deepest:
                upto += counts[d]
                self._drafted[d - 1] += 1
                self._reached[d - 1] += int(d <= accepted_depth)
            self._nodes_upto[d - 1] += upto
        self._nodes_sum += upto
        self._trees += 1
        self._draft_ms += (draft_s * 1e3 - self._draft_ms) / self._trees

    def table(self, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> list[dict[str, Any]]:
        """The cap at each batch size, for reports: ``[{"batch", "depth", "total_tokens", "expected_speedup"}]``."""
        return [
            {"batch": b, "depth": c.depth, "total_tokens": c.total_tokens, "expected_speedup": c.expected_speedup}
            for b in batch_sizes
            for c in [self(b)]
        ]
