"""The only place (with generate.py) that calls the target: prefill, tree verification, KV compaction.

Everything goes through the model's public ``forward`` (``transformers`` ``PreTrainedModel``): token ids,
a ``DynamicCache``, explicit ``position_ids`` and, for trees, a custom 4-D additive attention mask.
No modeling file is copied or patched.
"""

from __future__ import annotations

import functools
import inspect

import torch

from selfspec.decode.tree import tree_attention_bias, tree_position_ids


def new_cache(model):
    """A fresh ``transformers.DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def backbone(model):
    """The decoder stack of a ``*ForCausalLM`` (``model.model`` for Llama-like models)."""
    return model.base_model


@functools.lru_cache(maxsize=None)
def _cache_kwarg(forward_cls: type) -> str:
    # transformers >= 5.2x renames ``past_key_values`` to ``cache`` (the old name warns).
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def call_with_cache(module, cache, **kwargs):
    """Call ``module`` (a model or its backbone) with ``cache`` under the keyword this ``transformers`` uses."""
    kwargs[_cache_kwarg(type(module))] = cache
    return module(use_cache=True, **kwargs)


def prefill(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Run the prompt through the target, filling ``cache``.

    Args:
        model: a ``transformers`` causal LM.
        input_ids: LongTensor ``[T]``.
        cache: an empty ``DynamicCache``.

    Returns:
        Last hidden states after the final norm, ``[T, D]`` in the model dtype.
    """
    out = call_with_cache(backbone(model), cache, input_ids=input_ids.unsqueeze(0))
    return out.last_hidden_state[0]


def forward_tree(model, tokens: torch.Tensor, parents: torch.Tensor, cache, past_length: int) -> torch.Tensor:
    """Verify a whole draft tree in one target forward (tree attention).

    Args:
        model: the target.
        tokens: LongTensor ``[N]``, node 0 the root.
        parents: LongTensor ``[N]`` (see :mod:`selfspec.decode.tree`).
        cache: ``DynamicCache`` holding exactly ``past_length`` tokens; grows by N.
        past_length: cached prefix length.

    Returns:
        Hidden states ``[N, D]`` (after the final norm) at every node.
    """
    dtype = next(model.parameters()).dtype
    device = tokens.device
    if parents.numel() == 1 or bool((parents[1:] == torch.arange(parents.numel() - 1, device=parents.device)).all()):
        # A chain: the ordinary causal mask is the tree mask; let the model build it (fast path).
        positions = torch.arange(past_length, past_length + tokens.numel(), device=device).unsqueeze(0)
        mask = None
    else:
        positions = tree_position_ids(parents.cpu(), past_length).to(device)
        mask = tree_attention_bias(parents.cpu(), past_length, dtype).to(device)
    out = call_with_cache(
        backbone(model), cache, input_ids=tokens.unsqueeze(0), attention_mask=mask, position_ids=positions
    )
    return out.last_hidden_state[0]


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Target logits from last hidden states: ``[N, D] -> [N, V]`` float32.

    For 2..32 rows on a CPU the product is taken as ``W @ h^T``: BLAS then streams the ``[V, D]`` weight
    once without packing it, which measured 2-3x faster than ``linear`` for N = 2..8 on a 2-core AVX2
    machine (the lm_head is a fifth of a 135M target's weights). Same math, another summation order.
    """
    head = model.get_output_embeddings()
    if head.bias is None:
        return project(hidden, head.weight).float()
    return head(hidden).float()


def project(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` (``[..., D] x [N, D] -> [..., N]``, in ``hidden``'s dtype), taken as
    ``W @ h^T`` for 2..32 rows on a CPU (see :func:`lm_logits`): same math, another summation order."""
    if hidden.dim() == 2 and 2 <= hidden.shape[0] <= 32 and hidden.device.type == "cpu":
        return torch.mm(weight, hidden.T).T
    return hidden @ weight.T


def compact_cache(cache, past_length: int, accepted_nodes: torch.Tensor) -> None:
    """Keep the cached prefix plus the KV entries of the accepted tree nodes, in path order.

    After :func:`forward_tree` the cache holds ``past_length + N`` entries; afterwards it holds
    ``past_length + A`` where ``A = len(accepted_nodes)``. When the accepted nodes are already the first
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


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` cached tokens of every layer (works across ``transformers`` versions)."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
