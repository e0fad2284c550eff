"""The only place (with generate.py) that calls the target: prefill, tree verification, KV compaction.

Everything goes through the model's public ``forward`` (``transformers`` ``PreTrainedModel``): token ids,
a ``DynamicCache``, explicit ``position_ids`` and, for trees, a custom 4-D additive attention mask.
No modeling file is copied or patched. One CPU measure (:func:`tree_linears`): while a tree is verified,
the backbone's ``nn.Linear`` modules may compute their product with another kernel (``W @ x^T``, or oneDNN
on a weight packed once) where that measured faster.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping

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
    with tree_linears(model, tokens.numel()):
        out = call_with_cache(
            backbone(model), cache, input_ids=tokens.unsqueeze(0), attention_mask=mask, position_ids=positions
        )
    return out.last_hidden_state[0]


# ------------------------------------------------------------------------------------------------
# Small-row products on a CPU: which kernel computes the linears of a tree verification
#
# ``linear(x, W)`` with 2..32 rows of x is a GEMM whose BLAS kernel packs the [out, in] weight on every
# call; for M = 1 torch takes a GEMV that streams it once. On the 2-core AVX2 development machine a
# SmolLM2-135M forward measured 79 ms for 1 token, 107 for 2 and 111 for 4 (fp32): a 4-node tree cost 1.40
# plain steps, mostly in the linears. Two other kernels avoid the per-call packing:
#
# * ``"weight_first"``: ``torch.mm(W, x.T)`` (BLAS sees a wide right operand and does not pack W). It
#   brought 2 and 4 tokens to 93 and 94 ms but was slower at 6 and 12 tokens.
# * ``"packed"``: oneDNN's inner product on a weight reordered ONCE into its blocked layout
#   (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the kernels torch's own CPU
#   compiler uses for frozen linears). It keeps a second copy of the weights (+100 % of the backbone and
#   lm_head weight memory); in the round-5 cost profile 2 / 4 / 8 / 16 nodes cost 70 / 82 / 95 / 125 ms
#   with it, against 76 ms for one plain token.
#
# All three are the same products in other summation orders. Which one wins at which size depends on the
# BLAS, the CPU and the thread count, so :func:`selfspec.decode.budget.measure_cost_profile` measures them
# per tree size and :func:`set_linear_kernels` installs the winners on the target.

LINEAR_KERNELS = ("linear", "weight_first", "packed")
WEIGHT_FIRST_MAX_ROWS = 32
PACKED_MAX_BYTES = 4 << 30  # no second copy of more than 4 GiB of weights
_PLAN_ATTR = "selfspec_linear_kernels"
_PACKED_ATTR = "selfspec_packed_weights"


def _weight_first_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` as ``W @ x^T`` (same math, another summation order)."""
    y = project(x.reshape(-1, self.in_features), self.weight)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], self.out_features)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through oneDNN on the weight packed by :func:`set_linear_kernels`."""
    return _packed_product(x, self.selfspec_packed, self.bias)


def packed_linears_available(model) -> bool:
    """Whether the ``"packed"`` kernel can serve ``model``: on a CPU, float32 weights, oneDNN built into
    torch, and no more than :data:`PACKED_MAX_BYTES` of linear weights to copy."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018  (present in torch builds with oneDNN)
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    total = sum(m.weight.numel() * m.weight.element_size() for m in _linears(model))
    head = model.get_output_embeddings()
    total += head.weight.numel() * head.weight.element_size()
    return total <= PACKED_MAX_BYTES


def _linears(model) -> tuple[torch.nn.Linear, ...]:
    """The backbone's ``nn.Linear`` modules, listed once per model (cached on it)."""
    found = model.__dict__.get("selfspec_linears")
    if found is None:
        found = tuple(m for m in backbone(model).modules() if type(m) is torch.nn.Linear)
        model.__dict__["selfspec_linears"] = found
    return found


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def kernel_applies(kernel: str, rows: int) -> bool:
    """Whether ``kernel`` may serve a verification of ``rows`` nodes: ``"weight_first"`` only at
    ``2..WEIGHT_FIRST_MAX_ROWS`` rows, the others at any size."""
    return kernel != "weight_first" or 2 <= rows <= WEIGHT_FIRST_MAX_ROWS


def set_linear_kernels(model, plan: Mapping[int, str], keep_packed: bool = False) -> None:
    """Install which kernel computes the backbone's linears (and the lm_head in :func:`lm_logits`) when
    :func:`forward_tree` verifies a tree of a given number of nodes: ``plan`` maps a node count to one of
    :data:`LINEAR_KERNELS`. Sizes not in ``plan`` use plain ``linear``; ``"weight_first"`` is ignored
    outside ``2..WEIGHT_FIRST_MAX_ROWS``. An empty ``plan`` restores plain ``linear`` everywhere.

    The first size planned as ``"packed"`` packs a copy of every backbone linear weight and of the lm_head
    weight (float32, as much memory again); planning no ``"packed"`` size frees them, unless
    ``keep_packed`` (used while measuring, to switch plans without repacking). The weights must not
    change while they are packed: plan no ``"packed"`` size, then plan again, to pack the new weights.

    Raises:
        ValueError: a size that is not a positive integer, or an unknown kernel name.
        RuntimeError: ``"packed"`` where :func:`packed_linears_available` is False.
    """
    clean: dict[int, str] = {}
    for n, kernel in plan.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"tree sizes must be positive integers, got {n!r}")
        if kernel not in LINEAR_KERNELS:
            raise ValueError(f"unknown linear kernel {kernel!r}; choose from {', '.join(LINEAR_KERNELS)}")
        if kernel != "linear" and kernel_applies(kernel, n):
            clean[n] = kernel
    packed_wanted = "packed" in clean.values()
    packed_now = getattr(model, _PACKED_ATTR, None) is not None
    if packed_wanted and not packed_now:
        if not packed_linears_available(model):
            raise RuntimeError(
                "packed linears need a float32 model on a CPU, a torch built with oneDNN (torch.backends.mkldnn) "
                f"and at most {PACKED_MAX_BYTES >> 30} GiB of linear weights; plan 'linear' or 'weight_first' instead"
            )
        for m in _linears(model):
            m.selfspec_packed = _pack(m.weight)
        setattr(model, _PACKED_ATTR, _pack(model.get_output_embeddings().weight))
    elif packed_now and not packed_wanted and not keep_packed:
        for m in _linears(model):
            m.__dict__.pop("selfspec_packed", None)
        setattr(model, _PACKED_ATTR, None)
    setattr(model, _PLAN_ATTR, dict(sorted(clean.items())))


def linear_kernels(model) -> dict[int, str]:
    """The plan installed by :func:`set_linear_kernels` (sizes with a kernel other than ``linear``)."""
    return dict(getattr(model, _PLAN_ATTR, {}))


def _kernel_for(model, rows: int) -> str:
    kernel = getattr(model, _PLAN_ATTR, {}).get(rows, "linear")
    if kernel == "linear":
        return kernel
    p = next(model.parameters())
    if p.device.type != "cpu" or (kernel == "packed" and p.dtype != torch.float32):
        return "linear"  # moved or cast after planning: the plan no longer applies
    return kernel


@contextlib.contextmanager
def tree_linears(model, rows: int) -> Iterator[str]:
    """While the block runs, compute every ``nn.Linear`` of ``model``'s backbone with the kernel installed
    for ``rows`` nodes (:func:`set_linear_kernels`) when the model is on a CPU; otherwise change nothing.
    The modules are restored on exit, also when the block raises.

    Yields:
        The kernel in use, one of :data:`LINEAR_KERNELS`.
    """
    kernel = _kernel_for(model, rows)
    if kernel == "linear":
        yield kernel
        return
    forward = _weight_first_forward if kernel == "weight_first" else _packed_forward
    # Modules with a forward of their own (e.g. hooks of accelerate's offloading) are left alone.
    linears = [m for m in _linears(model) if "forward" not in m.__dict__]
    for m in linears:
        m.forward = forward.__get__(m)
    try:
        yield kernel
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Target logits from last hidden states: ``[N, D] -> [N, V]`` float32.

    For 2..32 rows on a CPU the product is taken as ``W @ h^T``: BLAS then streams the ``[V, D]`` weight
    once without packing it, which measured 2-3x faster than ``linear`` for N = 2..8 on a 2-core AVX2
    machine (the lm_head is a fifth of a 135M target's weights). Where :func:`set_linear_kernels` planned
    ``"packed"`` for N nodes, oneDNN computes it on the packed weight instead. Same math, another
    summation order.
    """
    head = model.get_output_embeddings()
    packed = getattr(model, _PACKED_ATTR, None)
    if packed is not None and hidden.dim() == 2 and _kernel_for(model, hidden.shape[0]) == "packed":
        return _packed_product(hidden, packed, head.bias).float()
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
