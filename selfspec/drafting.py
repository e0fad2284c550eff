"""How ``selfspec.load`` builds a drafter and a verifier for a target: the drafting method chosen, trees and EAGLE
budgets sized to this machine (through the tuning layer), the verification kernels chosen."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.decode.drafters import Drafter, DraftModelDrafter, HybridDrafter, PromptLookupDrafter
from selfspec.decode.drafters.served_history import ServedHistory
from selfspec.decode.drafters.suffix_index import SuffixIndex
from selfspec.decode.tuning import costs
from selfspec.decode.verifier import Verifier
from selfspec.families import family_of
from selfspec.head_drafters import DraftSetup, TreeBudgetChoice

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TUNE_MODES = ("auto", "off")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterPlan:
    """A drafter and, for an EAGLE head (alone or in a hybrid), how its tree budget was chosen (else None); with
    ``history``, the :class:`~selfspec.decode.drafters.served_history.ServedHistory` the hybrid drafts from, which
    the model feeds with every output it serves."""

    drafter: Drafter
    tree_budget: TreeBudgetChoice | None = None
    history: ServedHistory | None = None


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
    history: bool | ServedHistory = False,
    tokenizer: Any = None,
    tune: str = "auto",
    **head_options: Any,
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
    ``history`` (with ``hybrid=True``; True or a :class:`~selfspec.decode.drafters.served_history.ServedHistory`)
    takes that place instead: continuations from the outputs served so far, which the model adds after each
    request (:attr:`DrafterPlan.history`).

    Medusa heads use ``tree`` (index paths) if given, else Medusa's greedy tree from their held-out
    accuracies, of ``tree_nodes`` nodes or, when None and ``tune="auto"``, of the size that maximises
    expected tokens per second on this machine (see :func:`selfspec.head_drafters.medusa_drafter`).

    The head's family (:func:`selfspec.families.family_of`) makes the drafter (its ``make_drafter``) and takes its own
    ``head_options``: EAGLE heads take ``depth``, ``top_k`` and ``total_tokens``, block heads ``block_length``,
    ``block_top_k`` and ``confidence_min`` (:func:`selfspec.head_drafters.block_drafter`). ``depth`` and
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
    for name, given in (("suffix_index", suffix_index is not None), ("history", bool(history))):
        if given and not hybrid:
            raise ValueError(f"{name}=... is a source of the hybrid drafter: pass hybrid=True (and heads=...) too")
    if suffix_index is not None and history:
        raise ValueError("pass one second n-gram source: suffix_index=... (training answers) or history=... (served)")
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
    make = family_of(heads).make_drafter
    drafter, choice = make(DraftSetup(target, heads, head_dir, tune, tree, tree_nodes), **head_options)
    if not hybrid:
        return DrafterPlan(drafter, choice)
    served = (ServedHistory() if history is True else history) or None
    index = SuffixIndex.open(suffix_index, tokenizer) if suffix_index is not None else served
    cost = costs.get_cost_profile(target) if tune == "auto" else _nominal_cost(target)
    hybrid_drafter = HybridDrafter(
        drafter, cost.verify_cost_ms, PromptLookupDrafter(num_tokens=draft_tokens * 2), index
    )
    return DrafterPlan(hybrid_drafter, choice, served)


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
