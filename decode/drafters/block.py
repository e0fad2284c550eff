"""Block drafting: a DFlash or DSpark head (:class:`selfspec.heads.dflash.BlockHead`) drafts a whole block in one
forward (DFlash, arXiv:2602.06036; DSpark, arXiv:2607.05147).

Per sequence the drafter keeps the fused context every draft layer attends to
(:class:`~selfspec.heads.block_layers.ContextKV`): the keys and values of the target's states at every decided
position. :meth:`BlockDrafter.begin` feeds the prompt's, :meth:`BlockDrafter.accept` those of the verified path (root
first), so before each step the context holds positions ``0 .. n - 1`` and the root (the anchor) sits at position
``n``. One :meth:`BlockDrafter.propose`:

1. one head forward over the block ``[root, mask, ..., mask]`` at positions ``n .. n + B - 1``, every slot seeing
   the whole context and the whole block;
2. the draft tokens, slot by slot: the argmax of each slot's logits (DSpark: plus the Markov bias keyed on the
   previous draft, chained), cut at the loop's useful depth, at the drafter's own ``length``, and (DSpark, with
   ``confidence_min``) before the first slot whose predicted survival falls below it;
3. the chain as the draft tree, or with ``top_k > 1`` a tree: the chain plus, at each of its first ``branch_depth``
   depths, the slot's next ``top_k - 1`` candidates as leaves (siblings of the chain's node there).

Drafts are deterministic (``DraftTree.q = None``): the verifier treats them as one-hot proposals, so greedy output
is the target's and sampling stays lossless whatever the head proposes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from selfspec.decode.drafters.base import (
    AcceptedPath,
    DraftCostKey,
    Drafter,
    DrafterInfo,
    DraftLimit,
    TreeShape,
    chain_room,
)
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree
from selfspec.heads.block_layers import ContextKV

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class BlockDrafter(Drafter):
    """Block drafter on a DFlash or DSpark head (:class:`~selfspec.decode.drafters.base.Drafter`).

    Args:
        head: a :class:`~selfspec.heads.dflash.BlockHead` on the target's device and dtype (attached here).
        target: the frozen target.
        length: draft tokens per step (default: the head's block, ``max_drafts``).
        top_k: candidates per slot; 1 drafts the chain alone.
        branch_depth: with ``top_k > 1``, the chain depths that get sibling leaves (default: all).
        confidence_min: DSpark only: cut the block before the first slot whose confidence is below it (0: never).

    Raises:
        ValueError: sizes out of range, or ``confidence_min`` for a head without a confidence head.
    """

    def __init__(
        self,
        head,
        target,
        length: int | None = None,
        top_k: int = 1,
        branch_depth: int | None = None,
        confidence_min: float = 0.0,
    ) -> None:
        cfg = head.config
        length = cfg.max_drafts if length is None else length
        if not 1 <= length <= cfg.max_drafts:
            raise ValueError(f"length must be in [1, {cfg.max_drafts}] (the head's block), got {length}")
        if not 1 <= top_k <= cfg.n_draft:
            raise ValueError(f"top_k must be in [1, {cfg.n_draft}], got {top_k}")
        if confidence_min and not cfg.confidence:
            raise ValueError("confidence_min needs a DSpark head with a confidence head; set it to 0")
        head.attach_target(target)
        self.head = head
        self.length, self.top_k, self.confidence_min = length, top_k, float(confidence_min)
        self.branch_depth = length if branch_depth is None else max(0, min(branch_depth, length))
        self._context = None  # ContextKV of positions 0 .. n - 1
        # Diagnostics of the last propose(): the block's slot confidences (DSpark) and the chain drafted.
        self.last_block: dict[str, torch.Tensor] | None = None

    def info(self) -> DrafterInfo:
        """The head's target layers (outputs of ``target_layer_ids``, as ``hidden_states[i + 1]``) and its block."""
        cfg = self.head.config
        nodes = 1 + self.length + (self.top_k - 1) * self.branch_depth
        return DrafterInfo(
            name=cfg.head_type,
            max_depth=self.length,
            target_layers=self.head.target_layers,
            vocab_size=cfg.vocab_size,
            head=True,
            draft_cost=DraftCostKey(cfg.head_type, cfg.cost_shape, self.top_k, per_block=True),
            tree=TreeShape(self.length, nodes - 1, nodes, self.top_k, self.branch_depth if self.top_k > 1 else 0),
        )

    def trained_head(self) -> torch.nn.Module:
        """The block head module."""
        return self.head

    def at_depth(self, depth: int, target: PreTrainedModel) -> BlockDrafter:
        """A chain drafter of this head that keeps ``depth`` drafts of its block (one forward over the block
        whatever it keeps). Raises ValueError beyond the head's block."""
        if depth > self.head.config.max_drafts:
            raise ValueError(f"a block drafter drafts at most {self.head.config.max_drafts} tokens, not {depth}")
        return BlockDrafter(self.head, target, length=depth)

    def fork(self) -> BlockDrafter:
        twin = super().fork()
        twin._context, twin.last_block = None, None
        return twin

    def _extend(self, hidden: torch.Tensor) -> None:
        start = 0 if self._context is None else self._context.length
        pos = torch.arange(start, start + hidden.shape[0], device=hidden.device).unsqueeze(0)
        more = self.head.context(hidden.unsqueeze(0), pos)
        self._context = ContextKV(more) if self._context is None else self._context.extended(more)

    @torch.inference_mode()
    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Reset and feed the prompt's target states ``hidden`` ``[T, k D]`` (positions 0 .. T - 1)."""
        self._context = None
        self._extend(hidden)

    @torch.inference_mode()
    def accept(self, accepted: AcceptedPath) -> None:
        """Feed the verified path's target states (root first, ``[A, k D]``) at the next positions; the next root
        (``accepted.next_token``) is the next block's anchor. A step decoded without a draft feeds its root alone."""
        self._extend(accepted.hidden)

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """Draft the block after ``context[-1]``: a chain of up to ``length`` tokens (tree with ``top_k > 1``).

        Raises:
            RuntimeError: called before :meth:`begin`, or with a context the drafter has not been fed.
        """
        if self._context is None:
            raise RuntimeError("BlockDrafter.propose called before begin()")
        head, cfg = self.head, self.head.config
        n = self._context.length
        if context.numel() != n + 1:
            raise RuntimeError(f"the drafter holds {n} context positions, the context has {context.numel()} tokens")
        device = context.device
        root = context[-1:]
        room = min(self.length, chain_room(limit))
        if room < 1:
            return DraftTree(tokens=root, parents=torch.tensor([-1], device=device))
        # The whole block, however few drafts this step keeps: attention inside the block goes both ways, so a
        # shorter block would give its slots other outputs than the block the head was trained (and is exported) on.
        slots = cfg.block_size
        tokens = torch.full((1, slots), cfg.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = root[0]
        pos = torch.arange(n, n + slots, device=device).unsqueeze(0)
        z = head(tokens, pos, self._context.layers)[0, cfg.first_slot : cfg.first_slot + room]  # [room, D]
        logits = head.draft_logits(z).float()  # [room, S]
        ids = head.draft_ids
        chain: list[int] = []
        confidences: list[float] = []
        prev = root[0]
        for j in range(room):
            scores = logits[j]
            markov = head.markov(prev.view(1))
            if markov is not None:
                scores = scores + markov[0][0].float()
                if self.confidence_min:
                    conf = torch.sigmoid(head.confidence_logits(z[j : j + 1], markov[1])).item()
                    confidences.append(conf)
                    if conf < self.confidence_min:
                        break
            logits[j] = scores
            prev = ids[scores.argmax()]
            chain.append(j)
        drafts = ids[logits[: len(chain)].argmax(-1)] if chain else root[:0]
        self.last_block = {"drafts": drafts, "confidence": torch.tensor(confidences)}
        return self._tree(root, drafts, logits[: len(chain)])

    def _tree(self, root: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor) -> DraftTree:
        """The chain ``root, drafts`` and, with ``top_k > 1``, each of its first ``branch_depth`` depths' next
        candidates as leaves under the chain's node above (children after their parents)."""
        device = root.device
        m = drafts.numel()
        tokens = torch.cat([root, drafts.to(root.dtype)])
        parents = torch.arange(-1, m, device=device)
        if self.top_k == 1 or m == 0 or self.branch_depth == 0:
            return DraftTree(tokens=tokens, parents=parents)
        d = min(self.branch_depth, m)
        top = logits[:d].topk(self.top_k, dim=-1).indices[:, 1:]  # [d, k - 1]: the chain's own token is the first
        leaves = self.head.draft_ids[top].reshape(-1).to(root.dtype)
        leaf_parents = torch.arange(d, device=device).repeat_interleave(self.top_k - 1)
        return DraftTree(tokens=torch.cat([tokens, leaves]), parents=torch.cat([parents, leaf_parents]))
