"""The drafter contract: what the decode loop asks of every way of drafting, declared in one base class.

A drafter proposes a draft tree each step and is told what the target accepted. The loop
(:mod:`selfspec.decode.loop`) calls, per sequence: :meth:`Drafter.begin` once after the prefill, then each
step :meth:`Drafter.propose` and, after verification, :meth:`Drafter.accept` with the verified path. What a
drafter needs from the loop (which target layers' hidden states, which vocabulary, how deep it drafts,
whether it samples its children) is one :class:`DrafterInfo` record from :meth:`Drafter.info`, read once;
the loop never probes a drafter for attributes. Budgets are constructor arguments; a per-step cap (the
tokens still allowed, a batch's tree rule) reaches :meth:`Drafter.propose` as a :class:`DraftLimit` and is
never written into a drafter. The loop cuts every tree to those caps anyway, so a drafter that ignores them is
still exact, only wasteful.

The design follows ``transformers``' candidate generators (a small interface, a new drafter is a new class).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class TreeShape:
    """The size of a draft tree, as the drafters take it.

    Attributes:
        depth: the deepest draft below the root: EAGLE's draft depth d, a block drafter's chain length L, the
            deepest path of a Medusa tree.
        tokens: the draft tokens asked for, the root excluded: EAGLE's ``total_tokens`` N (kept after reranking;
            a depth creates at most so many candidates), else ``nodes - 1``.
        nodes: the nodes verified, the root included.
        top_k: candidates per expansion: EAGLE's ``top_k``, a block slot's width (1: the chain alone), the widest
            rank a Medusa tree takes plus one.
        branch_depth: block trees: the chain depths that carry ``top_k - 1`` sibling leaves (0 otherwise).
    """

    depth: int
    tokens: int
    nodes: int
    top_k: int = 1
    branch_depth: int = 0


@dataclass(frozen=True)
class DraftCostKey:
    """What one draft of a head drafter costs depends on, besides the target: the identity of its measured cost
    (:mod:`selfspec.decode.tuning.draft_costs`, which times :meth:`Drafter.at_depth` drafters and caches the result
    under this key).

    Attributes:
        family: the head's family (``head_type``), the first word of the cache file's name.
        shape: the sizes the cost depends on, as a file-name part (``"k4-v32000-b1"``: top_k, draft vocabulary, ...).
        top_k: candidates per expansion (recorded with the cost).
        per_block: True when one forward drafts the whole block whatever depth is kept (DFlash, DSpark: the cost
            is measured at the block's length, the drafter's context growing by one position a call); False when
            each level costs one more forward (EAGLE: measured on a fixed context by depth).
    """

    family: str
    shape: str
    top_k: int
    per_block: bool = False


@dataclass(frozen=True)
class DrafterInfo:
    """What the loop needs to know about a drafter (read once per call).

    Attributes:
        name: a short name for reports (``"medusa"``, ``"eagle"``, ``"prompt_lookup"``, ...).
        max_depth: the deepest node it drafts below the root (0: it never drafts).
        target_layers: the target decoder layers whose input hidden states it takes (EAGLE-3: three layers,
            concatenated ``[T, len(layers) * D]``); None: the last hidden state after the final norm ``[T, D]``.
        vocab_size: the target vocabulary size its token ids are drawn from, checked against the target's once
            per call (:meth:`Drafter.check_vocab`); None: any (drafts copy tokens of the context).
        sampled: True when, under sampling, it may draw children from a distribution q (``DraftTree.q``); False
            when its children are always chosen deterministically (top-k, n-gram continuations).
        head: True when it drafts with heads on the target's hidden states (its trees are worth the tuned
            verification kernels of :mod:`selfspec.decode.verifier`).
        draft_cost: set by a drafter whose drafting cost the tree chooser weighs (:class:`DraftCostKey`); it then
            builds the drafters that measurement times (:meth:`Drafter.at_depth`). None: a cost not measured.
        tree: the tree it drafts each step when a depth / token budget fixed it at construction (EAGLE-2's
            depth, ``total_tokens`` and ``top_k``; a block drafter's chain, width and branch depth); None: a tree
            found each step (n-gram chains, a hybrid) or a static tree.
    """

    name: str
    max_depth: int
    target_layers: tuple[int, ...] | None = None
    vocab_size: int | None = None
    sampled: bool = False
    head: bool = False
    draft_cost: DraftCostKey | None = None
    tree: TreeShape | None = None


@dataclass(frozen=True)
class DraftLimit:
    """How much of a draft can be used this step (what the loop passes to :meth:`Drafter.propose`).

    Attributes:
        useful_depth: the tokens still allowed minus one (>= 0): a node deeper than this cannot add a token
            to the output. Drafters whose cost grows with every draft token (chains: prompt lookup, a draft
            model) draft no deeper; tree drafters may draft their own tree (the stopper cuts the output).
        depth: a batch tree rule's depth for this step (None: the drafter's own). The loop cuts deeper nodes.
        tokens: a batch tree rule's number of draft tokens for this step, the root excluded (EAGLE-2's
            ``total_tokens``; None: the drafter's own).
    """

    useful_depth: int
    depth: int | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class AcceptedPath:
    """What verification accepted in one step, as the drafter is told it (:meth:`Drafter.accept`).

    Attributes:
        tree: the step's draft tree as verified (after the loop's cuts).
        nodes: the accepted path's node indices in ``tree``, root first (``A`` nodes).
        tokens: LongTensor ``[A]``: the root and the accepted draft tokens.
        hidden: ``[A, F]`` the target's states at those nodes (``F = D``, or ``len(target_layers) * D``).
        next_token: the token the target chose after the path (bonus or correction); it is the next root.
    """

    tree: DraftTree
    nodes: tuple[int, ...]
    tokens: torch.Tensor
    hidden: torch.Tensor
    next_token: int


class Drafter(ABC):
    """Base class of every drafter (see the module docstring for the call order)."""

    @abstractmethod
    def info(self) -> DrafterInfo:
        """The drafter's :class:`DrafterInfo`."""

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Start a sequence after the prefill. ``prompt_ids`` ``[T]``; ``hidden`` ``[T, F]`` the target's states
        at the prompt (see :attr:`DrafterInfo.target_layers`). Default: nothing."""

    @abstractmethod
    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """Draft a tree whose root is ``context[-1]``.

        Args:
            context: LongTensor ``[T]``, prompt and output so far (the root last).
            sampling: the call's sampling settings (a drafter that samples draws with ``generator``).
            generator: every random draw of the drafter.
            limit: how much of the draft can be used this step (:class:`DraftLimit`).

        Returns:
            :class:`~selfspec.decode.tree.DraftTree` on ``context``'s device.
        """

    def accept(self, accepted: AcceptedPath) -> None:  # noqa: B027 (optional hook)
        """Told what this step's verification accepted (:class:`AcceptedPath`). Default: nothing."""

    def at_depth(self, depth: int, target: PreTrainedModel) -> Drafter:
        """A fresh drafter of the same head and settings that drafts ``depth`` levels (a block drafter: a chain of
        ``depth``), attached to ``target``: what the draft-cost measurement times at each depth.

        Raises:
            ValueError: a drafter without :attr:`DrafterInfo.draft_cost` (the default), or a depth it cannot draft.
        """
        raise ValueError(f"the {self.info().name} drafter has no drafting cost to measure")

    def trained_head(self) -> torch.nn.Module | None:
        """The head module this drafter drafts with, which adaptation may train in place (its weights copied in
        between requests); None (the default) for a drafter without trained weights (prompt lookup, no drafts)."""
        return None

    def fork(self) -> Drafter:
        """A drafter for one more sequence of a batch: weights and settings shared, per-sequence state set
        anew by :meth:`begin`. Default: a shallow copy; drafters holding state across :meth:`begin` override."""
        return copy.copy(self)

    def check_vocab(self, target_vocab_size: int) -> None:
        """Refuse a target whose vocabulary is not the one the drafter's ids come from.

        Raises:
            ValueError: ``info().vocab_size`` is set and differs from ``target_vocab_size``.
        """
        own = self.info().vocab_size
        if own is not None and own != target_vocab_size:
            raise ValueError(
                f"the {self.info().name} drafter drafts ids of a {own}-token vocabulary, the target has "
                f"{target_vocab_size}: use heads trained on this target"
            )


def chain_room(limit: DraftLimit) -> int:
    """The longest useful chain under ``limit``: its useful depth, and its depth when a rule sets one."""
    return limit.useful_depth if limit.depth is None else min(limit.useful_depth, limit.depth)


def context_length(model) -> int | None:
    """The positions a model's context holds (``config.max_position_embeddings``; GPT-2's ``n_positions``
    answers to that name too), or None when its config names none."""
    n = getattr(model.config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
