"""The batch cache's slot table (``decode/batch_cache.py``) on a hand-built one-layer cache: accepted entries moved
into place, rows dropped, empty slots packed."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from selfspec.decode.batch_cache import SlotTable


def test_slot_table_moves_keeps_and_packs_entries():
    """keep() moves accepted entries into place, select_rows() drops rows, pack() squeezes out empty slots;
    the keys that remain are exactly the accepted ones, by position."""
    cache = type("C", (), {})()
    layer = DynamicLayer()
    keys = torch.arange(2 * 5, dtype=torch.float).reshape(2, 1, 5, 1)  # 2 rows, 5 slots (a block of 5)
    layer.lazy_initialization(keys, keys)
    layer.keys, layer.values = keys.clone(), keys.clone()
    cache.layers = [layer]
    table = SlotTable(2)
    table.keep(cache, [torch.tensor([0, 2, 4]), torch.tensor([0])], torch.tensor([[0, 1, 1, 2, 2], [0, 1, 1, 1, 1]]))
    assert table.positions.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert layer.keys[0, 0, :, 0].tolist() == [0.0, 2.0, 4.0]
    assert layer.keys[1, 0, 0, 0].item() == 5.0
    assert table.empty_slots == 0 and table.lengths.tolist() == [3, 1]
    table.select_rows(cache, [1])
    assert table.positions.tolist() == [[0]] and layer.keys[:, 0, :, 0].tolist() == [[5.0]]
