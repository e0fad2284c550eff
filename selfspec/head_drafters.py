"""The drafter factories of the head families: how ``selfspec.load`` turns heads of each built-in family into a
drafter, with the tree sized to this machine through the tuning layer.

Each factory is a family's ``make_drafter`` in :mod:`selfspec.families`, called by
:func:`selfspec.drafting.plan_drafter` as ``make(setup, **options)``: a :class:`DraftSetup` (the target, the head
already on its device and dtype, where it was loaded from, the tuning mode, a tree asked for) and the family's own
options; it returns the drafter and, for an EAGLE head, how its tree budget was chosen (:class:`TreeBudgetChoice`),
else None.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from selfspec.decode.drafters import BlockDrafter, EagleDrafter, MedusaDrafter
from selfspec.decode.drafters.eagle import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS
from selfspec.decode.masks import attention_layout
from selfspec.decode.tree import greedy_tree_from_accuracy, static_tree
from selfspec.decode.tuning import budget as tree_budget
from selfspec.decode.tuning import costs, draft_costs
from selfspec.decode.tuning.budget import TreeSize
from selfspec.decode.tuning.calibration import AcceptanceProfile, load_acceptance_profile

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "DEFAULT_MEDUSA_PATHS",
    "DEFAULT_TREE_NODES",
    "DraftSetup",
    "TreeBudgetChoice",
    "block_drafter",
    "eagle_drafter",
    "medusa_drafter",
]

# A small tree for heads without measured accuracy: 10 nodes suit a CPU (verify cost grows with nodes).
DEFAULT_MEDUSA_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]
DEFAULT_TREE_NODES = 10

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftSetup:
    """What every family's drafter factory is given.

    Attributes:
        target: the frozen target.
        head: the family's head module, on the target's device and dtype.
        head_dir: the directory it was loaded from (its acceptance profile lives there), or None for a module.
        tune: ``"auto"`` (size the tree to this machine) or ``"off"``.
        tree: a static tree asked for (index paths; Medusa), or None.
        tree_nodes: a static tree's size asked for (Medusa), or None.
    """

    target: PreTrainedModel
    head: Any
    head_dir: Path | None = None
    tune: str = "auto"
    tree: Sequence[Sequence[int]] | None = None
    tree_nodes: int | None = None


def fixed_or_auto(name: str, value: int | str) -> int | None:
    """An option that is an integer or ``"auto"``: the integer, or None for ``"auto"``.

    Raises:
        ValueError: anything else (a bool too), with ``name`` in the message.
    """
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be an integer or 'auto', got {value!r}")
    return None if value == "auto" else value


@dataclass(frozen=True)
class TreeBudgetChoice:
    """How an EAGLE drafter's tree budget (``depth``, ``total_tokens``) was set by :func:`plan_drafter`.

    Attributes:
        source: ``"given"`` (both integers passed), ``"default"`` (the defaults of
            :mod:`selfspec.decode.drafters.eagle`: no usable acceptance profile, or ``tune="off"``) or ``"auto"``
            (sized to this machine by :func:`selfspec.decode.tuning.budget.tune_tree_budget`).
        budget: the chosen :class:`~selfspec.decode.tuning.budget.TreeSize` with its expected gain (``"auto"``
            only).
        acceptance_profile: the head's profile the budget came from (``"auto"`` only); the batch tree rule sizes
            trees by batch size from it.
    """

    source: str
    budget: TreeSize | None = None
    acceptance_profile: AcceptanceProfile | None = None


def medusa_drafter(setup: DraftSetup, **options: Any) -> tuple[MedusaDrafter, None]:
    """A :class:`MedusaDrafter`. Its tree: ``setup.tree`` if given; else Medusa's greedy tree from the heads'
    held-out accuracies with ``tree_nodes`` nodes, or, when ``tree_nodes`` is None and ``tune="auto"``,
    with the size that maximises expected tokens per second on this machine
    (:func:`selfspec.decode.tuning.budget.choose_tree` over :func:`~selfspec.decode.tuning.budget.medusa_trees`, from
    the cached verification cost profile);
    heads without accuracies (or ``tune="off"``) get ``DEFAULT_TREE_NODES`` nodes. The heads get ``target``'s lm_head
    attached. ``head_dir`` and ``options`` (EAGLE's and the block drafter's settings) mean nothing to a static tree."""
    target, heads, tree, tree_nodes = setup.target, setup.head, setup.tree, setup.tree_nodes
    heads.attach_target(target.get_output_embeddings().weight)
    acc = heads.config.head_topk_accuracy
    chains = attention_layout(target.config).chains_only  # a state target verifies chains only: sized as chains
    if tree is None:
        if tree_nodes is None and acc and setup.tune == "auto":
            trees = tree_budget.medusa_trees(acc, chains=chains)
            size = tree_budget.choose_tree(costs.get_cost_profile(target), trees)
            n = size.shape.nodes
            logger.info(
                "Medusa tree sized to this machine: %d nodes (expected tau %.2f, %.1f ms a step, %.2fx plain decoding)",
                n,
                size.expected_tau,
                size.expected_cycle_ms,
                size.expected_speedup,
            )
        else:
            n = tree_nodes or DEFAULT_TREE_NODES
        usable = [p for p in DEFAULT_MEDUSA_PATHS if len(p) <= heads.config.num_heads]
        tree = greedy_tree_from_accuracy(acc, n) if acc else usable[: n - 1]
        if chains:  # the top-1 chain of as many heads as the tree has drafts (at most every head)
            tree = [(0,) * d for d in range(1, min(n, heads.config.num_heads + 1))]
    return MedusaDrafter(heads, static_tree(tree)), None


def block_drafter(
    setup: DraftSetup,
    block_length: int | str = "auto",
    block_top_k: int | str = "auto",
    confidence_min: float = 0.0,
) -> tuple[BlockDrafter, None]:
    """A :class:`~selfspec.decode.drafters.block.BlockDrafter` for a DFlash / DSpark head (``setup.head_dir``, ``tree``
    and ``tree_nodes`` unused). ``block_length`` (chain
    drafts per step) and ``block_top_k`` (candidates per slot; > 1 adds each slot's next candidates as leaves)
    ``"auto"``: with ``tune="auto"`` and the head's held-out chain acceptance, the tree that maximises expected
    tokens per second on this machine (:func:`~.tuning.budget.choose_tree` over :func:`~.tuning.budget.block_trees`,
    from the cached verification cost
    profile, the cached cost of one block forward and, for the width, the head's held-out sibling acceptance); else
    the head's whole block as a chain.
    An integer fixes that field and sizes the other. ``confidence_min`` cuts a DSpark block at its confidence head.

    Raises:
        ValueError: ``block_length`` or ``block_top_k`` neither an integer nor ``"auto"``, or out of the head's range.
    """
    target, head = setup.target, setup.head
    length, top_k = fixed_or_auto("block_length", block_length), fixed_or_auto("block_top_k", block_top_k)
    cfg = head.config
    branch_depth = None
    chain = cfg.heldout_chain
    if setup.tune == "auto" and chain and (length is None or top_k is None):
        rows = cfg.heldout_siblings or ()
        width = top_k if top_k is None or top_k <= len(rows) + 1 else 1  # a width not profiled: chain sized alone
        if attention_layout(target.config).chains_only:  # a state target verifies the block's chain alone
            width = 1
        whole = cfg.max_drafts  # one forward over the whole block whatever the tree: one cost for every shape
        draft_ms = draft_costs.get_draft_cost(BlockDrafter(head, target), target, [whole])[whole]
        trees = tree_budget.block_trees(chain, draft_ms, siblings=rows, length=length, top_k=width)
        size = tree_budget.choose_tree(costs.get_cost_profile(target), trees)
        shape = size.shape
        length = shape.depth
        top_k, branch_depth = (shape.top_k, shape.branch_depth) if top_k in (None, shape.top_k) else (top_k, None)
        logger.info(
            "block tree sized to this machine: %d chain drafts, %d candidates on the first %d (%d nodes; block"
            " forward %.1f ms; expected tau %.2f, %.2fx plain decoding)",
            length, top_k, branch_depth, shape.nodes, draft_ms, size.expected_tau, size.expected_speedup,
        )  # fmt: skip
    drafter = BlockDrafter(
        head, target, length=length, top_k=top_k or 1, branch_depth=branch_depth, confidence_min=confidence_min
    )
    return drafter, None


def eagle_drafter(
    setup: DraftSetup,
    depth: int | str = "auto",
    top_k: int | None = None,
    total_tokens: int | str = "auto",
) -> tuple[EagleDrafter, TreeBudgetChoice]:
    """An :class:`~selfspec.decode.drafters.eagle.EagleDrafter` whose ``"auto"`` depth / total_tokens are sized to the
    machine from the head's acceptance profile (``<head_dir>/acceptance_profile.json``) when ``tune="auto"`` (see
    :func:`selfspec.drafting.plan_drafter`; ``tree`` and ``tree_nodes`` unused)."""
    target, head, head_dir, tune = setup.target, setup.head, setup.head_dir, setup.tune
    fixed_depth, fixed_total = fixed_or_auto("EAGLE depth", depth), fixed_or_auto("EAGLE total_tokens", total_tokens)
    k = DEFAULT_TOP_K if top_k is None else top_k
    if fixed_depth is not None and fixed_total is not None:
        return EagleDrafter(head, target, fixed_depth, k, fixed_total), TreeBudgetChoice("given")
    profile = None
    if tune == "auto":
        # a head passed as a module has no directory, so no profile: it decodes with the default tree
        profile = load_acceptance_profile(head_dir, target=target) if head_dir is not None else None
    budget, why = None, "it has no acceptance profile (run `selfspec tune-tree` to make one)"
    if tune == "off":
        why = "was loaded with tune='off'"
    elif profile is not None and top_k is not None and top_k != profile.top_k:
        why = f"its acceptance profile was measured with top_k={profile.top_k}, not {top_k}"
    elif profile is not None:
        probe = EagleDrafter(head, target, 1, profile.top_k, 1)
        try:
            budget = tree_budget.tune_tree_budget(target, probe, profile, depth=fixed_depth, total_tokens=fixed_total)
        except ValueError as err:
            why = f"its acceptance profile does not cover the budget asked for ({err})"
    if budget is None:
        drafter = EagleDrafter(head, target, fixed_depth or DEFAULT_DEPTH, k, fixed_total or DEFAULT_TOTAL_TOKENS)
        log = logger.info if profile is None else logger.warning  # a profile that cannot serve is worth a warning
        log(
            "EAGLE tree budget: depth %d, total_tokens %d (defaults): the head %s",
            drafter.depth,
            drafter.total_tokens,
            why,
        )
        return drafter, TreeBudgetChoice("default")
    shape = budget.shape
    drafter = EagleDrafter(head, target, shape.depth, shape.top_k, shape.tokens)
    logger.info(
        "EAGLE tree budget sized to this machine: depth %d, total_tokens %d, top_k %d (expected tau %.2f, "
        "%.1f ms a step, %.2fx plain decoding)",
        shape.depth,
        shape.tokens,
        shape.top_k,
        budget.expected_tau,
        budget.expected_cycle_ms,
        budget.expected_speedup,
    )
    return drafter, TreeBudgetChoice("auto", budget, profile)
