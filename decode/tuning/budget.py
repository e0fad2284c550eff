"""One tree-size chooser: which draft tree (its shape) decodes fastest here, for every head family.

A pure choice from measured profiles (Sequoia-style hardware-aware sizing: Chen et al. 2024, "Sequoia:
Scalable, Robust, and Hardware-aware Speculative Decoding", arXiv:2402.12374): over the candidate trees a family
can draft, maximise

    expected tokens per second = tau(shape) / (draft_ms(shape) + verify_ms(nodes) + overhead_ms)

with :func:`choose_tree`, whose one result is a :class:`TreeSize`. What is family-specific is only the list of
candidates, each a :class:`TreeShape` with its expected tau and drafting cost, made by the family's enumerator:

- :func:`eagle_trees`: EAGLE-2's two knobs (Li et al. 2024, arXiv:2406.16858), the draft depth d and the number N
  of draft tokens kept after reranking, tau from the head's :class:`~selfspec.decode.tuning.calibration.
  AcceptanceProfile` and the drafting cost by depth;
- :func:`medusa_trees`: Medusa's greedy static tree of N nodes, tau from the heads' held-out top-k accuracies;
- :func:`block_trees`: a block drafter's chain length, width and branched depths, tau from the head's held-out
  chain and sibling acceptance, one block forward for every shape.

The costs come from :mod:`selfspec.decode.tuning.costs` and :mod:`selfspec.decode.tuning.draft_costs`
(:func:`tune_tree_budget` fetches them for an EAGLE head, measuring on first use); which enumerator a head family
uses is its drafter factory's business (:mod:`selfspec.families`), never a switch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfspec.decode.drafters.base import TreeShape
from selfspec.decode.masks import attention_layout
from selfspec.decode.state import MAX_CHAIN
from selfspec.decode.tree import greedy_tree_scores
from selfspec.decode.tuning.calibration import AcceptanceProfile, num_candidates
from selfspec.decode.tuning.costs import DEFAULT_NODE_COUNTS, CostProfile, get_cost_profile
from selfspec.decode.tuning.draft_costs import get_draft_cost

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from selfspec.decode.drafters.eagle import EagleDrafter

__all__ = [
    "TreeCandidate",
    "TreeOption",
    "TreeShape",
    "TreeSize",
    "block_trees",
    "choose_tree",
    "eagle_trees",
    "medusa_trees",
    "tree_table_text",
    "tune_tree_budget",
]


# One candidate tree of a family's enumerator: ``(shape, expected tau, ms to draft it)``.
TreeCandidate = tuple[TreeShape, float, float]


@dataclass(frozen=True)
class TreeOption:
    """One candidate tree with its expected cost and throughput (times in ms).

    Attributes:
        shape: the tree.
        tau: expected tokens per step (bonus token included).
        draft_ms / verify_ms: drafting it; verifying its nodes (:meth:`CostProfile.verify_cost_ms`).
        cycle_ms: ``draft_ms + verify_ms + overhead_ms``.
        tokens_per_s: ``1000 * tau / cycle_ms``.
        speedup: ``tau * plain_step_ms / cycle_ms``.
    """

    shape: TreeShape
    tau: float
    draft_ms: float
    verify_ms: float
    cycle_ms: float
    tokens_per_s: float
    speedup: float


@dataclass(frozen=True)
class TreeSize:
    """The tree chosen for a head on this machine (:func:`choose_tree`), with what was weighed.

    Attributes:
        shape: the chosen :class:`TreeShape`.
        expected_tau: its expected tokens per step.
        expected_cycle_ms: draft + verify (+ overhead) ms of one step.
        expected_tokens_per_s: ``1000 * expected_tau / expected_cycle_ms``.
        expected_speedup: ``expected_tau * plain_step_ms / expected_cycle_ms``.
        plain_step_ms: the cost of one plain decoding step (one token, plain ``linear``).
        table: every tree considered (:class:`TreeOption`), in the enumerator's order.
    """

    shape: TreeShape
    expected_tau: float
    expected_cycle_ms: float
    expected_tokens_per_s: float
    expected_speedup: float
    plain_step_ms: float
    table: tuple[TreeOption, ...] = ()


def choose_tree(
    cost: CostProfile,
    candidates: Sequence[TreeCandidate],
    plain_step_ms: float | None = None,
    overhead_ms: float = 0.0,
) -> TreeSize:
    """The candidate tree maximising expected tokens per second (Sequoia-style hardware-aware sizing).

    ``tokens_per_s = 1000 * tau / (draft_ms + verify_ms(nodes) + overhead_ms)``, ``verify_ms`` interpolated
    linearly between measured sizes (:meth:`CostProfile.verify_cost_ms`). Ties go to the cheaper cycle, then to the
    first listed (the enumerators list smaller trees first).

    Args:
        cost: the target's verification cost profile on this machine.
        candidates: the family's trees, ``(shape, tau, draft_ms)`` (:func:`eagle_trees`, :func:`medusa_trees`,
            :func:`block_trees`).
        plain_step_ms: ms of one plain decoding step; None = ``cost.plain_step_ms``.
        overhead_ms: per-step cost outside draft and verify forwards (acceptance, KV compaction).

    Returns:
        :class:`TreeSize` with the whole table.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no candidate tree to choose from")
    plain = cost.plain_step_ms if plain_step_ms is None else plain_step_ms
    table = []
    for shape, tau, draft_ms in candidates:
        verify = cost.verify_cost_ms(shape.nodes)
        cycle = float(draft_ms) + verify + overhead_ms
        table.append(TreeOption(shape, tau, float(draft_ms), verify, cycle, 1e3 * tau / cycle, tau * plain / cycle))
    best = max(table, key=lambda o: (o.tokens_per_s, -o.cycle_ms))
    return TreeSize(best.shape, best.tau, best.cycle_ms, best.tokens_per_s, best.speedup, plain, tuple(table))


def eagle_trees(
    acceptance: AcceptanceProfile,
    draft_ms_by_depth: Mapping[int, float],
    depth: int | None = None,
    total_tokens: int | None = None,
    chains: bool = False,
) -> list[TreeCandidate]:
    """EAGLE-2's candidate budgets (depth d, total_tokens N), in (d, N) order: ``tau(d, N)`` from the acceptance
    profile, ``n = min(N, candidates(d))`` draft nodes verified (a budget above what a depth creates keeps them all,
    so only ``N <= candidates(d)`` is listed), the draft cost of depth d.

    With ``chains`` (a target verified on chains only, :mod:`selfspec.decode.state`: the loop verifies a tree's
    first branch, at most :data:`~selfspec.decode.state.MAX_CHAIN` nodes), only the chains are priced: N = d, d + 1
    nodes verified, up to ``MAX_CHAIN``; their tau ``tau(d, d)`` is that of the d best-scored drafts, which a chain
    of d reaches where they lie on one branch (an upper bound otherwise).

    Args:
        acceptance: the head's acceptance profile (its ``top_k`` is the shapes').
        draft_ms_by_depth: ``{depth: ms}`` of one draft at that depth, for every depth considered.
        depth: fix the depth (user override); None = every depth of the profile.
        total_tokens: fix N (user override); None = every N of the profile.

    Raises:
        ValueError: a fixed value outside the acceptance table, or a depth without a draft cost.
    """
    depths = [depth] if depth is not None else list(range(1, acceptance.depth_max + 1))
    out: list[TreeCandidate] = []
    for d in depths:
        if not 1 <= d <= acceptance.depth_max:
            raise ValueError(f"depth {d} is outside the acceptance profile (1..{acceptance.depth_max})")
        if d not in draft_ms_by_depth:
            raise ValueError(f"no draft cost for depth {d}")
        n_cand = num_candidates(acceptance.top_k, d)
        if chains:
            fits = d + 1 <= MAX_CHAIN and d <= acceptance.total_tokens_max and total_tokens in (None, d)
            if fits:
                out.append(
                    (TreeShape(d, d, d + 1, acceptance.top_k), acceptance.tau_at(d, d), float(draft_ms_by_depth[d]))
                )
            continue
        if total_tokens is not None:
            if min(total_tokens, n_cand) > acceptance.total_tokens_max:
                continue
            budgets = [total_tokens]
        else:
            budgets = list(range(1, min(n_cand, acceptance.total_tokens_max) + 1))
        for n in budgets:
            shape = TreeShape(d, n, min(n, n_cand) + 1, acceptance.top_k)
            out.append((shape, acceptance.tau_at(d, n), float(draft_ms_by_depth[d])))
    if not out and chains:
        raise ValueError(
            f"this target is verified on chains only: total_tokens must equal the depth, at most {MAX_CHAIN - 1} "
            f"and {acceptance.total_tokens_max} (the acceptance profile's largest budget)"
        )
    if not out:
        raise ValueError(
            f"total_tokens {total_tokens} is outside the acceptance profile "
            f"(total_tokens <= {acceptance.total_tokens_max}) at every depth considered"
        )
    return out


def tune_tree_budget(
    target: PreTrainedModel,
    drafter: EagleDrafter,
    acceptance: AcceptanceProfile,
    depth: int | None = None,
    total_tokens: int | None = None,
    refresh: bool = False,
    overhead_ms: float = 0.0,
    cost: CostProfile | None = None,
) -> TreeSize:
    """Choose the EAGLE budget for ``drafter``'s head on ``target`` here: cached (or measured) verification and
    drafting costs, then :func:`choose_tree` over :func:`eagle_trees`. Changes neither the drafter nor the target.

    Args:
        cost: the verification cost profile to use; None = :func:`~selfspec.decode.tuning.costs.get_cost_profile`.
        Others: see :func:`eagle_trees` and :func:`choose_tree`; ``refresh`` measures the costs again.

    Raises:
        ValueError: ``acceptance`` was profiled with another ``top_k`` than the drafter's, or see
            :func:`eagle_trees`.
    """
    if acceptance.top_k != drafter.top_k:
        raise ValueError(
            f"the acceptance profile was measured with top_k={acceptance.top_k}, the drafter uses top_k={drafter.top_k}"
        )
    if cost is None:
        cost = get_cost_profile(target, refresh=refresh)
    depths = [depth] if depth is not None else range(1, acceptance.depth_max + 1)
    draft = get_draft_cost(drafter, target, depths, refresh=refresh)
    chains = attention_layout(target.config).chains_only  # a state target: chains priced (eagle_trees)
    return choose_tree(cost, eagle_trees(acceptance, draft, depth, total_tokens, chains), overhead_ms=overhead_ms)


def medusa_trees(
    topk_accuracy: Sequence[Sequence[float]], max_nodes: int = 32, draft_ms: float = 0.0, chains: bool = False
) -> list[TreeCandidate]:
    """Medusa's candidate trees: its greedy static tree of N nodes for N in ``2..max_nodes``, in N order. With
    ``chains`` (a target verified on chains only), the chains of every head's top-1 instead: N - 1 heads, N up to
    ``max_nodes``, :data:`~selfspec.decode.state.MAX_CHAIN` and the heads + 1, ``tau(N) = 1 + sum over d < N of the
    product of the first d heads' top-1 accuracies``.

    ``tau(N)`` is Medusa's own estimate for its greedy tree of N nodes (:func:`~selfspec.decode.tree.
    greedy_tree_scores`: ``1 +`` the sum of products of the heads' held-out top-k accuracies, as if heads erred
    independently). Medusa's drafting (one pass of small heads over one hidden state) measured 2-3 % of a step on
    the 2-core CPU, hence ``draft_ms = 0`` by default.

    Args:
        topk_accuracy: ``[K][k]`` cumulative top-1..top-k accuracies per head (the heads' config).
        max_nodes: the largest tree considered (root included), >= 2.
        draft_ms: drafting cost per step, ms.

    Raises:
        ValueError: ``max_nodes < 2``, or no accuracies.
    """
    if max_nodes < 2:
        raise ValueError("max_nodes must be >= 2")
    if not topk_accuracy or not topk_accuracy[0]:
        raise ValueError("need the heads' top-k accuracies (head_topk_accuracy in their config)")
    out: list[TreeCandidate] = []
    if chains:
        tau, reach = 1.0, 1.0
        for n in range(2, min(max_nodes, MAX_CHAIN, len(topk_accuracy) + 1) + 1):
            reach *= float(topk_accuracy[n - 2][0])
            tau += reach
            out.append((TreeShape(n - 1, n - 1, n, 1), tau, draft_ms))
        return out
    scored = greedy_tree_scores(topk_accuracy, max_nodes)
    scores = [score for _, score in scored]
    for n in range(2, len(scores) + 2):
        paths = [path for path, _ in scored[: n - 1]]
        shape = TreeShape(max(map(len, paths)), n - 1, n, 1 + max(max(p) for p in paths))
        out.append((shape, 1.0 + sum(scores[: n - 1]), draft_ms))
    return out


def block_nodes(length: int, top_k: int, branch_depth: int) -> int:
    """Nodes of a block tree: the root, a chain of ``length`` drafts, ``top_k - 1`` leaves at ``branch_depth``
    depths."""
    return 1 + length + branch_depth * (top_k - 1)


def block_trees(
    chain: Sequence[float],
    draft_ms: float = 0.0,
    siblings: Sequence[Sequence[float]] | None = None,
    length: int | None = None,
    top_k: int | None = None,
) -> list[TreeCandidate]:
    """A block drafter's candidate trees: the chain length L in ``1..len(chain)`` and, where ``siblings`` is given,
    the width k and branched depths b, with ``tau = 1 + sum_{d <= L} chain[d - 1] + sum_{d <= b} siblings[k - 2][d
    - 1]`` and ``nodes = 1 + L + b (k - 1)``, in (L, k, b) order.

    ``chain[d - 1]`` is the held-out share of blocks whose first d drafts the target accepts; ``siblings[k - 2][d -
    1]`` the share whose d-th draft is refused but whose target token is among the slot's next k - 1 candidates (a
    leaf: it adds one token and ends the path). One block forward drafts every tree, so ``draft_ms`` is the same
    for all. ``length`` / ``top_k``: consider that chain length / width only.

    Raises:
        ValueError: an empty ``chain``, a ``siblings`` row shorter than ``chain``, ``length`` outside
            ``1..len(chain)``, or a ``top_k`` > 1 without its ``siblings`` row.
    """
    if not chain:
        raise ValueError("need the head's held-out chain acceptance (heldout_chain in its config)")
    siblings = [list(row) for row in siblings or ()]
    if any(len(row) < len(chain) for row in siblings):
        raise ValueError(f"every siblings row needs {len(chain)} depths (one per chain depth)")
    if length is not None and not 1 <= length <= len(chain):
        raise ValueError(f"length {length} is outside 1..{len(chain)} (the held-out chain's depths)")
    if top_k is not None and not 1 <= top_k <= len(siblings) + 1:
        raise ValueError(
            f"top_k {top_k} needs held-out sibling acceptance for {top_k} candidates; have 1..{len(siblings) + 1}"
        )
    out: list[TreeCandidate] = []
    for n in [length] if length is not None else range(1, len(chain) + 1):
        base = 1.0 + float(sum(chain[:n]))
        trees = [(1, 0, base)]
        for k, row in enumerate(siblings, start=2):
            trees += [(k, b, base + float(sum(row[:b]))) for b in range(1, n + 1)]
        for k, b, tau in trees:
            if top_k is not None and k != top_k:
                continue
            nodes = block_nodes(n, k, b)
            out.append((TreeShape(n, nodes - 1, nodes, k, b), tau, draft_ms))
    return out


def tree_table_text(size: TreeSize, columns: Sequence[int] = DEFAULT_NODE_COUNTS) -> str:
    """Plain-text tables of expected tau and speedup by depth (rows) and draft tokens (columns: the sizes of
    ``columns`` that were considered, and the chosen one); where several trees share a cell (block trees of other
    widths), the fastest."""
    cells: dict[tuple[int, int], TreeOption] = {}
    for o in size.table:
        key = (o.shape.depth, o.shape.tokens)
        if key not in cells or o.tokens_per_s > cells[key].tokens_per_s:
            cells[key] = o
    chosen = (size.shape.depth, size.shape.tokens)
    depths = sorted({d for d, _ in cells})
    cols = sorted({n for n in columns if any((d, n) in cells for d in depths)} | {size.shape.tokens})
    lines = []
    for title, attr, fmt in (("expected tau", "tau", "{:.2f}"), ("expected speedup", "speedup", "{:.2f}x")):
        lines.append(f"{title} (rows: depth, columns: draft tokens; * = chosen)")
        lines.append("depth " + "".join(f"{n:>8}" for n in cols))
        for d in depths:
            row = []
            for n in cols:
                o = cells.get((d, n))
                text = "-" if o is None else fmt.format(getattr(o, attr))
                row.append(f"{text + ('*' if (d, n) == chosen else ''):>8}")
            lines.append(f"{d:>5} " + "".join(row))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
