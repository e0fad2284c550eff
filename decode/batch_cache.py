"""The KV cache of a batched decode: ragged rows in one ``DynamicCache``, a slot table saying what is where.

Rows of a batch accept different numbers of tokens per step, so their caches grow unevenly. All rows share
one slot axis (``cache.layers[i].keys``: ``[B, heads, S, head_dim]``); :class:`SlotTable` records the
position each slot of each row holds, ``-1`` for an empty slot. After a block forward (every row's tree
appended at slots ``S .. S + Q - 1``) :meth:`SlotTable.keep` moves each row's accepted nodes to slots
``S .. S + A_b - 1`` and leaves ``S + A_b .. S + A_max - 1`` empty; empty slots are never attended
(:func:`selfspec.decode.masks.block_attention_masks`), and :meth:`SlotTable.pack` squeezes them out
once they add up. A finished row leaves the batch (:meth:`SlotTable.select_rows`), so the cost of a
step follows the rows still decoding.

Every layer must be a plain ``DynamicLayer`` (:func:`selfspec.decode.kv.new_cache`), edited by slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from selfspec.decode.kv import full_layers

if TYPE_CHECKING:
    from transformers import DynamicCache


def _gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t [B, H, S, d]``, ``idx`` LongTensor ``[B, M]`` -> ``[B, H, M, d]`` (slot ``idx[b, m]`` of row b)."""
    b, h, _, d = t.shape
    return t.gather(2, idx.to(t.device)[:, None, :, None].expand(b, h, idx.shape[1], d))


class SlotTable:
    """What each cache slot of each row holds.

    Args:
        batch_size: B.

    Attributes:
        positions: LongTensor ``[B, S]`` (CPU): the token position held at each slot, ``-1`` = empty.
    """

    def __init__(self, batch_size: int) -> None:
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long)

    @property
    def slots(self) -> int:
        """S, the cache's slot count (every layer's length)."""
        return self.positions.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """LongTensor ``[B]``: tokens each row holds (its next position)."""
        return (self.positions >= 0).sum(dim=1)

    def row_lengths(self) -> list[int]:
        """Tokens each row holds, as ints (the table lives on the host: no device is read)."""
        return self.lengths.tolist()

    @property
    def empty_slots(self) -> int:
        """Slots beyond the fullest row's tokens: what :meth:`pack` would free."""
        return self.slots - int(self.lengths.max()) if self.slots else 0

    def keep(self, cache: DynamicCache, accepted: Sequence[torch.Tensor], block_positions: torch.Tensor) -> None:
        """After a block forward of Q nodes per row: keep each row's accepted nodes, in path order.

        Args:
            cache: holds ``S + Q`` slots (the block appended after the table's S).
            accepted: B LongTensors ``[A_b]`` of node indices into the row's block (``A_b >= 1``, increasing
                along the path).
            block_positions: LongTensor ``[B, Q]``, the position of every block node.

        Afterwards the cache holds ``S + max(A_b)`` slots; row b's accepted nodes sit at ``S .. S + A_b - 1``
        and its remaining new slots are empty.
        """
        s = self.slots
        a_max = max(int(a.numel()) for a in accepted)
        idx = torch.zeros(len(accepted), a_max, dtype=torch.long)
        new_pos = torch.full((len(accepted), a_max), -1, dtype=torch.long)
        block_positions = block_positions.cpu()
        for row, acc in enumerate(accepted):
            acc = acc.cpu()
            n = acc.numel()
            idx[row, :n] = acc + s
            idx[row, n:] = s  # a filler copy; the slot is marked empty
            new_pos[row, :n] = block_positions[row, acc]
        contiguous = bool((idx == torch.arange(s, s + a_max)).all())
        for layer in full_layers(cache):
            if layer.keys is None or not layer.keys.numel():
                continue
            if not contiguous:
                layer.keys[:, :, s : s + a_max] = _gather_slots(layer.keys, idx)
                layer.values[:, :, s : s + a_max] = _gather_slots(layer.values, idx)
            layer.crop(s + a_max - layer.get_seq_length())
        self.positions = torch.cat([self.positions, new_pos], dim=1)

    def select_rows(self, cache: DynamicCache, rows: Sequence[int]) -> None:
        """Keep only batch rows ``rows`` (in that order) of the cache and the table."""
        index = torch.tensor(list(rows), dtype=torch.long)
        for layer in full_layers(cache):
            if layer.keys is None or not layer.keys.numel():
                continue
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
            layer.values = layer.values.index_select(0, index.to(layer.values.device))
        self.positions = self.positions.index_select(0, index)
        self.pack(cache)

    def pack(self, cache: DynamicCache) -> None:
        """Squeeze out empty slots: each row's tokens move to its first slots, in position order; the cache
        shrinks to the fullest row's length. Positions (and so attention) are unchanged."""
        if not self.slots:
            return
        lengths = self.lengths
        width = int(lengths.max())
        if width == self.slots:
            return
        order = torch.sort(torch.where(self.positions >= 0, self.positions, self.positions.new_tensor(1 << 62)), dim=1)
        idx = order.indices[:, :width]
        positions = self.positions.gather(1, idx)
        for layer in full_layers(cache):
            if layer.keys is None or not layer.keys.numel():
                continue
            layer.keys = _gather_slots(layer.keys, idx).contiguous()
            layer.values = _gather_slots(layer.values, idx).contiguous()
        self.positions = positions
