"""Lossless speculative sampling of a draft tree (or chain): which drafts to keep, and one more token, with the
output distributed exactly as the target's (conventions of :mod:`selfspec.decode.verify`).

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Alg. 1; Chen et al. 2023) generalised to trees by multi-candidate recursive rejection sampling (Miao et al. 2024,
SpecInfer, Alg. 2 "VerifyStochastic"): :func:`verify_tree_sampling`, :func:`verify_chain_sampling`, built on the
rejection step as small pure functions (:func:`acceptance_probability`, :func:`accept_draft`,
:func:`residual_distribution`). The output has exactly the target's distribution, whatever q is.

Randomness enters only through a :class:`RandomSource`: :class:`GeneratorSource` (a
``torch.Generator``) in production; tests pass a source that enumerates every outcome with its exact
probability, so the losslessness check runs this very code.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from .host import HostTree, to_device
from .sampling import sample
from .verify import VerifyResult, check_rows, check_tree

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


def _children(parent_list: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parent_list]
    for i, parent in enumerate(parent_list[1:], start=1):
        children[parent].append(i)  # increasing node index
    return children


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
    tokens, parent_list = check_tree(tree_tokens, parents, host)
    n = len(parent_list)
    check_rows("p", p, n)
    if q is not None:
        check_rows("q", q, n)
        if q.shape[1] != p.shape[1]:
            raise ValueError(f"p and q must have the same vocabulary size, got {p.shape[1]} and {q.shape[1]}")
    source = _as_source(generator, n, p.device)
    path, next_token = _rejection_walk(p, tokens, parent_list, q, source)
    return VerifyResult.from_path(path, next_token, parents.device)


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
    check_rows("p", p, k + 1)
    check_rows("q", q, k)
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
