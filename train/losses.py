"""Training losses and metrics for draft heads (pure tensor functions).

Every head family scores its draft distribution q against the target's distribution p at the same position with
one of :data:`DISTRIBUTION_LOSSES` (:func:`distribution_loss`); the acceptance rate of a draft at a position is
``alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)`` (Leviathan et al. 2023, Theorem 3.5), which is what speculative
sampling accepts and what the losses ``tv``, ``nla`` and ``lk_hybrid`` optimise directly (LK losses, Samarin et
al. 2026, arXiv:2602.23881).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100
# The per-position losses of a draft distribution q against the target's p (distribution_loss).
DISTRIBUTION_LOSSES = ("ce", "kl", "tv", "nla", "lk_hybrid")
# LK hybrid: lambda = exp(-LK_ETA * alpha) weights KL against TV (arXiv:2602.23881, eta = 3).
LK_ETA = 3.0


def log_acceptance(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """``log alpha`` with ``alpha = sum_x min(p(x), q(x))``, the probability that speculative sampling accepts a
    token drawn from q when the target's distribution is p (Leviathan et al. 2023, Theorem 3.5), computed in log
    space (``logsumexp(min(log p, log q))``), so it stays finite while any ``p(x) q(x) > 0`` underflows.

    Args:
        log_q, log_p: ``[..., S]`` float log-probabilities (``log_softmax`` outputs) over one vocabulary.

    Returns:
        ``[...]`` float tensor, ``<= 0``; ``-inf`` only where the supports are disjoint.
    """
    return torch.logsumexp(torch.minimum(log_q, log_p), dim=-1).clamp(max=0.0)


def distribution_loss(log_q: torch.Tensor, log_p: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-position training loss of a draft distribution q against the target's p.

    * ``ce``: ``-log q(argmax p)``, cross entropy against the target's greedy token;
    * ``kl``: ``KL(p || q) = sum_x p (log p - log q)`` (forward KL, as EAGLE-3 trains);
    * ``tv``: ``TV(p, q) = 1/2 sum_x |p - q| = 1 - alpha`` (LK losses, arXiv:2602.23881; DSpark's TV term);
    * ``nla``: ``-log alpha``, the negative log acceptance rate (LK): TV's gradient scaled by ``1 / alpha``, so it
      does not vanish while acceptance is small;
    * ``lk_hybrid``: ``lambda KL + (1 - lambda) TV`` with ``lambda = exp(-3 alpha)`` computed from the detached
      alpha (LK's adaptive mix: KL while the draft accepts little, TV as acceptance grows).

    Every kind is 0 where ``q = p`` (``ce`` excepted: the entropy-free cross entropy of p's greedy token).

    Args:
        log_q: ``[..., S]`` float log-probabilities of the draft (a graph flows through it).
        log_p: ``[..., S]`` float log-probabilities of the target over the same vocabulary (no gradient needed).
        kind: one of :data:`DISTRIBUTION_LOSSES`.

    Returns:
        ``[...]`` float tensor, one loss per position (callers weight and average).

    Raises:
        ValueError: an unknown ``kind`` or mismatched shapes.
    """
    if log_q.shape != log_p.shape:
        raise ValueError(f"log_q {tuple(log_q.shape)} and log_p {tuple(log_p.shape)} must have one shape")
    if kind == "ce":
        return -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)
    if kind == "kl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "nla":
        return -log_acceptance(log_q, log_p)
    tv = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    if kind == "tv":
        return tv
    if kind == "lk_hybrid":
        lam = torch.exp(-LK_ETA * (1.0 - tv.detach()))
        return lam * (log_p.exp() * (log_p - log_q)).sum(-1) + (1.0 - lam) * tv
    raise ValueError(f"loss must be one of {', '.join(DISTRIBUTION_LOSSES)}, got {kind!r}")


def check_loss_kind(kind: str, where: str, extra: tuple[str, ...] = ()) -> None:
    """Refuse a loss name a config cannot train with.

    Raises:
        ValueError: ``kind`` is neither in :data:`DISTRIBUTION_LOSSES` nor in ``extra``; the message names ``where``
            and the valid values.
    """
    valid = (*extra, *DISTRIBUTION_LOSSES)
    if kind not in valid:
        raise ValueError(f"{where} must be one of {', '.join(repr(v) for v in valid)}, got {kind!r}")


def medusa_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    head_decay: float = 0.8,
    kind: str = "ce",
    log_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa-1 loss: ``sum_k head_decay**k * L_k`` (Cai et al. 2024, eq. 1, where ``L_k`` is a CE).

    ``kind="ce"`` scores head k against its label token (Medusa's loss); any other :data:`DISTRIBUTION_LOSSES`
    kind scores head k's distribution against the target's distribution ``log_p[k]`` at the label's position
    (:func:`distribution_loss`), at the positions that have a label.

    Args:
        logits: ``[K, P, S]`` head logits over the draft vocabulary for P positions.
        labels: LongTensor ``[P, K]`` of draft-vocabulary ids, ``-100`` where head k has no label
            (past the end, not an assistant token, or a token outside the draft vocabulary).
        head_decay: weight decay across heads (0.8 in Medusa's recipe).
        kind: ``"ce"`` or a :func:`distribution_loss` kind.
        log_p: ``[K, P, S]`` float target log-probabilities over the draft vocabulary; required unless ``kind`` is
            ``"ce"``.

    Returns:
        ``(loss, per_head)``: scalar float32 weighted loss, and ``[K]`` float32 mean loss per head
        (0 for a head with no labels).

    Raises:
        ValueError: mismatched shapes, an unknown ``kind``, or ``log_p`` missing for a distribution loss.
    """
    K = logits.shape[0]
    if labels.shape != (logits.shape[1], K):
        raise ValueError(f"labels must be [P, K] = [{logits.shape[1]}, {K}], got {tuple(labels.shape)}")
    check_loss_kind(kind, "medusa.loss")
    if kind != "ce" and (log_p is None or log_p.shape != logits.shape):
        raise ValueError(f"medusa.loss {kind!r} needs log_p of shape {tuple(logits.shape)}")
    per_head = []
    total = logits.new_zeros((), dtype=torch.float32)
    for k in range(K):
        y = labels[:, k]
        valid = y != IGNORE
        if not bool(valid.any()):
            per_head.append(total.new_zeros(()))
            continue
        if kind == "ce":
            lk = F.cross_entropy(logits[k][valid].float(), y[valid])
        else:
            log_q = torch.log_softmax(logits[k][valid].float(), dim=-1)
            lk = distribution_loss(log_q, log_p[k][valid].float(), kind).mean()
        per_head.append(lk.detach())
        total = total + (head_decay**k) * lk
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
    token_loss: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-1 loss (Li et al. 2024, arXiv:2401.15077, section 4.2): feature regression plus a token term.

    ``feature_weight * SmoothL1(f', f) + ce_weight * L(q, p)``, where q is the draft distribution
    (``log_softmax(pred_logits)``), p the target's at the same position and ``L`` the :func:`distribution_loss`
    ``token_loss``. The default ``kl`` has the gradient of EAGLE's soft-label cross entropy (its reference code;
    0.1 is its weight) and is lower by the target's entropy. Both terms are means over the P scored positions
    (SmoothL1 also over D, beta 1).

    Args:
        pred_features: ``[P, D]`` predicted features ``f'_{t+1}`` at the scored positions.
        target_features: ``[P, D]`` the target's features ``f_{t+1}`` there (after the final norm).
        pred_logits: ``[P, S]`` draft logits (``lm_head(f')`` over the draft vocabulary).
        target_logits: ``[P, S]`` target logits over the same rows (``lm_head(f)``; no gradient needed).
        ce_weight, feature_weight: term weights.
        token_loss: one of :data:`DISTRIBUTION_LOSSES` (``ce``: against the target's greedy token).

    Returns:
        ``(loss, feature_loss, token_term)``: float32 scalars; the last two detached. With P = 0 all are 0
        (and ``loss`` still has a graph, so every process can call ``backward``).

    Raises:
        ValueError: mismatched shapes or an unknown ``token_loss``.
    """
    if pred_features.shape != target_features.shape or pred_logits.shape != target_logits.shape:
        raise ValueError(
            f"shape mismatch: features {tuple(pred_features.shape)} vs {tuple(target_features.shape)}, "
            f"logits {tuple(pred_logits.shape)} vs {tuple(target_logits.shape)}"
        )
    check_loss_kind(token_loss, "eagle.loss")
    if pred_features.shape[0] == 0:
        zero = pred_features.float().sum() * 0.0 + pred_logits.float().sum() * 0.0
        return zero, zero.detach(), zero.detach()
    feat = F.smooth_l1_loss(pred_features.float(), target_features.float())
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    token = distribution_loss(torch.log_softmax(pred_logits.float(), dim=-1), log_p, token_loss).mean()
    loss = feature_weight * feat + ce_weight * token
    return loss, feat.detach(), token.detach()
