"""KV-cache operations of a decode: a fresh ``DynamicCache``, calling a model with one, cropping and
compacting it after a verification.

Works across ``transformers`` versions through public attributes only (``cache.layers[i].keys`` /
``.values``, ``[B, heads, T, head_dim]``). The target's forwards live in :mod:`selfspec.decode.verifier`.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A fresh ``transformers.DynamicCache`` for ``model``."""
    from transformers import DynamicCache  # heavy import, only when a cache is made

    return DynamicCache(config=model.config)


def backbone(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack of a ``*ForCausalLM`` (``model.model`` for Llama-like models)."""
    return model.base_model


@functools.cache
def _cache_kwarg(forward_cls: type) -> str:
    # transformers >= 5.2x renames ``past_key_values`` to ``cache`` (the old name warns).
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def call_with_cache(module: torch.nn.Module, cache: DynamicCache, **kwargs):
    """Call ``module`` (a model or its backbone) with ``cache`` under the keyword this ``transformers`` uses
    (``cache`` from 5.2x on, ``past_key_values`` before); returns the module's output."""
    kwargs[_cache_kwarg(type(module))] = cache
    return module(use_cache=True, **kwargs)


def compact_cache(cache: DynamicCache, past_length: int, accepted_nodes: torch.Tensor) -> None:
    """Keep the cached prefix plus the KV entries of the accepted tree nodes, in path order.

    After :meth:`~selfspec.decode.verifier.Verifier.forward_tree` the cache holds ``past_length + N``
    entries; afterwards it holds ``past_length + A`` where ``A = len(accepted_nodes)``. When the accepted nodes are already the first
    A nodes (a chain, or the first branch) this is a pure crop; otherwise A entries are moved.

    Args:
        cache: ``DynamicCache``.
        past_length: the prefix length before the tree.
        accepted_nodes: LongTensor ``[A]`` of node indices, starting with 0.
    """
    a = accepted_nodes.numel()
    contiguous = bool((accepted_nodes == torch.arange(a, device=accepted_nodes.device)).all())
    keep = past_length + a
    src = None if contiguous else (accepted_nodes + past_length)
    for layer in cache.layers:
        if src is not None:
            idx = src.to(layer.keys.device)
            layer.keys[:, :, past_length:keep] = layer.keys.index_select(2, idx)
            layer.values[:, :, past_length:keep] = layer.values.index_select(2, idx)
        layer.keys = layer.keys[:, :, :keep]
        layer.values = layer.values[:, :, :keep]


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` cached tokens of every layer (works across ``transformers`` versions)."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
