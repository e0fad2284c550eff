"""Prompt lookup decoding (Saxena 2023): the draft is what followed an earlier occurrence of the context's
last n-gram (:func:`~selfspec.decode.drafters.ngram.lookup_chain`), a chain with no model at all."""

from __future__ import annotations

import torch

from selfspec.decode.drafters.base import Drafter, DrafterInfo, DraftLimit, chain_room
from selfspec.decode.drafters.ngram import lookup_chain
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree, chain_parents


class PromptLookupDrafter(Drafter):
    """Prompt lookup: a chain continuing the latest earlier match of the context's last n-gram.

    Drafts are deterministic (``q = None``), so the lossless verifier accepts them under sampling too.

    Args:
        num_tokens: K, the longest chain drafted per step.
        max_ngram: longest n-gram tried first (down to ``min_ngram``).
        min_ngram: shortest n-gram tried.

    Raises:
        ValueError: ``num_tokens < 1`` or not ``1 <= min_ngram <= max_ngram``.
    """

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("need num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def info(self) -> DrafterInfo:
        return DrafterInfo(name="prompt_lookup", max_depth=self.num_tokens)

    def chain(self, context: list[int], max_tokens: int) -> tuple[list[int], int]:
        """``(continuation, match length)`` for ``context``, at most ``max_tokens`` long (:func:`lookup_chain`)."""
        return lookup_chain(context, self.max_ngram, self.min_ngram, min(self.num_tokens, max_tokens))

    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """A chain: the root then up to ``num_tokens`` tokens of the match, no deeper than the limit's useful
        depth and depth."""
        ctx = context.tolist()
        draft, _ = self.chain(ctx, chain_room(limit))
        tokens = torch.tensor([ctx[-1]] + draft, dtype=torch.long, device=context.device)
        return DraftTree(tokens=tokens, parents=chain_parents(tokens.numel(), context.device))
