"""Medusa heads on the target's hidden state with a static tree (Cai et al. 2024)."""

from __future__ import annotations

import torch

from selfspec.decode.drafters.base import AcceptedPath, Drafter, DrafterInfo, DraftLimit
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree, StaticTree


class MedusaDrafter(Drafter):
    """Medusa heads + a static tree.

    Node at depth d >= 1 with rank r takes head (d-1)'s rank-r candidate, computed from the target's
    hidden state at the last accepted node. Drafts are deterministic top-k (``q = None``), which the
    lossless verifier accepts under sampling too.
    """

    def __init__(self, heads, tree: StaticTree) -> None:
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(f"tree depth {tree.max_depth} exceeds the {heads.config.num_heads} Medusa heads")
        self.heads = heads
        self.tree = tree
        self._hidden: torch.Tensor | None = None
        self._topk = tree.topk
        self._depths = tree.max_depth
        # node i >= 1 -> flat index into [max_depth, topk] candidates
        self._gather = (tree.head_index[1:] * self._topk + tree.rank[1:]).clone()

    def info(self) -> DrafterInfo:
        return DrafterInfo(name="medusa", max_depth=self._depths, vocab_size=self.heads.config.vocab_size, head=True)

    def trained_head(self) -> torch.nn.Module:
        """The Medusa heads module."""
        return self.heads

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        self._hidden = hidden[-1]

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """The static tree's candidates from the heads at the last accepted node (the loop cuts it to the caps)."""
        h = self._hidden
        states = self.heads.head_states(h.to(next(self.heads.parameters()).dtype))[: self._depths]
        logits = self.heads.state_logits(states)
        cand = logits.topk(self._topk, dim=-1).indices  # [depth, topk] draft ids
        cand = self.heads.draft_ids[cand].reshape(-1)
        tokens = torch.cat([context[-1:], cand[self._gather.to(cand.device)]])
        return DraftTree(tokens=tokens, parents=self.tree.parents.to(tokens.device))

    def accept(self, accepted: AcceptedPath) -> None:
        self._hidden = accepted.hidden[-1]
