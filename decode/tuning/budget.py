"""The tree budget: which EAGLE-2 ``depth`` / ``total_tokens`` (or Medusa tree size) decodes fastest here.

A pure choice from measured profiles (Sequoia-style hardware-aware sizing: Chen et al. 2024, "Sequoia:
Scalable, Robust, and Hardware-aware Speculative Decoding", arXiv:2402.12374): maximise

    expected tokens per second = tau(d, N) / (draft_ms(d) + verify_ms(N + 1) + overhead_ms)

over EAGLE-2's two knobs (Li et al. 2024, arXiv:2406.16858): the draft depth d and the number N of draft
tokens kept after reranking (the verified tree has N + 1 nodes with the root). ``tau`` comes from the
head's :class:`~selfspec.decode.tuning.calibration.AcceptanceProfile`, the costs from
:mod:`selfspec.decode.tuning.costs` (:func:`tune_tree_budget` fetches them, measuring on first use).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from selfspec.decode.tree import greedy_tree_scores
from selfspec.decode.tuning.calibration import AcceptanceProfile, num_candidates
from selfspec.decode.tuning.costs import DEFAULT_NODE_COUNTS, CostProfile, get_cost_profile
from selfspec.decode.tuning.draft_costs import get_draft_cost

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from selfspec.decode.drafters.eagle import EagleDrafter


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
        return {
            "depth": self.depth,
            "top_k": self.top_k,
            "total_tokens": self.total_tokens,
            "expected_tau": self.expected_tau,
            "expected_cycle_ms": self.expected_cycle_ms,
            "expected_speedup": self.expected_speedup,
            "plain_step_ms": self.plain_step_ms,
        }


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
            options.append(
                BudgetOption(d, n, tau, float(draft_ms_by_depth[d]), verify, cycle, tps, tau * plain / cycle)
            )
    if not options:
        raise ValueError(
            f"total_tokens {total_tokens} is outside the acceptance profile "
            f"(total_tokens <= {acceptance.total_tokens_max}) at every depth considered"
        )
    best = max(options, key=lambda o: (o.tokens_per_s, -o.cycle_ms))
    return TreeBudget(
        best.depth, best.total_tokens, acceptance.top_k, best.tau, best.cycle_ms, best.speedup, plain, tuple(options)
    )


def tune_tree_budget(
    target: PreTrainedModel,
    drafter: EagleDrafter,
    acceptance: AcceptanceProfile,
    depth: int | None = None,
    total_tokens: int | None = None,
    refresh: bool = False,
    overhead_ms: float = 0.0,
    cost: CostProfile | None = None,
) -> TreeBudget:
    """Choose the budget for ``drafter``'s head on ``target`` here: cached (or measured) verification and
    drafting costs, then :func:`choose_tree_budget`. Changes neither the drafter nor the target.

    Args:
        cost: the verification cost profile to use; None = :func:`~selfspec.decode.tuning.costs.get_cost_profile`.
        Others: see :func:`choose_tree_budget`; ``refresh`` measures the costs again.

    Raises:
        ValueError: ``acceptance`` was profiled with another ``top_k`` than the drafter's, or see
            :func:`choose_tree_budget`.
    """
    if acceptance.top_k != drafter.top_k:
        raise ValueError(
            f"the acceptance profile was measured with top_k={acceptance.top_k}, the drafter uses top_k={drafter.top_k}"
        )
    if cost is None:
        cost = get_cost_profile(target, refresh=refresh)
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


@dataclass(frozen=True)
class BlockLength:
    """The draft tree chosen for a block drafter (:func:`choose_block_length`): a chain of ``length`` drafts and,
    with ``top_k`` > 1, the next ``top_k - 1`` candidates of each of its first ``branch_depth`` slots as leaves.

    Attributes:
        length: chain drafts per step L.
        top_k: candidates per slot (1: the chain alone).
        branch_depth: b, the chain depths with sibling leaves (0 when ``top_k`` is 1).
        expected_tau: ``1 + sum_{d <= L} chain[d - 1] + sum_{d <= b} siblings[top_k - 2][d - 1]``.
        expected_speedup: ``expected_tau * plain_step_ms / (draft_ms + verify_ms(nodes))``.
        table: ``(L, top_k, b, expected_tau, expected_speedup)`` for every tree considered.
    """

    length: int
    top_k: int
    branch_depth: int
    expected_tau: float
    expected_speedup: float
    table: tuple[tuple[int, int, int, float, float], ...]

    @property
    def nodes(self) -> int:
        """Verified tree nodes: ``1 + L + b (top_k - 1)``."""
        return tree_nodes(self.length, self.top_k, self.branch_depth)


def tree_nodes(length: int, top_k: int, branch_depth: int) -> int:
    """Nodes of a block tree: the root, a chain of ``length`` drafts, ``top_k - 1`` leaves at ``branch_depth``
    depths."""
    return 1 + length + branch_depth * (top_k - 1)


def choose_block_length(
    cost: CostProfile,
    chain: Sequence[float],
    draft_ms: float = 0.0,
    siblings: Sequence[Sequence[float]] | None = None,
    length: int | None = None,
    top_k: int | None = None,
) -> BlockLength:
    """Size a block drafter's tree to the machine: the chain length L in ``1..len(chain)`` and, where ``siblings``
    is given, the width k and branched depths b, maximising ``tau / (draft_ms + verify_ms(nodes))`` with
    ``tau = 1 + sum_{d <= L} chain[d - 1] + sum_{d <= b} siblings[k - 2][d - 1]`` and ``nodes = 1 + L + b (k - 1)``.
    ``chain[d - 1]`` is the held-out share of blocks whose first d drafts the target accepts; ``siblings[k - 2][d -
    1]`` the share whose d-th draft is refused but whose target token is among the slot's next k - 1 candidates (a
    leaf: it adds one token and ends the path). One block forward drafts every tree, so ``draft_ms`` is the same
    for all. Ties go to the smaller tree. ``length`` / ``top_k``: consider that chain length / width only.

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
    plain = cost.plain_step_ms
    table, best = [], None
    for n in [length] if length is not None else range(1, len(chain) + 1):
        base = 1.0 + float(sum(chain[:n]))
        trees = [(1, 0, base)]
        for k, row in enumerate(siblings, start=2):
            trees += [(k, b, base + float(sum(row[:b]))) for b in range(1, n + 1)]
        for k, b, tau in trees:
            if top_k is not None and k != top_k:
                continue
            option = (n, k, b, tau, tau * plain / (draft_ms + cost.verify_cost_ms(tree_nodes(n, k, b))))
            table.append(option)
            if best is None or option[4] > best[4]:
                best = option
    return BlockLength(*best, tuple(table))


def medusa_table_text(size: MedusaTreeSize, columns: Sequence[int] = DEFAULT_NODE_COUNTS) -> str:
    """Plain-text table of a Medusa tree's expected tau and speedup by node count N (root included), at the
    sizes of ``columns`` that were considered and the chosen one."""
    rows = {n: (tau, speedup) for n, tau, speedup in size.table}
    cols = sorted({n for n in columns if n in rows} | {size.num_nodes})
    lines = ["Medusa tree (columns: nodes, root included; * = chosen)", "nodes   " + "".join(f"{n:>8}" for n in cols)]
    for title, col, fmt in (("tau", 0, "{:.2f}"), ("speedup", 1, "{:.2f}x")):
        cells = [fmt.format(rows[n][col]) + ("*" if n == size.num_nodes else "") for n in cols]
        lines.append(f"{title:<8}" + "".join(f"{c:>8}" for c in cells))
    return "\n".join(lines) + "\n"


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
