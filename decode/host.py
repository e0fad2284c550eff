"""The host side of a speculation step: the draft tree's structure read once, small index tensors sent back.

On a GPU every read of a device tensor's values (``tolist``, ``item``, ``bool``, ``int``, ``.cpu()``) waits
for the device to finish all queued work: a host synchronisation. The decode loop needs the tree's structure
on the host (positions, the tree mask, the acceptance walk, the accepted tokens, the cache compaction); it
reads parents and tokens in one copy per step (:func:`read_tree`) and hands that copy (:class:`HostTree`)
to every part that needs it. What goes back to the device (positions, accepted node indices, the step's
new tokens) goes as one small tensor each, copied from pinned memory without blocking (:func:`to_device`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.decode.tree import DraftTree, depths_of


@dataclass(frozen=True)
class HostTree:
    """A draft tree of N nodes as Python lists (conventions of :mod:`selfspec.decode.tree`).

    Attributes:
        tokens: the N token ids, node 0 the root.
        parents: the N parent indices, ``parents[0] = -1``.
        depths: the N node depths, the root 0.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        """Whether node i's parent is node i - 1 for every i (the root alone is a chain)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def cut(self, max_depth: int) -> tuple[HostTree, list[int]]:
        """The tree without its nodes deeper than ``max_depth``, node order kept; and the kept node indices."""
        kept = [i for i, d in enumerate(self.depths) if d <= max_depth]
        new_index = {old: new for new, old in enumerate(kept)}
        parents = [new_index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept]
        return HostTree([self.tokens[i] for i in kept], parents, [self.depths[i] for i in kept]), kept


def cut_tree(tree: DraftTree, host: HostTree, max_depth: int) -> tuple[DraftTree, HostTree]:
    """The draft tree without its nodes deeper than ``max_depth`` (:meth:`HostTree.cut`).

    Ancestors of a kept node are shallower, so what remains is a tree, in the same node order. Exact under
    sampling too: which nodes go depends only on depth, never on the drafted tokens' values, and a node left
    without children proposes nothing. Nothing is read from the device: the kept indices and the new parents
    go there as one small tensor each.

    Args:
        tree: the step's draft, ``N`` nodes.
        host: its structure on the host (:func:`read_tree`).
        max_depth: >= 0; 0 keeps only the root.

    Returns:
        ``(tree, host)`` of ``M <= N`` nodes; the same objects when nothing is cut.
    """
    cut, kept = host.cut(max_depth)
    if len(kept) == host.num_nodes:
        return tree, host
    device = tree.tokens.device
    index = to_device(kept, device)
    q = None if tree.q is None else tree.q[index.to(tree.q.device)]
    parents = to_device(cut.parents, tree.parents.device)
    return DraftTree(tokens=tree.tokens[index], parents=parents, q=q), cut


def read_tree(tokens: torch.Tensor, parents: torch.Tensor) -> HostTree:
    """``tokens`` and ``parents`` (LongTensors ``[N]``) on the host: one copy when both live on one device
    (stacked there first), two otherwise. Shapes are not checked here (the verifiers check them)."""
    if tokens.device == parents.device and tokens.shape == parents.shape and tokens.dim() == 1:
        token_list, parent_list = torch.stack((tokens.long(), parents.long())).tolist()
    else:
        token_list, parent_list = tokens.tolist(), parents.tolist()
    return HostTree(token_list, parent_list, depths_of(parent_list))


def to_device(values: Sequence[int] | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``values`` (ints, or a CPU tensor) as a tensor on ``device`` (a list becomes a LongTensor ``[n]``).

    On CUDA the host tensor is pinned and copied with ``non_blocking=True``, so the host does not wait for
    the device's queue; the pinned buffer stays allocated until the copy is done (PyTorch's caching host
    allocator records the copy's stream). Elsewhere a plain ``.to(device)``.
    """
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
