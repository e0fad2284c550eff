"""How big each row's draft tree should be at batch size B and the acceptance the traffic gives, down to no tree.

At batch 1 verifying a tree costs little more than one plain step, because a decode step is bound by
reading the weights; as the batch grows the target's forward fills with real work and the extra tree nodes
stop being nearly free (the serving rule of adaptive speculation under batching). So the rule needs the
verification cost by batch size and tree size, measured here: :class:`BatchCostProfile` holds the median ms
of one :meth:`~selfspec.decode.verifier.Verifier.forward_block` plus the logits, for B rows of N nodes each.

Per row, a step at batch B costs ``verify_ms(B, N) / B + draft_ms`` (rows draft one after another) and
yields tau tokens; plain decoding costs ``verify_ms(B, 1) / B`` a token (at batch 1 the batch-1 cost profile of
the verifier that decodes). :class:`BatchTreeRule` picks, each step, the tree that maximises tokens per second per
row, or no speculation (depth 0) when nothing beats plain decoding, from the acceptance the drafter is getting
(counted with a decay, per request and across requests, blended with a prior):

* for an EAGLE head with an acceptance profile, the EAGLE-2 budget (depth, total_tokens) of
  :func:`~selfspec.decode.tuning.budget.choose_tree` over the EAGLE budgets, their tau scaled by the live
  acceptance against the profile's, on the per-row cost curve of batch B;
* for any other drafter, a depth cap chosen from the acceptance by depth measured so far (how often the accepted
  path reached each depth) and the measured draft time.

A drafter whose live acceptance does not pay is switched off for a bounded back-off and probed again (adaptive
speculation: shrink the tree, or switch speculation off, as the load and the acceptance change).

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
from selfspec.decode.tuning.costs import CostProfile, cost_key, profile_stem
from selfspec.decode.tuning.timing import interleaved_medians
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


# The live acceptance estimate: each drafted row-step multiplies what was counted before by LIVE_DECAY (a memory of
# about 1 / (1 - LIVE_DECAY) = 100 drafted row-steps, across requests), and the head's offline acceptance profile
# counts as PRIOR_STEPS steps of its own expectation; a drafter without a profile starts from one pseudo-step in which
# depth d is reached with probability PRIOR_REACH ** d.
LIVE_DECAY = 0.99
PRIOR_STEPS = 4.0
PRIOR_REACH = 0.5
# When the live acceptance cannot pay for a tree, drafting is switched off for BACKOFF_MIN steps, then one step
# probes with the prior's tree; each probe that still does not pay doubles the pause, up to BACKOFF_MAX steps (so
# probing costs at most one drafted step in BACKOFF_MAX + 1 once a drafter has stopped paying).
BACKOFF_MIN = 4
BACKOFF_MAX = 64
# Drafting switched off resumes only where the live estimate expects at least this gain over plain decoding.
RESUME_MARGIN = 0.05
_OFF = TreeCap(depth=0, expected_speedup=1.0)


class BatchTreeRule:
    """The one tree rule of the decode loop (a :class:`~selfspec.decode.loop.TreePolicy`): each step's tree from the
    verification cost at the number of rows still decoding and the acceptance the drafter is getting on the current
    traffic, down to no tree at all.

    The acceptance is live: every verified row-step is counted with a decay (:data:`LIVE_DECAY`), per request and
    across the requests the rule serves, blended with a prior:

    * for an EAGLE head with an acceptance profile: the accepted drafts against the drafts the profile expected of
      the trees drafted give a scale ``s = (accepted + w) / (expected + w)`` (``w``: :data:`PRIOR_STEPS` steps of the
      profile's expectation), and the EAGLE-2 budget is chosen (:func:`~selfspec.decode.tuning.budget.choose_tree`)
      over the profile's budgets with ``tau = 1 + s (tau_profile - 1)`` on the per-row cost curve of batch B;
    * for any other drafter (prompt lookup, the hybrid, Medusa, block heads, a draft model): a depth cap from how
      often the accepted path reached each depth (:data:`PRIOR_REACH` as a one-step prior) and the measured draft
      time.

    When no tree pays (expected tokens per cycle over the cycle's cost in plain steps <= 1) but the prior's tree
    would, drafting is switched off for a bounded back-off, then probed again with the prior's tree
    (:data:`BACKOFF_MIN`, :data:`BACKOFF_MAX`), and resumes once the estimate expects a clear gain
    (:data:`RESUME_MARGIN`); where not even the prior pays (an EAGLE budget at a large batch), plain decoding without
    probes.

    Args:
        cost: the :class:`BatchCostProfile` of the target here; None = batch 1 only (then ``single``).
        acceptance: an EAGLE head's acceptance profile (then ``draft_ms_by_depth`` too); None = the per-depth rule.
        draft_ms_by_depth: ``{depth: ms}`` of one EAGLE draft per row.
        max_depth: deepest depth the per-depth rule may allow (the drafter's own depth).
        single: the batch-1 cost profile of the verifier that decodes
            (:class:`~selfspec.decode.tuning.costs.CostProfile`, its kernel plan's curve): batch 1 verifies one
            tree after the row's own cache, as that profile measured; None = the batch profile's batch-1 row.

    Raises:
        ValueError: an acceptance profile without drafting costs, or neither cost profile.
    """

    def __init__(
        self,
        cost: BatchCostProfile | None,
        acceptance: AcceptanceProfile | None = None,
        draft_ms_by_depth: Mapping[int, float] | None = None,
        max_depth: int | None = None,
        single: CostProfile | None = None,
    ) -> None:
        if acceptance is not None and not draft_ms_by_depth:
            raise ValueError("an acceptance profile needs the drafting cost by depth (draft_ms_by_depth)")
        if cost is None and single is None:
            raise ValueError("a tree rule needs a cost profile: the batch one, or the batch-1 one (single=)")
        self.cost = cost
        self.single = single
        self.acceptance = acceptance
        self.draft_ms_by_depth = dict(draft_ms_by_depth or {})
        self.max_depth = max_depth
        self._choices: dict[tuple[int, float], TreeCap] = {}
        self._prior_weight: float | None = None
        self._accepted = 0.0  # EAGLE: decayed accepted drafts
        self._expected = 0.0  # EAGLE: decayed drafts the profile expected of the same trees
        self._drafted: list[float] = []  # decayed steps whose tree reached depth d + 1
        self._reached: list[float] = []  # decayed steps whose accepted path reached depth d + 1
        self._nodes_upto: list[float] = []  # decayed sum over trees of nodes at depth <= d + 1
        self._nodes_sum = 0.0  # decayed sum over trees of their draft nodes
        self._trees = 0.0
        self._draft_ms = 0.0  # decayed mean ms of drafting one tree
        self._seen = 0  # drafted row-steps observed
        self._off_left = 0
        self._backoff = BACKOFF_MIN
        self._probe_due = False
        self._paused = False  # drafting was switched off and has not resumed

    def with_batch_cost(self, cost: BatchCostProfile) -> BatchTreeRule:
        """Give a batch-1 rule the cost by batch size (what it learnt is kept). Returns the rule."""
        if self.cost is None:
            self.cost = cost
            self._choices.clear()
        return self

    # ---------------------------------------------------------------- costs
    def per_row_profile(self, batch: int) -> CostProfile:
        """The verification cost of one row at ``batch`` rows by its tree's nodes."""
        if batch == 1 and self.single is not None:
            return self.single
        if self.cost is None:
            raise ValueError(f"a batch of {batch} needs the cost by batch size (with_batch_cost)")
        return self.cost.per_row_profile(batch)

    def _step_ms(self, batch: int, nodes: float) -> float:
        return self.per_row_profile(batch).verify_cost_ms(nodes)

    # ---------------------------------------------------------------- the decision
    def __call__(self, batch: int) -> TreeCap:
        """The cap for a step with ``batch`` rows decoding (the back-off advances: call it once per step)."""
        if self._off_left > 0:
            self._off_left -= 1
            return _OFF
        if self._probe_due:
            self._probe_due = False
            probe = self.prior_cap(batch)
            if probe.depth != 0:
                return probe
        cap = self.cap_at(batch)
        # after a switch-off, drafting resumes only on a clear gain (hysteresis: an estimate at break-even, where the
        # prior's weight holds it, would otherwise toggle at every probe)
        needed = 1.0 + RESUME_MARGIN if self._paused else 1.0
        if cap.depth != 0 and (cap.expected_speedup is None or cap.expected_speedup >= needed):
            self._paused = False
            self._backoff = BACKOFF_MIN
            return cap
        if self.prior_cap(batch).depth == 0:
            return _OFF  # not even the prior's acceptance pays here: plain decoding, nothing to probe
        self._paused = True
        self._off_left = self._backoff - 1
        self._backoff = min(2 * self._backoff, BACKOFF_MAX)
        self._probe_due = True
        return _OFF

    def cap_at(self, batch: int) -> TreeCap:
        """The cap the live acceptance chooses at ``batch`` rows now (no back-off; changes nothing)."""
        if self.acceptance is not None:
            return self._eagle_cap(batch, self.scale())
        return self._depth_cap(batch)

    def prior_cap(self, batch: int) -> TreeCap:
        """The cap of the prior alone (a probe's tree): an EAGLE head's offline choice, else the drafter's own tree."""
        if self.acceptance is not None:
            return self._eagle_cap(batch, 1.0)
        return TreeCap(depth=self.max_depth)

    @property
    def drafting_off(self) -> bool:
        """True while a back-off holds drafting off."""
        return self._off_left > 0

    def scale(self) -> float:
        """EAGLE: the live acceptance over the profile's, ``(accepted + w) / (expected + w)`` (1.0 before any step)."""
        w = self._prior_drafts()
        return (self._accepted + w) / (self._expected + w)

    def _prior_drafts(self) -> float:
        """PRIOR_STEPS steps of the drafts the profile expects of its batch-1 choice."""
        if self._prior_weight is None:
            size = choose_tree(self.per_row_profile(1), self._trees_at(1.0))
            self._prior_weight = PRIOR_STEPS * max(size.expected_tau - 1.0, 0.1)
        return self._prior_weight

    def _trees_at(self, scale: float):
        return [
            (shape, min(float(shape.depth + 1), 1.0 + scale * (tau - 1.0)), ms)
            for shape, tau, ms in eagle_trees(self.acceptance, self.draft_ms_by_depth)
        ]

    def _eagle_cap(self, batch: int, scale: float) -> TreeCap:
        key = (batch, round(scale, 2))  # the choice moves in steps of 1 % of the profile's acceptance
        if key not in self._choices:
            size = choose_tree(self.per_row_profile(batch), self._trees_at(key[1]))
            self._choices[key] = (
                _OFF
                if size.expected_speedup <= 1.0
                else TreeCap(size.shape.depth, size.shape.tokens, expected_speedup=size.expected_speedup)
            )
        return self._choices[key]

    def _depth_cap(self, batch: int) -> TreeCap:
        if not self._trees:
            return TreeCap(depth=self.max_depth)  # nothing measured yet: the drafter's own tree
        plain = self._step_ms(batch, 1)
        best, best_rate, tokens = 0, 1.0 / plain, 1.0
        for d in range(1, len(self._drafted) + 1):
            if self._drafted[d - 1] <= 1e-9 or (self.max_depth is not None and d > self.max_depth):
                break
            tokens += (self._reached[d - 1] + PRIOR_REACH**d) / (self._drafted[d - 1] + 1.0)
            nodes = 1.0 + self._nodes_upto[d - 1] / self._trees
            rate = tokens / (self._step_ms(batch, nodes) + self._draft_ms)
            if rate > best_rate:
                best, best_rate = d, rate
        return TreeCap(depth=best, expected_speedup=best_rate * plain)

    # ---------------------------------------------------------------- what the traffic gives
    def observe(self, depths: torch.Tensor, accepted_depth: int, draft_s: float) -> None:
        """Record one verified row-step: its tree's node depths ``[N]`` (CPU), how deep its accepted path went, and
        the seconds its drafting took. A tree of the root alone (nothing drafted) tells nothing and is skipped; a
        drafted one decays what was counted before (the estimate forgets by evidence, not by time, so a pause
        does not drift it back to the prior: only probes move it)."""
        deepest = int(depths.max())
        if deepest == 0:
            return
        for name in ("_accepted", "_expected", "_nodes_sum", "_trees"):
            setattr(self, name, getattr(self, name) * LIVE_DECAY)
        for counts in (self._drafted, self._reached, self._nodes_upto):
            counts[:] = [c * LIVE_DECAY for c in counts]
        if self.acceptance is not None:
            a = self.acceptance
            n = min(depths.numel() - 1, a.total_tokens_max)
            self._expected += a.tau_at(min(deepest, a.depth_max), n) - 1.0
            self._accepted += accepted_depth
        while len(self._drafted) < deepest:
            self._drafted.append(0.0)
            self._reached.append(0.0)
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
        self._draft_ms += (draft_s * 1e3 - self._draft_ms) * (1.0 - LIVE_DECAY if self._seen else 1.0)
        self._seen += 1

    def table(self, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> list[dict[str, Any]]:
        """The cap the live acceptance chooses at each batch size now, for reports:
        ``[{"batch", "depth", "total_tokens", "expected_speedup"}]``."""
        return [
            {"batch": b, "depth": c.depth, "total_tokens": c.total_tokens, "expected_speedup": c.expected_speedup}
            for b in batch_sizes
            for c in [self.cap_at(b)]
        ]
