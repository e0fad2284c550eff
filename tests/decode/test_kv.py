"""decode/kv.py: compacting and cropping a hand-built DynamicCache keeps exactly the expected positions,
in every layer."""

from __future__ import annotations

import torch

from selfspec.decode.kv import compact_cache, crop_cache, new_cache
from tests.conftest import tiny_llama


def hand_built_cache(layers: int = 2, length: int = 9):
    """A DynamicCache whose entry at position t of layer l holds the value ``100 * l + t`` (keys) and
    ``-(100 * l + t)`` (values), shape ``[1, 2, length, 4]``."""
    cache = new_cache(tiny_llama(layers=layers))
    for layer in range(layers):
        pos = torch.arange(length, dtype=torch.float32) + 100 * layer
        k = pos.view(1, 1, length, 1).expand(1, 2, length, 4).contiguous()
        cache.update(k, -k, layer)
    return cache


def positions(cache) -> list[tuple[list[int], list[int]]]:
    return [
        (layer.keys[0, 0, :, 0].long().tolist(), (-layer.values[0, 1, :, 3]).long().tolist()) for layer in cache.layers
    ]


def test_compact_cache_keeps_prefix_and_accepted_nodes_in_path_order():
    cache = hand_built_cache()  # a prefix of 4 tokens, then a tree of 5 nodes at positions 4..8
    compact_cache(cache, 4, torch.tensor([0, 2, 4]))  # accepted path: nodes 0 -> 2 -> 4
    for layer, (keys, values) in enumerate(positions(cache)):
        want = [100 * layer + t for t in (0, 1, 2, 3, 4, 6, 8)]
        assert keys == want and values == want


def test_compact_cache_contiguous_path_is_a_crop():
    cache = hand_built_cache()
    compact_cache(cache, 4, torch.tensor([0, 1, 2]))
    for layer, (keys, values) in enumerate(positions(cache)):
        want = [100 * layer + t for t in range(7)]
        assert keys == want and values == want
    compact_cache(cache, 6, torch.tensor([0]))  # root only
    assert [k for k, _ in positions(cache)] == [[100 * layer + t for t in range(7)] for layer in range(2)]


def test_crop_cache_every_layer():
    cache = hand_built_cache(layers=3)
    crop_cache(cache, 3)
    assert [k for k, _ in positions(cache)] == [[100 * layer + t for t in range(3)] for layer in range(3)]
