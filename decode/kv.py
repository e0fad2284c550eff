"""KV-cache operations of a decode: a fresh ``DynamicCache``, calling a model with one, cropping and
compacting it after a verification.

Every layer of a decode's cache is a plain ``DynamicLayer`` that keeps all its keys and values
(``cache.layers[i].keys`` / ``.values``, ``[B, heads, T, head_dim]``), sliding-window layers included
(they are restricted by their masks, :mod:`selfspec.decode.masks`), so a cache is edited by position and
every layer's own bookkeeping (its length) stays right. The target's forwards live in :mod:`selfspec.decode.verifier`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from selfspec.decode.masks import attention_layout
from selfspec.decode.state import STATE_LAYER_TYPES, is_state_layer, state_cache_layer

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A fresh ``transformers.DynamicCache`` for ``model`` in which every layer keeps every key and value.

    ``DynamicCache(config=...)`` gives sliding-window layers a ``DynamicSlidingWindowLayer`` that keeps only
    the last window of keys and counts tokens on its own; a decode crops and reorders entries by position
    (:func:`compact_cache`, :func:`crop_cache`), which such a layer cannot follow. Here every layer is a plain
    ``DynamicLayer`` (its length is its keys' length, so every edit keeps its bookkeeping) and sliding layers
    are restricted by their mask instead: the model's own sliding-window mask for prompts and chains, and
    :func:`selfspec.decode.masks.tree_attention_masks` for trees. Masked keys get zero weight, so attention
    is the one a windowed cache gives; the memory of a sliding layer grows with the context, like a full one.

    A layer with a recurrent / convolution state (:data:`~selfspec.decode.state.STATE_LAYER_TYPES`) gets a
    ``LinearAttentionLayer`` that records its past (:func:`~selfspec.decode.state.state_cache_layer`), so a crop rolls
    its state back; such a cache is only ever cropped (a chain's accepted prefix), never reordered.

    Raises:
        selfspec.decode.masks.UnsupportedLayoutError: a layer type whose cache is neither keys and values nor a
            state past recording rolls back (KV-sharing layers, chunked attention, ...); see
            :func:`selfspec.decode.masks.attention_layout`.
    """
    from transformers import DynamicCache  # heavy import, only when a cache is made
    from transformers.cache_utils import DynamicLayer

    layout = attention_layout(model.config)
    cache = DynamicCache()
    cache.layers = [state_cache_layer() if t in STATE_LAYER_TYPES else DynamicLayer() for t in layout.layer_types]
    return cache


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


def full_layers(cache: DynamicCache, states: bool = True) -> list:
    """The cache's layers, each checked to keep every key (a plain ``DynamicLayer``, as :func:`new_cache` makes);
    with ``states`` False, its layers of keys and values only (its state layers are edited by crops alone)."""
    from transformers.cache_utils import DynamicLayer  # heavy import, only when a cache is edited

    layers = cache.layers if states else [layer for layer in cache.layers if not is_state_layer(layer)]
    for i, layer in enumerate(layers):
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"cache layer {i} is a {type(layer).__name__}, which does not keep every key by position; "
                "make the cache with selfspec.decode.kv.new_cache"
            )
    return layers


def compact_cache(
    cache: DynamicCache, past_length: int, accepted_nodes: torch.Tensor, path: Sequence[int] | None = None
) -> None:
    """Keep the cached prefix plus the KV entries of the accepted tree nodes, in path order.

    After :meth:`~selfspec.decode.verifier.Verifier.forward_tree` the cache holds ``past_length + N``
    entries; afterwards it holds ``past_length + A`` where ``A = len(accepted_nodes)``. When the accepted
    nodes are already the first A nodes (a chain, or the first branch) this is a pure crop; otherwise A
    entries are moved. Every layer's length is its keys' length, so its bookkeeping stays consistent.

    Args:
        cache: a ``DynamicCache`` from :func:`new_cache`.
        past_length: the prefix length before the tree.
        accepted_nodes: LongTensor ``[A]`` of node indices, starting with 0.
        path: the same indices on the host (:attr:`~selfspec.decode.verify.VerifyResult.path`): then whether
            they are the first A nodes is decided there, with no host read of ``accepted_nodes``.

    Raises:
        TypeError: a layer that is not a plain ``DynamicLayer`` (e.g. a sliding-window layer that has
            dropped keys), which cannot be edited by position.
    """
    a = accepted_nodes.numel()
    if path is None:
        contiguous = bool((accepted_nodes == torch.arange(a, device=accepted_nodes.device)).all())
    else:
        contiguous = all(node == j for j, node in enumerate(path))
    keep = past_length + a
    src = None if contiguous else (accepted_nodes + past_length)
    states = [layer for layer in cache.layers if is_state_layer(layer)]
    if states and not contiguous:
        raise TypeError("a cache with recurrent / convolution states keeps a chain's prefix only, never other nodes")
    for layer in states:
        layer.crop(keep - int(layer.get_seq_length()))  # restores the recorded state of the kept prefix
    moved: dict[torch.device, torch.Tensor] = {}  # src on each device the layers live on, moved once
    for layer in full_layers(cache, states=False):
        if layer.keys is None or not layer.keys.numel():
            continue
        if src is not None:
            dev = layer.keys.device
            idx = moved.get(dev)
            if idx is None:
                idx = moved[dev] = src if src.device == dev else src.to(dev)
            layer.keys[:, :, past_length:keep] = layer.keys.index_select(2, idx)
            layer.values[:, :, past_length:keep] = layer.values.index_select(2, idx)
        layer.crop(keep - layer.get_seq_length())


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` cached tokens of every layer (each layer's own ``crop``).

    A sliding-window layer (``DynamicSlidingWindowLayer``, as ``DynamicCache(config=...)`` makes for some
    models) is cropped only while it still holds every token it has seen; once it has dropped keys the crop
    cannot be exact and is refused.

    Raises:
        TypeError: a sliding-window layer that has dropped keys, or a layer type without keys and values.
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # heavy import, only when used

    for i, layer in enumerate(cache.layers):
        if is_state_layer(layer):  # rolled back to its recorded state of ``length`` tokens
            if length < int(layer.get_seq_length()):
                layer.crop(length - int(layer.get_seq_length()))
            continue
        if not isinstance(layer, DynamicLayer):
            raise TypeError(f"cache layer {i} is a {type(layer).__name__}, which cannot be cropped by position")
        if layer.keys is None or not layer.keys.numel():
            continue
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.get_seq_length() > layer.keys.shape[-2]:
            raise TypeError(
                f"cache layer {i} is a sliding-window layer that has dropped keys; it cannot be cropped to "
                f"{length} tokens (make the cache with selfspec.decode.kv.new_cache)"
            )
        if length < layer.get_seq_length():
            layer.crop(length - layer.get_seq_length())
