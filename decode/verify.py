"""Verification of a draft tree (or chain) against the target: which drafts to keep, and one more token.

Conventions (shared with ``decode/tree.py``): a tree has N nodes; node 0 is the root (the last
decided token), nodes 1..N-1 are drafts, ``parents[0] = -1``, ``parents[i] < i``. ``p[i]`` is the
target distribution of the token *following* node i; ``q[i]`` the draft distribution node i's children
were drawn from. Children are tried in increasing node index.

* Greedy (:func:`verify_greedy`): keep the longest path whose drafts all equal the target's argmax;
  the output is token-for-token plain greedy decoding.
* Sampling (:func:`verify_tree_sampling`, :func:`verify_chain_sampling`): speculative sampling
  (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Alg. 1;
  Chen et al. 2023) generalised to trees by multi-candidate recursive rejection sampling
  (Miao et al. 2024, SpecInfer, Alg. 2 "VerifyStochastic"). The output has exactly the target's
  distribution, whatever q is.
* :func:`verify_typical`: Medusa's typical acceptance (Cai et al. 2024). LOSSY, explicit opt-in only.

Randomness enters only through a :class:`RandomSource`: :class:`GeneratorSource` (a
``torch.Generator``) in production; tests pass a source that enumerates every outcome with its exact
probability, so the losslessness check runs this very code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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

    @property
    def num_accepted(self) -> int:
        """Number of draft tokens accepted (``A - 1``); the step yields ``num_accepted + 1`` tokens."""
        return int(self.accepted_nodes.numel()) - 1


# --------------------------------------------------------------------------------------------------
# The rejection-sampling step (Leviathan et al. 2023, Alg. 1), as small pure functions.


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """``min(1, p(x) / q(x))``: the probability of keeping a draft token x drawn from q.

    ``q(x) = 0`` (a token the draft could not have drawn; float rounding) gives 1 if ``p(x) > 0`` and 0
    otherwise, so a token the target forbids is never accepted.

    Args:
        p_x: target probabilities of the drafted tokens, any shape, float.
        q_x: draft probabilities of the same tokens, same shape.

    Returns:
        Tensor of the broadcast shape with values in [0, 1].
    """
    ratio = (p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x))).clamp(max=1.0)
    return torch.where(q_x > 0, ratio, (p_x > 0).to(ratio.dtype))


def accept_draft(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Leviathan et al.'s test: keep x iff ``u < min(1, p(x) / q(x))`` for ``u ~ U[0, 1)``.

    The strict ``<`` makes ``P(accept) = min(1, p/q)`` exactly for ``u`` uniform on ``[0, 1)``
    (what ``torch.rand`` draws): p >= q is always accepted, ``u = p/q`` is the first rejected value,
    and ``p(x) = 0`` is never accepted, not even for ``u = 0``.

    Args:
        p_x, q_x: as in :func:`acceptance_probability`.
        u: uniforms in [0, 1), broadcastable.

    Returns:
        bool tensor.
    """
    return _is_accepted(u, acceptance_probability(p_x, q_x))


def _is_accepted(u, probability):  # the one place the accept rule lives (tensors or floats)
    return u < probability


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))``: what to sample from after a draft drawn from q was rejected.

    Degenerate case: mathematically the residual has zero mass only when p = q, and then a rejection has
    probability 0. With rounding a rejection can still happen (e.g. ``p(x)/q(x) = 0.9999999``) and leave
    a residual of (near-)zero mass made of rounding noise. When the mass is below the dtype's machine
    epsilon, p itself is returned (the limit p -> q of the residual is undefined; p is the target, and
    the event has probability of order epsilon). Decided without a host sync (``torch.where``).

    Args:
        p: ``[..., V]`` target distribution (rows sum to 1).
        q: ``[..., V]`` draft distribution, broadcastable to p. For deterministic candidates, a one-hot.

    Returns:
        ``[..., V]`` distribution in p's dtype, rows summing to 1, zero wherever ``q >= p``.
    """
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    eps = torch.finfo(residual.dtype).eps
    return torch.where(mass > eps, residual / mass.clamp_min(eps), p)


# --------------------------------------------------------------------------------------------------
# Random sources.


@runtime_checkable
class RandomSource(Protocol):
    """Where the sampling verifiers take their randomness from.

    ``accept(node, probability)`` decides the Bernoulli trial of one draft node (each node is tried at
    most once per verification); ``categorical(probs)`` draws one token from ``probs [V]`` (non-negative,
    need not be normalised).
    """

    def accept(self, node: int, probability: float) -> bool: ...

    def categorical(self, probs: torch.Tensor) -> int: ...


class GeneratorSource:
    """The production :class:`RandomSource`: a ``torch.Generator``.

    All N uniforms of a verification are drawn in one ``torch.rand(N)`` call (float64, one host copy, which
    :func:`verify_tree_sampling` shares with the first-try probabilities); tokens with
    :func:`selfspec.decode.sampling.sample` (``torch.multinomial``).

    Args:
        generator: the generator (on ``device``), or None for torch's default generator.
        num_nodes: N, the number of tree nodes.
        device: where to draw.
    """

    def __init__(self, generator: torch.Generator | None, num_nodes: int, device: torch.device) -> None:
        self.generator = generator
        self.num_nodes = num_nodes
        self.device = device
        self._uniforms: list[float] | None = None

    def draw(self) -> torch.Tensor:
        """The N uniforms, float64 ``[N]`` on ``device``, drawn now and not read (the caller reads them and
        hands them back as ``_uniforms``, before any ``accept`` or ``categorical``)."""
        return torch.rand(self.num_nodes, generator=self.generator, device=self.device, dtype=torch.float64)

    def accept(self, node: int, probability: float) -> bool:
        if self._uniforms is None:
            self._uniforms = self.draw().tolist()
        return _is_accepted(self._uniforms[node], probability)

    def categorical(self, probs: torch.Tensor) -> int:
        return int(sample(probs.unsqueeze(0), self.generator)[0])


def _as_source(generator: torch.Generator | RandomSource | None, num_nodes: int, device) -> RandomSource:
    if generator is None or isinstance(generator, torch.Generator):
        return GeneratorSource(generator, num_nodes, device)
    if isinstance(generator, RandomSource):
        return generator
    raise TypeError(f"generator must be a torch.Generator, a RandomSource or None, got {type(generator)}")


# --------------------------------------------------------------------------------------------------
# Validation and tree plumbing (small host-side lists; N is tens to hundreds).


def _check_tree(
    tree_tokens: torch.Tensor, parents: torch.Tensor, host: HostTree | None = None
) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` as lists after checking the tree; from ``host`` when given (no host read)."""
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


def _result(path: list[int], next_token: int, device: torch.device) -> VerifyResult:
    return VerifyResult(to_device(path, device), next_token, tuple(path))


def _check_rows(name: str, x: torch.Tensor, rows: int) -> None:
    if x.dim() != 2 or x.shape[0] != rows or not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor [{rows}, V], got {tuple(x.shape)} {x.dtype}")


def _children(parent_list: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parent_list]
    for i, parent in enumerate(parent_list[1:], start=1):
        children[parent].append(i)  # increasing node index
    return children


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
    tokens, parent_list = _check_tree(tree_tokens, parents, host)
    _check_rows("logits", logits, len(parent_list))
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
    return _result(path, argmax[last], parents.device)


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
    _check_rows("logits", logits, draft_tokens.numel() + 1)
    argmax = torch.argmax(logits, dim=-1)
    k = draft_tokens.numel()
    matches = (argmax[:k] == draft_tokens).to(torch.long).cumprod(dim=0)
    num_accepted = int(matches.sum())
    return num_accepted, int(argmax[num_accepted])


# --------------------------------------------------------------------------------------------------
# Lossless sampling: recursive rejection over the tree.


def verify_tree_sampling(
    p: torch.Tensor,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | RandomSource | None = None,
    *,
    host: HostTree | None = None,
) -> VerifyResult:
    """Multi-candidate recursive rejection sampling over a draft tree (SpecInfer, Miao et al. 2024).

    Starting at the root u with ``r = p[u]``, its children c (increasing index, token x_c) are tried in
    turn: accept with probability ``min(1, r(x_c) / q_u(x_c))``; on rejection ``r <- norm(max(r - q_u, 0))``
    (:func:`residual_distribution`) and the next child is tried. An accepted child becomes u (with
    ``r = p[c]``); when every child is rejected, ``next_token ~ r``; at a leaf, ``next_token ~ p[leaf]``
    (the bonus token). The emitted tokens have exactly the target's joint distribution
    ``prod_t p(x_t | x_<t)`` for any q, provided children were drawn as stated:

    * ``q`` given: node i's children were drawn i.i.d. (with replacement) from ``q[i]``
      (the recursion keeps q fixed; the proof is by induction on the number of children, Leviathan's
      argument with p replaced by the residual).
    * ``q=None``: the children were chosen deterministically (top-k of the draft: Medusa, EAGLE-2,
      SGLang); each candidate acts as a one-hot q: accept x with probability ``r(x)``, on rejection
      set ``r(x) = 0`` and renormalise.

    Cost: one gather and one host copy for every node's first-try acceptance probability, one
    ``torch.rand(N)``, then work only along the accepted path: one V-sized residual (and one scalar
    copy) per rejected sibling, one ``torch.multinomial`` at the end. Never a loop over V.

    Args:
        p: ``[N, V]`` float target distributions (after :func:`~selfspec.decode.sampling.process_logits`
            and :func:`~selfspec.decode.sampling.probs_from_logits`), rows summing to 1.
        tree_tokens: LongTensor ``[N]``; ``tree_tokens[0]`` (the root) is not used.
        parents: LongTensor ``[N]``, ``parents[0] = -1``, ``parents[i] < i``.
        q: ``[N, V]`` float draft distributions (rows of leaves unused), or None (deterministic
            candidates, see above).
        generator: a ``torch.Generator`` on p's device (None: torch's default), or any
            :class:`RandomSource` (tests use one that enumerates all outcomes).
        host: the same tree already read to the host (:func:`~selfspec.decode.host.read_tree`): no copy of it.

    Returns:
        :class:`VerifyResult`.

    Raises:
        ValueError: bad shapes or an invalid ``parents``.
        TypeError: ``generator`` is neither a ``torch.Generator`` nor a :class:`RandomSource`.
    """
    tokens, parent_list = _check_tree(tree_tokens, parents, host)
    n = len(parent_list)
    _check_rows("p", p, n)
    if q is not None:
        _check_rows("q", q, n)
        if q.shape[1] != p.shape[1]:
            raise ValueError(f"p and q must have the same vocabulary size, got {p.shape[1]} and {q.shape[1]}")
    source = _as_source(generator, n, p.device)
    path, next_token = _rejection_walk(p, tokens, parent_list, q, source)
    return _result(path, next_token, parents.device)


def verify_chain_sampling(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | RandomSource | None = None,
) -> tuple[int, int]:
    """Speculative sampling of a chain of K drafts (Leviathan et al. 2023 Alg. 1; Chen et al. 2023).

    Draft ``d_k`` is kept with probability ``min(1, p_{k-1}(d_k) / q_{k-1}(d_k))`` while all before it
    were kept; at the first rejection the next token is drawn from ``norm(max(p - q, 0))``; if all K are
    kept, a bonus token is drawn from ``p_K``. The same code as :func:`verify_tree_sampling` on the
    chain ``parents = [-1, 0, 1, ..., K-1]``.

    Args:
        p: ``[K+1, V]`` target distributions; row k follows the k-th token of ``[root, d_1, ..., d_K]``.
        q: ``[K, V]`` draft distributions; ``d_{k+1} ~ q[k]``.
        draft_tokens: LongTensor ``[K]``.
        generator: a ``torch.Generator`` on p's device, None, or a :class:`RandomSource`.

    Returns:
        ``(num_accepted, next_token)``; the step emits ``num_accepted + 1`` tokens.

    Raises:
        ValueError: shapes disagree.
        TypeError: bad ``generator``.
    """
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point():
        raise ValueError(f"draft_tokens must be an integer tensor [K], got {tuple(draft_tokens.shape)}")
    k = draft_tokens.numel()
    _check_rows("p", p, k + 1)
    _check_rows("q", q, k)
    if q.shape[1] != p.shape[1]:
        raise ValueError(f"p and q must have the same vocabulary size, got {p.shape[1]} and {q.shape[1]}")
    tokens = [0] + draft_tokens.tolist()
    parent_list = list(range(-1, k))
    source = _as_source(generator, k + 1, p.device)
    path, next_token = _rejection_walk(p, tokens, parent_list, q, source)  # q's K rows: the non-leaf nodes
    return len(path) - 1, next_token


def _rejection_walk(
    p: torch.Tensor,
    tokens: list[int],
    parent_list: list[int],
    q: torch.Tensor | None,
    source: RandomSource,
) -> tuple[list[int], int]:
    """The recursion of :func:`verify_tree_sampling`; returns (accepted path, next token)."""
    n = len(parent_list)
    children = _children(parent_list)
    first_try: list[float] = []
    if n > 1:
        # First-try acceptance probability of every draft node, against the untouched p of its parent.
        parent_idx, token_idx = to_device([parent_list[1:], tokens[1:]], p.device)  # one copy, [2, N - 1]
        p_x = p[parent_idx, token_idx]
        q_x = torch.ones_like(p_x) if q is None else q[parent_idx, token_idx].to(p_x.dtype)
        probs = acceptance_probability(p_x, q_x)
        if isinstance(source, GeneratorSource) and source._uniforms is None:
            # The first accept draws the uniforms anyway, before any categorical draw: draw them now and read
            # them with the probabilities in one copy (float32 -> float64 is exact, so the decisions are the same).
            values = torch.cat([probs.to(torch.float64), source.draw()]).tolist()
            first_try = [math.nan] + values[: n - 1]
            source._uniforms = values[n - 1 :]
        else:
            first_try = [math.nan] + probs.tolist()

    node, path = 0, [0]
    while True:
        kids = children[node]
        if not kids:
            return path, source.categorical(p[node])  # bonus token at a leaf
        r = p[node]  # the current target: p at u, then the residual after each rejected sibling
        q_u = None if q is None else q[node].to(r.dtype)
        accepted = None
        for j, child in enumerate(kids):
            x = tokens[child]
            if j == 0:
                prob = first_try[child]
            else:
                prob = float(acceptance_probability(r[x], r.new_ones(()) if q_u is None else q_u[x]))
            if source.accept(child, prob):
                accepted = child
                break
            if q_u is None:  # a deterministic candidate acts as a one-hot draft distribution
                one_hot = torch.zeros_like(r)
                one_hot[x] = 1.0
                r = residual_distribution(r, one_hot)
            else:
                r = residual_distribution(r, q_u)
        if accepted is None:
            return path, source.categorical(r)  # correction from the residual
        path.append(accepted)
        node = accepted


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
    to the target's sampling distribution; the default sampling verifier is :func:`verify_tree_sampling`.

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
    tokens, parent_list = _check_tree(tree_tokens, parents, host)
    n = len(parent_list)
    _check_rows("p", p, n)
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
    return _result(path, next_token, parents.device)
