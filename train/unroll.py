"""Training-time test for EAGLE heads: the head unrolled on its own predicted features, with the attention
each unrolled query would have while drafting, and the greedy chain acceptance it implies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from selfspec.heads.eagle import EagleHead


def unrolled_mask(segment: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Attention mask of unrolled step ``step`` over the keys of steps ``0 .. step`` (concatenated).

    Query i at step j stands for a depth-(j+1) draft node whose chain starts at pair ``i - j``: exactly
    what it would see while drafting, it sees the step-0 keys (target features) of pairs ``<= i - j`` and
    the step-s key of pair ``i - j + s`` for s = 1 .. j (its draft ancestors, then itself), all within its
    own sequence. Queries without ``j`` earlier pairs in their sequence see only their own key.

    Args:
        segment: Long ``[B, T]`` sequence index per packed position (-1 on padding), from :func:`collate`.
        step: j >= 0.
        dtype: float dtype of the additive mask.

    Returns:
        Additive mask ``[B, 1, T, (step + 1) * T]`` (0 attend, dtype-min blocked).
    """
    B, T = segment.shape
    same = segment.unsqueeze(2) == segment.unsqueeze(1)  # [B, T, T]
    i = torch.arange(T, device=segment.device).view(1, T, 1)
    k = torch.arange(T, device=segment.device).view(1, 1, T)
    blocks = [same & (k <= i - step)]
    for s in range(1, step + 1):
        blocks.append(same & (k == i - step + s))
    allowed = torch.cat(blocks, dim=-1)
    allowed[:, :, step * T :] |= torch.eye(T, dtype=torch.bool, device=segment.device)  # own key, always
    return torch.zeros(B, 1, T, (step + 1) * T, dtype=dtype, device=segment.device).masked_fill_(
        ~allowed.unsqueeze(1), torch.finfo(dtype).min
    )


class UnrolledEagle(torch.nn.Module):
    """Training-time test for an EAGLE-1 head (as in EAGLE-3, Li et al. 2025, arXiv:2503.01840, and HASS):
    the head is run ``steps`` times, step j feeding on its own predicted features of step j-1, so it learns
    to draft at depth > 1 from features it predicted itself rather than only from the target's.

    Step 0 is the plain teacher-forced forward. At step j >= 1, pair i's input feature is the step-(j-1)
    prediction at pair i-1 (a prediction of ``f_i``), its token stays ``x_{i+1}``, its target stays
    ``f_{i+1}``, and its attention follows :func:`unrolled_mask` through one growing KV cache, so every
    query sees exactly the keys its draft-tree node would see at decoding time.

    The wrapper exists so ``accelerate`` / DDP sees one forward per optimiser step.
    """

    def __init__(self, head: EagleHead) -> None:
        super().__init__()
        self.head = head

    def forward(
        self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, segment: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Args: ``features`` ``[B, T, D]``, ``tokens`` / ``positions`` / ``segment`` Long ``[B, T]`` (from
        :func:`collate`), ``steps`` >= 1. Returns ``steps`` predictions ``[B, T, D]``; in step j only
        positions with ``positions >= j`` are meaningful."""
        dtype = self.head.fc.weight.dtype
        cache = DynamicCache(config=self.head.arch_config)
        outs: list[torch.Tensor] = []
        x = features
        for j in range(steps):
            pred = self.head(x, tokens, positions, unrolled_mask(segment, j, dtype), cache)
            outs.append(pred)
            if j + 1 < steps:
                x = torch.cat([features[:, :1], pred[:, :-1]], dim=1)
        return outs


def chain_hits(correct: list[torch.Tensor], usable: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Greedy chain acceptance from per-step correctness of an unrolled forward.

    Args:
        correct: per step j, Bool ``[B, T]``: the step-j draft at pair i equals the target's greedy token.
        usable: per step j, Bool ``[B, T]``: that comparison is defined (scored, enough history).

    Returns:
        ``(hits, counts)`` per depth d = 1 .. len(correct): over chain starts t where pairs
        ``t .. t+d-1`` are usable at steps ``0 .. d-1``, how many have all d drafts correct.
    """
    hits, counts = [], []
    B, T = correct[0].shape
    all_ok = torch.ones(B, T, dtype=torch.bool, device=correct[0].device)
    all_use = torch.ones_like(all_ok)
    for j, (c, u) in enumerate(zip(correct, usable, strict=True)):
        shifted_c = torch.zeros_like(all_ok)
        shifted_u = torch.zeros_like(all_ok)
        shifted_c[:, : T - j] = c[:, j:]
        shifted_u[:, : T - j] = u[:, j:]
        all_ok = all_ok & shifted_c
        all_use = all_use & shifted_u
        hits.append(int((all_ok & all_use).sum()))
        counts.append(int(all_use.sum()))
    return hits, counts


class ChainTally:
    """Greedy chain acceptance summed over held-out batches (:func:`chain_hits` of each).

    Attributes:
        hits: ``[d - 1]``: chain starts whose first d drafts all equal the target's greedy tokens.
        counts: ``[d - 1]``: chain starts whose first d drafts are all scored.
    """

    def __init__(self, depth: int) -> None:
        self.hits, self.counts = [0] * depth, [0] * depth

    def add(self, correct: list[torch.Tensor], usable: list[torch.Tensor]) -> None:
        """Add one batch's :func:`chain_hits`."""
        h, c = chain_hits(correct, usable)
        self.hits = [a + x for a, x in zip(self.hits, h, strict=True)]
        self.counts = [a + x for a, x in zip(self.counts, c, strict=True)]


def chain_metrics(hits: Sequence[int], counts: Sequence[int]) -> dict[str, Any]:
    """The held-out metrics of chain tallies (:class:`ChainTally`): ``chain[d - 1] = hits[d - 1] / counts[d - 1]``
    (4 places) and ``chain_tau = 1 + sum(chain)``, the greedy chain tau estimate (the bonus token included)."""
    chain = [round(h / max(1, c), 4) for h, c in zip(hits, counts, strict=True)]
    return {"chain": chain, "chain_tau": round(1 + sum(chain), 4)}
