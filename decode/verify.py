"""Verification of a draft tree (or chain) against the target: which drafts to keep, and one more token.

Conventions (shared with ``decode/tree.py``): a tree has N nodes; node 0 is the root (the last
decided token), nodes 1..N-1 are drafts, ``parents[0] = -1``, ``parents[i] < i``. ``p[i]`` is the
target distribution of the token *following* node i; ``q[i]`` the draft distribution node i's children
were drawn from. Children are tried in increasing node index.

* Greedy (:func:`verify_greedy`): keep the longest path whose drafts all equal the target's argmax;
  the output is token-for-token plain greedy decoding.
* Sampling: lossless speculative sampling over trees and chains, in :mod:`selfspec.decode.rejection`
  (:func:`~selfspec.decode.rejection.verify_tree_sampling`, :func:`~selfspec.decode.rejection.verify_chain_sampling`).
* :func:`verify_typical`: Medusa's typical acceptance (Cai et al. 2024). LOSSY, explicit opt-in only.

Every verifier returns a :class:`VerifyResult` and checks its tree with :func:`check_tree`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .host import HostTree, to_device
from .sampling import sample


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes:
        accepted_nodes: LongTensor ``[A]``, ``A >= 1``, on the tree's device: the accepted path as node
            indices, starting with 0 (the root). Node ``accepted_nodes[j]`` has depth j.
        next_token: the token that follows the last accepted node: the bonus token (drawn from / argmax
            of p at that node) or the correction drawn from the residual after a rejection.
        path: ``accepted_nodes`` on the host (the verifiers fill it; None when a result is built without it).
    """

    accepted_nodes: torch.Tensor
    next_token: int
    path: tuple[int, ...] | None = None

    @classmethod
    def from_path(cls, path: list[int], next_token: int, device: torch.device) -> VerifyResult:
        """The result of an accepted ``path`` (host node indices, root first) sent to ``device`` once."""
        return cls(to_device(path, device), next_token, tuple(path))

    @property
    def num_accepted(self) -> int:
        """Number of draft tokens accepted (``A - 1``); the step yields ``num_accepted + 1`` tokens."""
        return int(self.accepted_nodes.numel()) - 1


# --------------------------------------------------------------------------------------------------
# Validation and tree plumbing (small host-side lists; N is tens to hundreds).


def check_tree(
    tree_tokens: torch.Tensor, parents: torch.Tensor, host: HostTree | None = None
) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` as lists after checking the tree; from ``host`` when given (no host read).

    Raises:
        ValueError: ``parents`` is not an integer tensor ``[N]``, ``N >= 1``, with ``parents[0] = -1`` and
            ``0 <= parents[i] < i``; or ``tree_tokens`` is not an integer tensor of its shape.
    """
    if parents.dim() != 1 or parents.numel() == 0 or parents.is_floating_point():
        raise ValueError(f"parents must be an integer tensor [N], N >= 1, got {tuple(parents.shape)} {parents.dtype}")
    if tree_tokens.shape != parents.shape or tree_tokens.is_floating_point():
        raise ValueError(
            f"tree_tokens must be an integer tensor of parents' shape {tuple(parents.shape)}, got "
            f"{tuple(tree_tokens.shape)} {tree_tokens.dtype}"
        )
    parent_list = parents.tolist() if host is None else host.parents
    if parent_list[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {parent_list[0]}")
    for i, parent in enumerate(parent_list[1:], start=1):
        if not 0 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}; every non-root node needs 0 <= parents[i] < i")
    return (tree_tokens.tolist() if host is None else host.tokens), parent_list


def check_rows(name: str, x: torch.Tensor, rows: int) -> None:
    """Raise ValueError unless ``x`` (called ``name`` in the message) is a float tensor ``[rows, V]``."""
    if x.dim() != 2 or x.shape[0] != rows or not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor [{rows}, V], got {tuple(x.shape)} {x.dtype}")


def _path_to(node: int, parent_list: list[int]) -> list[int]:
    path = [node]
    while parent_list[path[-1]] >= 0:
        path.append(parent_list[path[-1]])
    return path[::-1]


def _deepest_valid(valid: list[bool], parent_list: list[int], score: list[float] | None = None) -> int:
    """The valid node of greatest depth (ties: highest score, then lowest index)."""
    depth = [0] * len(parent_list)
    best, best_key = 0, (0, -math.inf if score is None else score[0])
    for i in range(1, len(parent_list)):
        depth[i] = depth[parent_list[i]] + 1
        if valid[i]:
            key = (depth[i], 0.0 if score is None else score[i])
            if key > best_key:
                best, best_key = i, key
    return best


# --------------------------------------------------------------------------------------------------
# Greedy.


def verify_greedy(
    logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    host: HostTree | None = None,
    argmax: list[int] | None = None,
) -> VerifyResult:
    """Greedy tree verification: the output equals plain greedy decoding token for token.

    A draft node is valid when its token equals ``argmax(logits[parent])`` and its parent is valid. The
    deepest valid node wins (ties, possible only with duplicate sibling tokens: lowest index);
    ``next_token = argmax(logits[last])``. Argmax is ``torch.argmax`` (first maximal index on exact
    ties), like ``generate``. One host copy of the ``[N]`` argmaxes (none when ``argmax`` is given), and
    of the tree unless ``host`` is given.

    Args:
        logits: ``[N, V]`` processed target logits (:func:`~selfspec.decode.sampling.process_logits`).
        tree_tokens: LongTensor ``[N]`` (``tree_tokens[0]``, the root, is not checked).
        parents: LongTensor ``[N]``, ``parents[0] = -1``, ``parents[i] < i``.
        host: the same tree already read to the host (:func:`~selfspec.decode.host.read_tree`).
        argmax: ``torch.argmax(logits, dim=-1)`` already read to the host (N ints), e.g. together with
            another value the caller needs in the same copy.

    Returns:
        :class:`VerifyResult`.

    Raises:
        ValueError: bad shapes or an invalid ``parents``.
    """
    tokens, parent_list = check_tree(tree_tokens, parents, host)
    check_rows("logits", logits, len(parent_list))
    if argmax is None:
        argmax = torch.argmax(logits, dim=-1).tolist()
    elif len(argmax) != len(parent_list):
        raise ValueError(f"argmax must hold one index per node ({len(parent_list)}), got {len(argmax)}")
    valid = [True] * len(parent_list)
    for i in range(1, len(parent_list)):
        parent = parent_list[i]
        valid[i] = valid[parent] and tokens[i] == argmax[parent]
    last = _deepest_valid(valid, parent_list)
    path = _path_to(last, parent_list)
    return VerifyResult.from_path(path, argmax[last], parents.device)


def verify_greedy_chain(logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy verification of a chain of K drafts (fast path of :func:`verify_greedy`).

    Args:
        logits: ``[K+1, V]`` processed target logits; row k follows the k-th token of
            ``[root, d_1, ..., d_K]``.
        draft_tokens: LongTensor ``[K]``.

    Returns:
        ``(num_accepted, next_token)``: the length of the longest prefix of drafts equal to the target's
        argmax, and the argmax after it.

    Raises:
        ValueError: shapes disagree.
    """
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point():
        raise ValueError(f"draft_tokens must be an integer tensor [K], got {tuple(draft_tokens.shape)}")
    check_rows("logits", logits, draft_tokens.numel() + 1)
    argmax = torch.argmax(logits, dim=-1)
    k = draft_tokens.numel()
    matches = (argmax[:k] == draft_tokens).to(torch.long).cumprod(dim=0)
    num_accepted = int(matches.sum())
    return num_accepted, int(argmax[num_accepted])


# --------------------------------------------------------------------------------------------------
# Medusa typical acceptance (lossy).


def verify_typical(
    p: torch.Tensor,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    generator: torch.Generator | None = None,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    *,
    host: HostTree | None = None,
) -> VerifyResult:
    """Medusa's typical acceptance (Cai et al. 2024, "Medusa", Sec. 2.3.1). LOSSY: NOT distribution-preserving.

    A draft token x under node u is acceptable when ``p_u(x) > min(posterior_threshold,
    posterior_alpha * exp(-H(p_u)))`` (H the entropy in nats, ``0 log 0 = 0``). The deepest path of
    acceptable tokens wins; ties go to the highest sum of ``log p`` along the path (as in Medusa), then
    the lowest index. ``next_token`` is sampled from ``p`` at the last accepted node (Medusa samples it
    from the typical-truncated distribution instead). Use only when speed matters more than fidelity
    to the target's sampling distribution; the default sampling verifier is
    :func:`~selfspec.decode.rejection.verify_tree_sampling`.

    Args:
        p: ``[N, V]`` float target distributions (processed, e.g. with temperature).
        tree_tokens: LongTensor ``[N]``.
        parents: LongTensor ``[N]``.
        generator: ``torch.Generator`` for the next-token draw (None: torch's default).
        posterior_threshold: epsilon, the hard threshold (Medusa default 0.09).
        posterior_alpha: delta, the entropy-scaled threshold factor (Medusa default 0.3).
        host: the same tree already read to the host (:func:`~selfspec.decode.host.read_tree`): no copy of it.

    Returns:
        :class:`VerifyResult`.

    Raises:
        ValueError: bad shapes, invalid ``parents``, or thresholds outside ``[0, 1]``.
    """
    if not (0.0 <= posterior_threshold <= 1.0 and 0.0 <= posterior_alpha <= 1.0):
        raise ValueError(
            f"posterior_threshold and posterior_alpha must be in [0, 1], got {posterior_threshold}, "
            f"{posterior_alpha}; Medusa uses 0.09 and 0.3"
        )
    tokens, parent_list = check_tree(tree_tokens, parents, host)
    n = len(parent_list)
    check_rows("p", p, n)
    valid, log_score = [True] * n, [0.0] * n
    if n > 1:
        entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # [N]
        threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
        parent_idx, token_idx = to_device([parent_list[1:], tokens[1:]], p.device)  # one copy, [2, N - 1]
        p_x = p[parent_idx, token_idx]
        ok_logp = torch.cat([(p_x > threshold[parent_idx]).to(torch.float64), torch.log(p_x.to(torch.float64))])
        values = ok_logp.tolist()  # one copy: whether each draft is acceptable, then its log p
        ok, logp = [v > 0.5 for v in values[: n - 1]], values[n - 1 :]
        for i in range(1, n):
            parent = parent_list[i]
            valid[i] = valid[parent] and ok[i - 1]
            log_score[i] = log_score[parent] + logp[i - 1]
    last = _deepest_valid(valid, parent_list, log_score)
    path = _path_to(last, parent_list)
    next_token = int(sample(p[last].unsqueeze(0), generator)[0])
    return VerifyResult.from_path(path, next_token, parents.device)
