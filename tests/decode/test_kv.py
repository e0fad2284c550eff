"""decode/kv.py: compacting and cropping a hand-built DynamicCache keeps exactly the expected positions,
in every layer."""

from __future__ import annotations

import torch

from selfspec.decode.kv import compact_cache, crop_cache
from tests.helpers.caches import hand_built_cache, positions


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
