"""A hand-built KV cache whose entries name their own positions, for the cache-editing tests."""

from __future__ import annotations

import torch

from selfspec.decode.kv import new_cache
from tests.helpers.archs import tiny_llama


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
