"""How ``selfspec.load`` builds a drafter and a verifier for a target: the drafting method chosen, trees and EAGLE
budgets sized to this machine (through the tuning layer), the verification kernels chosen."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.decode.drafters import (
    BlockDrafter,
    Drafter,
    DraftModelDrafter,
    EagleDrafter,
    HybridDrafter,
    MedusaDrafter,
    PromptLookupDrafter,
)
from selfspec.decode.drafters.eagle import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS
from selfspec.decode.drafters.suffix_index import SuffixIndex
from selfspec.decode.tree import greedy_tree_from_accuracy, static_tree
from selfspec.decode.tuning import budget as tree_budget
from selfspec.decode.tuning import costs, draft_costs
from selfspec.decode.tuning.budget import TreeBudget
from selfspec.decode.tuning.calibration import AcceptanceProfile, load_acceptance_profile
from selfspec.decode.verifier import Verifier
from selfspec.heads.dflash import BLOCK_HEAD_TYPES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A small tree for heads without measured accuracy: 10 nodes suit a CPU (verify cost grows with nodes).
DEFAULT_MEDUSA_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]
DEFAULT_TREE_NODES = 10
TUNE_MODES = ("auto", "off")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeBudgetChoice:
    """How an EAGLE drafter's tree budget (``depth``, ``total_tokens``) was set by :func:`plan_drafter`.

    Attributes:
        source: ``"given"`` (both integers passed), ``"default"`` (the defaults of
            :mod:`selfspec.decode.drafters.eagle`: no usable acceptance profile, or ``tune="off"``) or ``"auto"``
            (sized to this machine by :func:`selfspec.decode.tuning.budget.tune_tree_budget`).
        budget: the chosen :class:`~selfspec.decode.tuning.budget.TreeBudget` with its expected gain (``"auto"``
            only).
        acceptance_profile: the head's profile the budget came from (``"auto"`` only); the batch tree rule sizes
            trees by batch size from it.
    """

    source: str
    budget: TreeBudget | None = None
    acceptance_profile: AcceptanceProfile | None = None


@dataclass(frozen=True)
class DrafterPlan:
    """A drafter and, for an EAGLE head (alone or in a hybrid), how its tree budget was chosen (else None)."""

    drafter: Drafter
    tree_budget: TreeBudgetChoice | None = None


def make_verifier(target: PreTrainedModel, drafter, tune: str = "auto") -> Verifier:
    """The :class:`~selfspec.decode.verifier.Verifier` that decodes ``drafter``'s trees on ``target``.

    With ``tune="auto"``, a head drafter (Medusa, EAGLE) on a CPU gets the kernel plan of the target's
    cost profile (:func:`selfspec.decode.tuning.costs.get_cost_profile`: measured once on first use, announced,
    then cached), which may pack a second copy of the linear weights (logged with its size). Otherwise,
    and with ``tune="off"``, the verifier uses plain kernels. The target is never modified.

    Raises:
        ValueError: ``tune`` is not ``"auto"`` or ``"off"``.
    """
    if tune not in TUNE_MODES:
        raise ValueError(f"tune must be one of {TUNE_MODES}, got {tune!r}")
    on_cpu = next(target.parameters()).device.type == "cpu"
    if tune == "off" or not on_cpu or not drafter.info().head:
        return Verifier(target)
    verifier = costs.tuned_verifier(target, costs.get_cost_profile(target))
    if verifier.packed_bytes:
        logger.info(
            "tree verification uses oneDNN on packed weights: +%.0f MiB of memory (tune='off' avoids it)",
            verifier.packed_bytes / 2**20,
        )
    return verifier


def make_drafter(target: PreTrainedModel, heads: str | Path | torch.nn.Module | None = None, **options: Any) -> Drafter:
    """The drafter for a target from exactly one of ``heads``, ``draft_model`` or ``prompt_lookup``:
    :func:`plan_drafter`'s drafter (see there for every option and the errors raised)."""
    return plan_drafter(target, heads, **options).drafter


def plan_drafter(
    target: PreTrainedModel,
    heads: str | Path | torch.nn.Module | None = None,
    *,
    tree: Sequence[Sequence[int]] | None = None,
    tree_nodes: int | None = None,
    draft_model=None,
    draft_tokens: int = 4,
    draft_shared_vocab: int | None = None,
    prompt_lookup: bool = False,
    hybrid: bool = False,
    suffix_index: str | Path | SuffixIndex | None = None,
    tokenizer: Any = None,
    tune: str = "auto",
    **eagle_options: Any,
) -> DrafterPlan:
    """Build the drafter for a target from exactly one of ``heads``, ``draft_model`` or ``prompt_lookup``, with
    how an EAGLE head's tree budget was chosen (:class:`DrafterPlan`).

    ``hybrid=True`` (with ``heads``) merges the head's tree with prompt-lookup continuations into one tree,
    each step's split sized from the target's verification cost profile here and each source's measured
    acceptance (:class:`~selfspec.decode.drafters.hybrid.HybridDrafter`); with ``tune="off"`` nothing is measured
    and the split uses a nominal cost (:data:`NOMINAL_NODE_COST`). ``suffix_index`` (with ``hybrid=True``)
    adds continuations from training answers as a second n-gram source: a
    :class:`~selfspec.decode.drafters.suffix_index.SuffixIndex`, a file saved by its ``save`` (``.safetensors``), or a
    JSONL file of ``{"id", "messages"}`` conversations whose assistant turns are indexed with ``tokenizer``.

    Medusa heads use ``tree`` (index paths) if given, else Medusa's greedy tree from their held-out
    accuracies, of ``tree_nodes`` nodes or, when None and ``tune="auto"``, of the size that maximises
    expected tokens per second on this machine (see :func:`_medusa_drafter`).

    EAGLE heads take ``depth``, ``top_k`` and ``total_tokens`` as ``eagle_options``. ``depth`` and
    ``total_tokens`` default to ``"auto"``: when ``tune="auto"`` and the head directory holds an acceptance profile
    (``<head_dir>/acceptance_profile.json``, written by training and by ``selfspec tune-tree``; a head passed as a
    module has none) they are chosen for this machine by :func:`~.tuning.budget.tune_tree_budget`
    (verification and drafting costs measured once and cached); otherwise they are the defaults of
    :mod:`selfspec.decode.drafters.eagle`. Integers always win; giving one of the two fixes it and chooses the other.

    ``tune="off"``: nothing is measured; default sizes.

    Heads (a directory or a module) are moved and cast to the target's device and dtype, whatever they were
    saved or built in. A draft model given by name is loaded in the target's dtype; a draft model module must
    already be on the target's device (else the first ``generate`` refuses it) and have the target's
    vocabulary size (else it is refused here), unless both use one tokenizer and only their embeddings are
    padded to other sizes: then ``draft_shared_vocab=len(tokenizer)`` maps ids exactly
    (see :class:`~selfspec.decode.drafters.DraftModelDrafter`).

    Raises:
        ValueError: none or several drafting methods given, a draft model whose vocabulary is not the
            target's, ``suffix_index`` without ``hybrid=True`` or (for conversations) without a tokenizer, a
            suffix index file that does not load, an EAGLE option that is neither an integer
            nor ``"auto"``, or ``tune`` not ``"auto"`` / ``"off"``.
        HeadFormatError: the heads do not load (see :func:`selfspec.heads.load_heads`), or their acceptance
            profile is malformed.
    """
    if tune not in TUNE_MODES:
        raise ValueError(f"tune must be one of {TUNE_MODES}, got {tune!r}")
    chosen = [heads is not None, draft_model is not None, bool(prompt_lookup)]
    if sum(chosen) != 1:
        raise ValueError("pass exactly one of heads=..., draft_model=..., prompt_lookup=True")
    if hybrid and heads is None:
        raise ValueError("hybrid=True merges a head's tree with prompt lookup: pass heads=... too")
    if suffix_index is not None and not hybrid:
        raise ValueError("suffix_index=... is a source of the hybrid drafter: pass hybrid=True (and heads=...) too")
    if prompt_lookup:
        return DrafterPlan(PromptLookupDrafter(num_tokens=draft_tokens * 2))
    if draft_model is not None:
        if isinstance(draft_model, (str, Path)):
            from selfspec.target import load_target  # selfspec.target imports transformers' Auto classes

            draft_model, _ = load_target(draft_model, dtype=next(target.parameters()).dtype)
        # a vocabulary other than the target's is refused here, at load (DraftModelDrafter.check_vocab)
        drafter = DraftModelDrafter(
            draft_model,
            num_tokens=draft_tokens,
            target_vocab_size=target.get_output_embeddings().weight.shape[0],
            shared_vocab_size=draft_shared_vocab,
        )
        return DrafterPlan(drafter)
    from selfspec.heads import load_heads  # the head package imports the training-side configs
    from selfspec.heads.hub import resolve_head_dir

    head_dir = None
    if isinstance(heads, (str, Path)):
        head_dir = resolve_head_dir(heads)  # a Hub repo id is fetched into the Hub cache first
        heads = load_heads(head_dir, target=target)
    dtype = next(target.parameters()).dtype
    heads = heads.to(device=next(target.parameters()).device, dtype=dtype).eval()
    if heads.config.head_type == "medusa":
        heads.attach_target(target.get_output_embeddings().weight)
        drafter, choice = _medusa_drafter(target, heads, tree, tree_nodes, tune), None
    elif heads.config.head_type in BLOCK_HEAD_TYPES:
        drafter, choice = _block_drafter(target, heads, tune, **eagle_options), None
    else:
        drafter, choice = _eagle_drafter(target, heads, head_dir, tune, **eagle_options)
    if not hybrid:
        return DrafterPlan(drafter, choice)
    index = SuffixIndex.open(suffix_index, tokenizer) if suffix_index is not None else None
    cost = costs.get_cost_profile(target) if tune == "auto" else _nominal_cost(target)
    hybrid_drafter = HybridDrafter(
        drafter, cost.verify_cost_ms, PromptLookupDrafter(num_tokens=draft_tokens * 2), index
    )
    return DrafterPlan(hybrid_drafter, choice)


# With tune="off" a hybrid drafter sizes its split from this nominal cost: one extra tree node costs 4% of a
# plain step (about what 16 nodes cost on the 2-core AVX2 CPU: docs/ARCHITECTURE.md, "Facts this design rests on").
NOMINAL_NODE_COST = 0.04


def _nominal_cost(target: PreTrainedModel) -> costs.CostProfile:
    """A cost profile for when nothing may be measured: 1 + NOMINAL_NODE_COST * (N - 1) plain steps."""
    sizes = (1, 2, 4, 8, 16, 32, 64)
    return costs.CostProfile(
        **costs.cost_key(target),
        context_length=costs.DEFAULT_CONTEXT_LENGTH,
        node_counts=sizes,
        verify_ms=tuple(1.0 + NOMINAL_NODE_COST * (n - 1) for n in sizes),
    )


def _medusa_drafter(
    target: PreTrainedModel, heads, tree: Sequence[Sequence[int]] | None, tree_nodes: int | None, tune: str = "auto"
) -> MedusaDrafter:
    """A :class:`MedusaDrafter`. Its tree: ``tree`` if given; else Medusa's greedy tree from the heads'
    held-out accuracies with ``tree_nodes`` nodes, or, when ``tree_nodes`` is None and ``tune="auto"``,
    with the size that maximises expected tokens per second on this machine
    (:func:`selfspec.decode.tuning.budget.choose_medusa_tree_nodes`, from the cached verification cost profile);
    heads without accuracies (or ``tune="off"``) get ``DEFAULT_TREE_NODES`` nodes."""
    acc = heads.config.head_topk_accuracy
    if tree is None:
        if tree_nodes is None and acc and tune == "auto":
            size = tree_budget.choose_medusa_tree_nodes(costs.get_cost_profile(target), acc)
            n = size.num_nodes
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
    return MedusaDrafter(heads, static_tree(tree))


def _block_drafter(
    target: PreTrainedModel,
    head,
    tune: str = "auto",
    block_length: int | str = "auto",
    block_top_k: int | str = "auto",
    confidence_min: float = 0.0,
) -> BlockDrafter:
    """A :class:`~selfspec.decode.drafters.block.BlockDrafter` for a DFlash / DSpark head. ``block_length`` (chain
    drafts per step) and ``block_top_k`` (candidates per slot; > 1 adds each slot's next candidates as leaves)
    ``"auto"``: with ``tune="auto"`` and the head's held-out chain acceptance, the tree that maximises expected
    tokens per second on this machine (:func:`~.tuning.budget.choose_block_length`, from the cached verification cost
    profile, the cached cost of one block forward and, for the width, the head's held-out sibling acceptance); else
    the head's whole block as a chain.
    An integer fixes that field and sizes the other. ``confidence_min`` cuts a DSpark block at its confidence head.

    Raises:
        ValueError: ``block_length`` or ``block_top_k`` neither an integer nor ``"auto"``, or out of the head's range.
    """
    for name, value in (("block_length", block_length), ("block_top_k", block_top_k)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an integer or 'auto', got {value!r}")
    cfg = head.config
    length = None if block_length == "auto" else block_length
    top_k = None if block_top_k == "auto" else block_top_k
    branch_depth = None
    chain = cfg.heldout_chain
    if tune == "auto" and chain and (length is None or top_k is None):
        rows = cfg.heldout_siblings or ()
        width = top_k if top_k is None or top_k <= len(rows) + 1 else 1  # a width not profiled: chain sized alone
        whole = cfg.max_drafts  # one forward over the whole block whatever the tree: one cost for every shape
        draft_ms = draft_costs.get_draft_cost(BlockDrafter(head, target), target, [whole])[whole]
        size = tree_budget.choose_block_length(
            costs.get_cost_profile(target), chain, draft_ms, siblings=rows, length=length, top_k=width
        )
        length = size.length
        top_k, branch_depth = (size.top_k, size.branch_depth) if top_k in (None, size.top_k) else (top_k, None)
        logger.info(
            "block tree sized to this machine: %d chain drafts, %d candidates on the first %d (%d nodes; block"
            " forward %.1f ms; expected tau %.2f, %.2fx plain decoding)",
            length, top_k, branch_depth, size.nodes, draft_ms, size.expected_tau, size.expected_speedup,
        )  # fmt: skip
    return BlockDrafter(
        head, target, length=length, top_k=top_k or 1, branch_depth=branch_depth, confidence_min=confidence_min
    )


def _eagle_drafter(
    target: PreTrainedModel,
    head,
    head_dir: Path | None,
    tune: str = "auto",
    depth: int | str = "auto",
    top_k: int | None = None,
    total_tokens: int | str = "auto",
) -> tuple[EagleDrafter, TreeBudgetChoice]:
    """An :class:`~selfspec.decode.drafters.eagle.EagleDrafter` whose ``"auto"`` depth / total_tokens are sized to the
    machine from the head's acceptance profile when ``tune="auto"`` (see :func:`make_drafter`)."""
    for name, value in (("depth", depth), ("total_tokens", total_tokens)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"EAGLE {name} must be an integer or 'auto', got {value!r}")
    k = DEFAULT_TOP_K if top_k is None else top_k
    if depth != "auto" and total_tokens != "auto":
        return EagleDrafter(head, target, depth, k, total_tokens), TreeBudgetChoice("given")
    fixed_depth = None if depth == "auto" else depth
    fixed_total = None if total_tokens == "auto" else total_tokens
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
    drafter = EagleDrafter(head, target, budget.depth, budget.top_k, budget.total_tokens)
    logger.info(
        "EAGLE tree budget sized to this machine: depth %d, total_tokens %d, top_k %d (expected tau %.2f, "
        "%.1f ms a step, %.2fx plain decoding)",
        budget.depth,
        budget.total_tokens,
        budget.top_k,
        budget.expected_tau,
        budget.expected_cycle_ms,
        budget.expected_speedup,
    )
    return drafter, TreeBudgetChoice("auto", budget, profile)
