"""Tree attention masks per attention-layer type, so every layer of a target sees exactly the keys plain
decoding gives it.

A target's layers attend in one of two ways this project verifies: ``"full_attention"`` (every earlier
token) and ``"sliding_attention"`` (the last W tokens, the query included: key position ``k`` is visible
from query position ``q`` iff ``q - W < k <= q``, the rule of ``transformers``'
``masking_utils.sliding_window_overlay``). The cache of a decode keeps every key of every layer
(:func:`selfspec.decode.kv.new_cache`), so a sliding layer is restricted by its mask alone; masked keys
get zero weight, so the result is the one a cache holding only the window gives.

A tree node at depth d sits at position ``past_length + d`` (:func:`~selfspec.decode.tree.tree_position_ids`),
exactly where plain decoding of its branch puts it; the window is applied to those positions, so deep
trees also drop their own oldest ancestors once the branch outgrows the window.

Layers with a recurrent or convolution state (:mod:`selfspec.decode.state`) take no mask; a target with such layers
is verified on chains only (:attr:`AttentionLayout.chains_only`), where the model builds its own masks.

``transformers`` models with mixed layer types (Qwen2, Gemma-2, Gemma-3, ...) take a mapping
``{layer type: 4-D mask}`` as ``attention_mask``; models of one layer type take the 4-D mask itself.
:func:`tree_attention_masks` returns whichever the layout calls for. Pure functions of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec.decode.host import to_device
from selfspec.decode.state import STATE_LAYER_TYPES
from selfspec.decode.tree import ancestor_mask, tree_depths

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FULL = "full_attention"
SLIDING = "sliding_attention"
SUPPORTED_LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class AttentionLayout:
    """How a target's layers attend, as far as the tree mask is concerned.

    Attributes:
        layer_types: one entry per decoder layer, each in :data:`SUPPORTED_LAYER_TYPES` or
            :data:`~selfspec.decode.state.STATE_LAYER_TYPES` (a layer with a recurrent / convolution state).
        sliding_window: W, tokens a sliding layer sees (the query included); None without sliding layers.
    """

    layer_types: tuple[str, ...]
    sliding_window: int | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The attention layer types present, in :data:`SUPPORTED_LAYER_TYPES` order (those the masks are for)."""
        return tuple(t for t in SUPPORTED_LAYER_TYPES if t in self.layer_types)

    @property
    def chains_only(self) -> bool:
        """Whether some layer keeps a state (:mod:`selfspec.decode.state`): drafts are then verified as a chain, one
        prompt at a time, the state rolled back after a rejection; never a tree."""
        return any(t in STATE_LAYER_TYPES for t in self.layer_types)


class UnsupportedLayoutError(ValueError):
    """The target's attention layers are of a kind the tree verification cannot mask exactly."""


def config_layer_types(config: PretrainedConfig) -> tuple[list[str], list[dict]]:
    """Layer types and per-layer cache kwargs of a (decoder) config, as ``transformers``' ``DynamicCache``
    reads them (``transformers.cache_utils.get_layer_types_and_kwargs``): ``config.layer_types`` when
    set, else ``"sliding_attention"`` for layers with a ``sliding_window``, ``"chunked_attention"`` with an
    ``attention_chunk_size``, ``"full_attention"`` otherwise; KV-sharing and attention-free layers are
    ``"dummy"``."""
    from transformers.cache_utils import get_layer_types_and_kwargs  # heavy import, only when a layout is read

    return get_layer_types_and_kwargs(config.get_text_config(decoder=True))


def attention_layout(config: PretrainedConfig) -> AttentionLayout:
    """The :class:`AttentionLayout` of a target's config.

    Raises:
        UnsupportedLayoutError: a layer type other than full or sliding attention or a state layer of
            :data:`~selfspec.decode.state.STATE_LAYER_TYPES` (chunked attention, KV-sharing ``"dummy"`` layers,
            attention and a state in one layer (Falcon-H1's ``"hybrid"``), ...), or sliding layers of different
            windows.
    """
    types, kwargs = config_layer_types(config)
    other = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES + STATE_LAYER_TYPES})
    if other:
        raise UnsupportedLayoutError(
            f"layer types {other} (only {' and '.join(SUPPORTED_LAYER_TYPES)} layers, and "
            f"{' or '.join(STATE_LAYER_TYPES)} layers verified as chains, can be verified exactly)"
        )
    windows = {int(kw["sliding_window"]) for t, kw in zip(types, kwargs, strict=True) if t == SLIDING}
    if len(windows) > 1:
        raise UnsupportedLayoutError(f"sliding layers of different windows {sorted(windows)}")
    return AttentionLayout(tuple(types), windows.pop() if windows else None)


def tree_allowed(
    parents: torch.Tensor | Sequence[int], past_length: int, sliding_window: int | None = None
) -> torch.Tensor:
    """Which keys each tree node attends to: the cached prefix and its own ancestors (and itself), within
    the last ``sliding_window`` positions when one is given.

    Args:
        parents: LongTensor ``[N]`` (see :mod:`selfspec.decode.tree`), or its values as ints.
        past_length: tokens in the cache before the tree (positions ``0 .. past_length - 1``).
        sliding_window: W, or None for full attention.

    Returns:
        BoolTensor ``[N, past_length + N]``, True = attend.
    """
    tree = ancestor_mask(parents)
    n = tree.shape[0]
    allowed = torch.cat([torch.ones(n, past_length, dtype=torch.bool), tree], dim=1)
    if sliding_window is not None:
        q_pos = tree_depths(parents) + past_length  # [N]
        k_pos = torch.cat([torch.arange(past_length), q_pos])  # [past + N]
        allowed &= k_pos.unsqueeze(0) > (q_pos.unsqueeze(1) - sliding_window)
    return allowed


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """BoolTensor ``[Q, K]`` -> additive mask ``[1, 1, Q, K]`` of ``0`` (attend) and ``finfo(dtype).min``."""
    bias = torch.zeros(1, 1, *allowed.shape, dtype=dtype)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def tree_attention_masks(
    parents: torch.Tensor | Sequence[int],
    past_length: int,
    dtype: torch.dtype,
    layout: AttentionLayout,
    device: torch.device | str = "cpu",
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` that verifies a tree after ``past_length`` cached tokens on every layer.

    Args:
        parents: LongTensor ``[N]``, or its values as ints (no host read then).
        past_length: cached prefix length.
        dtype: the model's compute dtype.
        layout: the target's :class:`AttentionLayout`.
        device: where the masks go (built on the host; on CUDA copied from pinned memory without blocking).

    Returns:
        One additive mask ``[1, 1, N, past_length + N]`` (``dtype``) when every layer is of one type, else
        ``{"full_attention": mask, "sliding_attention": mask}`` (the mapping ``transformers`` models with
        mixed layers accept).
    """
    masks = {}
    for kind in layout.kinds:
        window = layout.sliding_window if kind == SLIDING else None
        masks[kind] = to_device(additive(tree_allowed(parents, past_length, window), dtype), device)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


def block_allowed(
    key_positions: torch.Tensor,
    parents: Sequence[torch.Tensor | Sequence[int]],
    node_positions: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Which keys each node of a batched block attends to (ragged rows of a batch, one tree per row).

    Row b's cache holds keys at slots whose positions are ``key_positions[b]`` (``-1``: an empty slot, a
    hole left by a rejected draft or by a shorter row; never attended). Row b's block holds the tree of
    ``len(parents[b])`` nodes, then padding nodes up to Q, which attend only to themselves (so every query
    has a key; their outputs are discarded). A real node attends to every filled slot of its row and to
    its own ancestors (and itself); with ``sliding_window`` W only to keys at positions ``p`` with
    ``q - W < p`` (positions, not slots: holes do not count).

    Args:
        key_positions: LongTensor ``[B, K]``.
        parents: B LongTensors ``[N_b]`` (CPU) or their values as ints (no host read then), ``N_b <= Q``, each a tree.
        node_positions: LongTensor ``[B, Q]``, the position of every block node (padding: any).
        sliding_window: W, or None for full attention.

    Returns:
        BoolTensor ``[B, Q, K + Q]``, True = attend.
    """
    b, k = key_positions.shape
    q = node_positions.shape[1]
    tree = torch.zeros(b, q, q, dtype=torch.bool)
    for row, par in enumerate(parents):
        n = len(par)
        tree[row, :n, :n] = ancestor_mask(par)
        tree[row, n:, n:] = torch.eye(q - n, dtype=torch.bool)
    real = torch.arange(q).unsqueeze(0) < torch.tensor([len(p) for p in parents]).unsqueeze(1)  # [B, Q]
    prefix = (key_positions.cpu() >= 0).unsqueeze(1) & real.unsqueeze(2)  # [B, Q, K]
    allowed = torch.cat([prefix, tree], dim=2)
    if sliding_window is not None:
        q_pos = node_positions.cpu()
        k_pos = torch.cat([key_positions.cpu(), q_pos], dim=1)  # [B, K + Q]
        allowed &= k_pos.unsqueeze(1) > (q_pos.unsqueeze(2) - sliding_window)
    return allowed


def block_attention_masks(
    key_positions: torch.Tensor,
    parents: Sequence[torch.Tensor | Sequence[int]],
    node_positions: torch.Tensor,
    dtype: torch.dtype,
    layout: AttentionLayout,
    device: torch.device | str = "cpu",
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` of a batched block forward (see :func:`block_allowed`).

    Returns:
        One additive mask ``[B, 1, Q, K + Q]`` (``dtype``: 0 attend, ``finfo(dtype).min`` blocked) when every
        layer is of one type, else ``{"full_attention": mask, "sliding_attention": mask}``.
    """
    masks = {}
    for kind in layout.kinds:
        window = layout.sliding_window if kind == SLIDING else None
        allowed = block_allowed(key_positions, parents, node_positions, window)
        bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        masks[kind] = bias.unsqueeze(1).to(device)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks
