"""Small-row linear products on a CPU: the kernels a tree verification may use instead of ``F.linear``.

Written against torch 2.13 (CPU build with oneDNN). This is the one file that calls ``torch.ops.mkldnn``:
oneDNN's inner product on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the private kernels torch's own CPU
compiler uses for frozen linears). If a torch release renames them, :func:`packed_available` turns False
and verification falls back to the public kernels; only this file needs porting.

Why: ``linear(x, W)`` with 2..32 rows of x is a GEMM whose BLAS kernel packs the ``[out, in]`` weight on
every call; for one row torch takes a GEMV that streams it once. On the 2-core AVX2 development machine a
SmolLM2-135M forward measured 79 ms for 1 token, 107 for 2 and 111 for 4 (fp32): a 4-node tree cost 1.40
plain steps, mostly in the linears. Two kernels avoid the per-call packing:

* ``"weight_first"``: ``torch.mm(W, x.T)`` (BLAS sees a wide right operand and does not pack W). It brought
  2 and 4 tokens to 93 and 94 ms but was slower at 6 and 12 tokens.
* ``"packed"``: oneDNN on a weight packed once. It keeps a second copy of the weights (+100 % of the
  backbone and lm_head weight memory); in the round-5 cost profile 2 / 4 / 8 / 16 nodes cost 70 / 82 / 95 /
  125 ms with it, against 76 ms for one plain token.

All three are the same products in other summation orders. Which one wins at which size depends on the
BLAS, the CPU and the thread count; :mod:`selfspec.decode.tuning.costs` measures them and
:class:`selfspec.decode.verifier.Verifier` applies the winners by running a twin of the target's
backbone in which every ``nn.Linear`` is a :class:`PackedLinear` or a :class:`WeightFirstLinear` (sharing
the target's tensors): the model's own modules are never patched.
"""

from __future__ import annotations

import torch

TORCH_VERSION_WRITTEN_AGAINST = "2.13"
LINEAR_KERNELS = ("linear", "weight_first", "packed")
WEIGHT_FIRST_MAX_ROWS = 32
PACKED_MAX_BYTES = 4 << 30  # no second copy of more than 4 GiB of weights


def kernel_applies(kernel: str, rows: int) -> bool:
    """Whether ``kernel`` may serve a product of ``rows`` rows: ``"weight_first"`` only at
    ``2..WEIGHT_FIRST_MAX_ROWS`` rows, the others at any size."""
    return kernel != "weight_first" or 2 <= rows <= WEIGHT_FIRST_MAX_ROWS


def project(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` (``[..., D] x [M, D] -> [..., M]``, in ``hidden``'s dtype), taken as ``W @ h^T``
    for 2..32 rows on a CPU: BLAS then streams the weight once without packing it (measured 2-3x faster
    than ``linear`` for 2..8 rows on a 2-core AVX2 machine). Same math, another summation order."""
    if hidden.dim() == 2 and 2 <= hidden.shape[0] <= WEIGHT_FIRST_MAX_ROWS and hidden.device.type == "cpu":
        return torch.mm(weight, hidden.T).T
    return hidden @ weight.T


def weight_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``W @ x^T``: ``x`` ``[..., in]``, ``weight`` ``[out, in]`` ->
    ``[..., out]`` in ``x``'s dtype (same math, another summation order)."""
    y = torch.mm(weight, x.reshape(-1, weight.shape[1]).T).T
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def packed_available() -> bool:
    """Whether this torch has oneDNN and the two private ops :func:`pack_weight` / :func:`packed_linear` use."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018  (present in torch builds with oneDNN)
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU ``[out, in]`` weight reordered into oneDNN's blocked layout (a new tensor of the same
    size; the weight itself is not touched)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` through oneDNN on ``packed = pack_weight(W)``: ``x`` ``[..., in]`` float32 ->
    ``[..., out]`` float32."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` computed by :func:`packed_linear`: holds the original weight and bias (the same
    tensors, not copies) and the weight's packed copy.

    Args:
        linear: the module it stands in for (not modified).
        packed: ``pack_weight(linear.weight)``.

    ``forward``: ``x`` ``[..., in]`` float32 -> ``[..., out]`` float32.
    """

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


class WeightFirstLinear(torch.nn.Module):
    """An ``nn.Linear`` computed by :func:`weight_first_linear` on the original weight and bias (the same
    tensors, not copies).

    Args:
        linear: the module it stands in for (not modified).

    ``forward``: ``x`` ``[..., in]`` -> ``[..., out]`` in ``x``'s dtype.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weight_first_linear(x, self.weight, self.bias)
