"""Training losses and metrics for draft heads (pure tensor functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def medusa_loss(
    logits: torch.Tensor, labels: torch.Tensor, head_decay: float = 0.8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa-1 loss: ``sum_k head_decay**k * CE_k`` (Cai et al. 2024, eq. 1).

    Args:
        logits: ``[K, P, S]`` head logits over the draft vocabulary for P positions.
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
        logits: ``[K, P, S]``.
        labels: LongTensor ``[P, K]`` draft ids; ``-100`` = not scored; ``-1`` = a real target token that
            lies outside the draft vocabulary (always a miss, but counted).
        k: largest rank.

    Returns:
        ``(hits, counts)``: ``hits[h, j]`` = positions where head h's label is within its top-(j+1)
        (LongTensor ``[K, k]``); ``counts[h]`` = scored positions (LongTensor ``[K]``).
    """
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [K, P, k]
    lab = labels.T.unsqueeze(-1)  # [K, P, 1]
    match = (top == lab).long()
    if match.shape[-1] < k:
        match = F.pad(match, (0, k - match.shape[-1]))
    scored = labels.T != IGNORE  # [K, P]
    hits = (match.cumsum(-1) * scored.unsqueeze(-1)).sum(1)
    return hits, scored.sum(1)


def eagle_loss(
    pred_features: torch.Tensor,
    target_features: torch.Tensor,
    pred_logits: torch.Tensor,
    target_logits: torch.Tensor,
    ce_weight: float = 0.1,
    feature_weight: float = 1.0,
    hard_labels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1 loss (Li et al. 2024, arXiv:2401.15077, section 4.2): feature regression plus a token term.

    ``feature_weight * SmoothL1(f', f) + ce_weight * CE(p, softmax(target_logits))``, where the CE is the
    cross-entropy of the draft distribution (``log_softmax(pred_logits)``) against the target's
    distribution at the same position (soft labels, as EAGLE's reference code; 0.1 is its weight).
    Both terms are means over the P scored positions (SmoothL1 also over D, beta 1).

    Args:
        pred_features: ``[P, D]`` predicted features ``f'_{t+1}`` at the scored positions.
        target_features: ``[P, D]`` the target's features ``f_{t+1}`` there (after the final norm).
        pred_logits: ``[P, S]`` draft logits (``lm_head(f')`` over the draft vocabulary).
        target_logits: ``[P, S]`` target logits over the same rows (``lm_head(f)``; no gradient needed).
        ce_weight, feature_weight: term weights.
        hard_labels: score the draft against the target's greedy token (``argmax(target_logits)``, a one-hot
            distribution) instead of its full distribution.

    Returns:
        ``(loss, feature_loss, ce_loss)``: float32 scalars; the last two detached. With P = 0 all are 0
        (and ``loss`` still has a graph, so every process can call ``backward``).

    Raises:
        ValueError: mismatched shapes.
    """
    if pred_features.shape != target_features.shape or pred_logits.shape != target_logits.shape:
        raise ValueError(
            f"shape mismatch: features {tuple(pred_features.shape)} vs {tuple(target_features.shape)}, "
            f"logits {tuple(pred_logits.shape)} vs {tuple(target_logits.shape)}"
        )
    if pred_features.shape[0] == 0:
        zero = pred_features.float().sum() * 0.0 + pred_logits.float().sum() * 0.0
        return zero, zero.detach(), zero.detach()
    feat = F.smooth_l1_loss(pred_features.float(), target_features.float())
    if hard_labels:
        ce = F.cross_entropy(pred_logits.float(), target_logits.argmax(-1))
    else:
        p = torch.softmax(target_logits.float(), dim=-1)
        ce = -(p * torch.log_softmax(pred_logits.float(), dim=-1)).sum(-1).mean()
    loss = feature_weight * feat + ce_weight * ce
    return loss, feat.detach(), ce.detach()
