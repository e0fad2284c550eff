"""Draft trees as plain data, and the tensors that let a stock model verify a whole tree in one forward.

A tree has N nodes. Node 0 is the root: the last token already decided (its KV entry is not cached yet).
Nodes 1..N-1 are draft tokens. ``parents[i] < i`` for every non-root node, ``parents[0] = -1``.

Medusa-style static trees are given as a list of index paths: ``(2,)`` is the third candidate of the
first draft position under the root, ``(2, 0)`` the first candidate of the next position under it
(Cai et al. 2024). EAGLE-2 dynamic trees (Li et al. 2024) are built by the drafter directly as
``parents``. Both go through :func:`tree_attention_bias` and :func:`tree_position_ids`, so a tree
costs the target exactly one call to its public ``forward`` with a 4-D attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """One step's draft: what a drafter proposes and the verifier checks.

    Attributes:
        tokens: LongTensor ``[N]``; ``tokens[0]`` is the root (last decided token).
        parents: LongTensor ``[N]``, ``parents[0] = -1``, ``parents[i] < i``.
        q: ``[N, V]`` float32 or None. ``q[i]`` is the distribution node i's children were sampled from
            (i.i.d.); None means the children were chosen deterministically (top-k), which the verifier
            handles as one-hot proposals.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None


def root_only(context: torch.Tensor) -> DraftTree:
    """The tree of the root alone (``context[-1]``): a step of plain decoding."""
    return DraftTree(tokens=context[-1:], parents=torch.tensor([-1], device=context.device))


def chain_parents(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[-1, 0, 1, ..., n - 2]``: the parents of a chain of ``n`` nodes (root included)."""
    return torch.arange(-1, n - 1, device=device)


@dataclass(frozen=True)
class StaticTree:
    """A Medusa-style static tree.

    Attributes:
        paths: the index paths, sorted by (depth, path); node i (i >= 1) is ``paths[i-1]``.
        parents: LongTensor ``[N]``.
        depth: LongTensor ``[N]``, 0 for the root.
        head_index: LongTensor ``[N]``, which draft position (= Medusa head) a node comes from; -1 for root.
        rank: LongTensor ``[N]``, the candidate rank within its head's top-k; -1 for the root.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: torch.Tensor
    depth: torch.Tensor
    head_index: torch.Tensor
    rank: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.parents.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def topk(self) -> int:
        return int(self.rank.max()) + 1 if self.num_nodes > 1 else 1


def static_tree(paths: Sequence[Sequence[int]]) -> StaticTree:
    """Build a :class:`StaticTree` from Medusa index paths.

    Args:
        paths: e.g. ``[(0,), (1,), (0, 0)]``. Every prefix of a path must itself be a path.

    Returns:
        The tree with nodes ordered by (depth, path), so parents always precede children.

    Raises:
        ValueError: empty paths, negative indices, duplicates, or a path whose prefix is missing.
    """
    norm = [tuple(int(i) for i in p) for p in paths]
    if any(len(p) == 0 for p in norm):
        raise ValueError("tree paths must be non-empty (the root is implicit)")
    if any(i < 0 for p in norm for i in p):
        raise ValueError("tree path indices must be >= 0")
    if len(set(norm)) != len(norm):
        raise ValueError("tree paths contain duplicates")
    ordered = sorted(norm, key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(ordered)}
    parents, depth, head, rank = [-1], [0], [-1], [-1]
    for p in ordered:
        parent = index.get(p[:-1], 0) if len(p) > 1 else 0
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {p} has no parent path {p[:-1]}; add it")
        parents.append(parent)
        depth.append(len(p))
        head.append(len(p) - 1)
        rank.append(p[-1])
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return StaticTree(tuple(ordered), as_long(parents), as_long(depth), as_long(head), as_long(rank))


def validate_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless ``parents`` is a LongTensor ``[N]`` with ``parents[0] == -1`` and
    ``0 <= parents[i] < i``."""
    if parents.dim() != 1 or parents.numel() < 1 or parents.dtype != torch.long:
        raise ValueError("parents must be a 1-D LongTensor with at least the root")
    if int(parents[0]) != -1:
        raise ValueError("parents[0] must be -1 (node 0 is the root)")
    idx = torch.arange(parents.numel())
    if parents.numel() > 1 and not bool(((parents[1:] >= 0) & (parents[1:] < idx[1:])).all()):
        raise ValueError("every non-root node needs 0 <= parents[i] < i")


def depths_of(parents: Sequence[int]) -> list[int]:
    """Node depths from parent indices as ints (``parents[i] < i``; the root 0)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_depths(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Depth of each node. ``parents``: LongTensor ``[N]`` (or its values as ints) -> LongTensor ``[N]`` (root 0)."""
    p = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    return torch.tensor(depths_of(p), dtype=torch.long)


def ancestor_mask(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Tree attention pattern: ``mask[i, j]`` is True iff node j is node i or one of its ancestors.

    Args:
        parents: LongTensor ``[N]``, or its values as ints (no host read then).

    Returns:
        BoolTensor ``[N, N]`` (lower-triangular because parents precede children).
    """
    p = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    n = len(p)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[p[i]]
    return mask


def tree_attention_bias(parents: torch.Tensor, past_length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D attention mask for verifying a tree after ``past_length`` cached tokens.

    Every node sees the whole cached prefix and its own ancestors (and itself), nothing else.

    Args:
        parents: LongTensor ``[N]``.
        past_length: number of tokens already in the KV cache.
        dtype: the model's compute dtype (the mask must match it).

    Returns:
        Tensor ``[1, 1, N, past_length + N]`` of ``0`` (attend) and ``finfo(dtype).min`` (blocked), the
        format ``transformers`` models accept as a custom 4-D ``attention_mask``.
    """
    allowed = ancestor_mask(parents)
    n = allowed.shape[0]
    bias = torch.zeros(1, 1, n, past_length + n, dtype=dtype)
    bias[0, 0, :, past_length:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias


def tree_position_ids(parents: torch.Tensor, past_length: int) -> torch.Tensor:
    """Position ids of tree nodes: ``past_length + depth``. Returns LongTensor ``[1, N]``."""
    return (tree_depths(parents) + past_length).unsqueeze(0)


def retrieve_paths(parents: torch.Tensor) -> torch.Tensor:
    """Root-to-leaf node paths (Medusa's retrieve indices).

    Args:
        parents: LongTensor ``[N]``.

    Returns:
        LongTensor ``[L, max_depth + 1]``, one row per leaf in node order, padded with -1.
    """
    n = parents.numel()
    p = parents.tolist()
    is_parent = [False] * n
    for i in range(1, n):
        is_parent[p[i]] = True
    rows = []
    for leaf in (i for i in range(n) if not is_parent[i]):
        path = [leaf]
        while p[path[-1]] != -1:
            path.append(p[path[-1]])
        rows.append(path[::-1])
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


def greedy_tree_from_accuracy(topk_accuracy: Sequence[Sequence[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """Medusa's tree construction: pick the ``num_nodes - 1`` paths with the highest estimated acceptance.

    A path ``(i_0, ..., i_d)`` is accepted with estimated probability ``prod_k a_k[i_k]`` where
    ``a_k[i]`` is head k's probability that its rank-i candidate is right (top-(i+1) minus top-i
    accuracy). Since every prefix of a path scores at least as high, greedy selection keeps the tree
    prefix-closed (Cai et al. 2024, section 3.3.2).

    Args:
        topk_accuracy: ``[K][k]`` cumulative top-1..top-k accuracies per head, each in [0, 1].
        num_nodes: N including the root.

    Returns:
        Index paths for :func:`static_tree`.

    Raises:
        ValueError: ``num_nodes < 1``.
    """
    return [path for path, _ in greedy_tree_scores(topk_accuracy, num_nodes)]


def greedy_tree_scores(topk_accuracy: Sequence[Sequence[float]], num_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """:func:`greedy_tree_from_accuracy`'s paths with their estimated acceptance probabilities, in the
    order chosen (non-increasing scores). ``1 + sum(scores)`` estimates the tree's tau (mean tokens per
    step, bonus token included) under the estimate's independence assumption.

    Raises:
        ValueError: ``num_nodes < 1``.
    """
    if num_nodes < 1:
        raise ValueError("num_nodes must be >= 1")
    marginal = []
    for acc in topk_accuracy:
        prev, row = 0.0, []
        for a in acc:
            row.append(max(float(a) - prev, 1e-6))
            prev = max(prev, float(a))
        marginal.append(row)
    chosen: list[tuple[tuple[int, ...], float]] = []
    frontier = {(i,): marginal[0][i] for i in range(len(marginal[0]))} if marginal else {}
    while len(chosen) < num_nodes - 1 and frontier:
        path = max(frontier, key=lambda p: (frontier[p], [-i for i in p]))
        score = frontier.pop(path)
        chosen.append((path, score))
        d = len(path)
        if d < len(marginal):
            for i in range(len(marginal[d])):
                frontier[path + (i,)] = score * marginal[d][i]
    return chosen
