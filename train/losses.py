"""Training losses and metrics for draft heads (pure tensor functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def medusa_loss(logits: torch.Tensor, labels: torch.Tensor, head_decay: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa-1 loss: ``sum_k head_decay**k * CE_k`` (Cai et al. 2024, eq. 1).

    Args:
        logits: ``[K, P, N]`` head logits over the draft vocabulary for P positions.
        labels: LongTensor ``[P, K]`` of draft-vocabulary ids, ``-100`` where head k has no label
            (past the end, not an assistant token, or a token outside the draft vocabulary).
        head_decay: weight decay across heads (0.8 in Medusa's recipe).

    Returns:
        ``(loss, per_head)``: scalar float32 weighted loss, and ``[K]`` float32 mean CE per head
        (0 for a head with no labels).
    """
    K = logits.shape[0]
    if labels.shape != (logits.shape[1], K):
        raise ValueError(f"labels must be [P, K] = [{logits.shape[1]}, {K}], got {tuple(labels.shape)}")
    per_head = []
    total = logits.new_zeros((), dtype=torch.float32)
    for k in range(K):
        y = labels[:, k]
        valid = y != IGNORE
        if not bool(valid.any()):
            per_head.append(total.new_zeros(()))
            continue
        ce = F.cross_entropy(logits[k][valid].float(), y[valid])
        per_head.append(ce.detach())
        total = total + (head_decay**k) * ce
    return total, torch.stack(per_head)


@torch.no_grad()
def topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative top-1..top-k hit counts per head.

    Args:
        logits: ``[K, P, N]``.
        labels: LongTensor ``[P, K]`` draft ids; ``-100`` = not scored; ``-1`` = a real target token that
            lies outside the draft vocabulary (always a miss, but counted).
        k: largest rank.

    Returns:
        ``(hits, counts)``: ``hits[h, j]`` = positions where head h's label is within its top-(j+1)
        (LongTensor ``[K, k]``); ``counts[h]`` = scored positions (LongTensor ``[K]``).
    """
    K = logits.shape[0]
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [K, P, k]
    lab = labels.T.unsqueeze(-1)  # [K, P, 1]
    match = (top == lab).long()
    if match.shape[-1] < k:
        match = F.pad(match, (0, k - match.shape[-1]))
    scored = (labels.T != IGNORE)  # [K, P]
    hits = (match.cumsum(-1) * scored.unsqueeze(-1)).sum(1)
    return hits, scored.sum(1)
