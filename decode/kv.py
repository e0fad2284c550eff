"""The only place (with generate.py) that calls the target: prefill, tree verification, KV compaction.

Everything goes through the model's public ``forward`` (``transformers`` ``PreTrainedModel``): token ids,
a ``DynamicCache``, explicit ``position_ids`` and, for trees, a custom 4-D additive attention mask.
No modeling file is copied or patched. One CPU measure (:func:`weight_first_linears`): while a small tree
is verified, the backbone's ``nn.Linear`` modules may compute ``W @ x^T`` instead of ``x @ W^T``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterable, Iterator

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
    with weight_first_linears(model, tokens.numel()):
        out = call_with_cache(
            backbone(model), cache, input_ids=tokens.unsqueeze(0), attention_mask=mask, position_ids=positions
        )
    return out.last_hidden_state[0]


# ------------------------------------------------------------------------------------------------
# Small-row products on a CPU
#
# ``linear(x, W)`` with 2..32 rows of x is a GEMM whose BLAS kernel packs the [out, in] weight on every
# call; for M = 1 torch takes a GEMV that streams it once. On the 2-core AVX2 development machine a
# SmolLM2-135M forward measured 79 ms for 1 token, 107 for 2 and 111 for 4 (fp32): a 4-node tree cost 1.40
# plain steps, mostly in the linears. ``torch.mm(W, x.T)`` (BLAS sees a wide right operand and does not pack
# W) brought 2 and 4 tokens to 93 and 94 ms, but was slower at 6 and 12 tokens. Which sizes gain depends
# on the BLAS and the CPU, so :func:`selfspec.decode.budget.measure_cost_profile` measures both ways per
# tree size and :func:`set_weight_first_sizes` installs the winners on the target.

WEIGHT_FIRST_MAX_ROWS = 32
_PLAN_ATTR = "selfspec_weight_first_sizes"


def _weight_first_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` as ``W @ x^T`` (same math, another summation order)."""
    y = project(x.reshape(-1, self.in_features), self.weight)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], self.out_features)


def set_weight_first_sizes(model, sizes: Iterable[int]) -> None:
    """Install the tree sizes (token rows per verification) at which :func:`forward_tree` computes the
    backbone's linears as ``W @ x^T`` (see :func:`weight_first_linears`). An empty ``sizes`` restores plain
    ``linear`` everywhere. Sizes outside ``2..WEIGHT_FIRST_MAX_ROWS`` are ignored.

    Raises:
        ValueError: a size that is not an integer.
    """
    clean = set()
    for n in sizes:
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"tree sizes must be integers, got {n!r}")
        if 2 <= n <= WEIGHT_FIRST_MAX_ROWS:
            clean.add(n)
    # The backbone's linears are listed once here, not at every verification.
    linears = tuple(m for m in backbone(model).modules() if type(m) is torch.nn.Linear) if clean else ()
    setattr(model, _PLAN_ATTR, (frozenset(clean), linears))


def weight_first_sizes(model) -> frozenset[int]:
    """The sizes installed by :func:`set_weight_first_sizes` (empty when none were)."""
    return getattr(model, _PLAN_ATTR, (frozenset(), ()))[0]


@contextlib.contextmanager
def weight_first_linears(model, rows: int) -> Iterator[bool]:
    """While the block runs, compute every ``nn.Linear`` of ``model``'s backbone as ``W @ x^T`` if ``rows``
    is one of the model's installed sizes (:func:`set_weight_first_sizes`) and the model is on a CPU;
    otherwise change nothing. The modules are restored on exit, also when the block raises.

    Yields:
        Whether the weight-first products are in use.
    """
    sizes, installed = getattr(model, _PLAN_ATTR, (frozenset(), ()))
    if rows not in sizes or next(model.parameters()).device.type != "cpu":
        yield False
        return
    # Modules with a forward of their own (e.g. hooks of accelerate's offloading) are left alone.
    linears = [m for m in installed if "forward" not in m.__dict__]
    for m in linears:
        m.forward = _weight_first_forward.__get__(m)
    try:
        yield True
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)


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
