"""The verification engine: the target's forward passes of a decode (prefill, tree verification, logits).

A :class:`Verifier` wraps a frozen ``transformers`` causal LM and owns what makes its verification fast
on this machine: a kernel plan (tree size -> one of :data:`~selfspec.decode.cpu_linear.LINEAR_KERNELS`)
and the oneDNN-packed weight copies that plan needs. Nothing is stored on or set on the target: the
plan is applied for the duration of one tree forward by a ``TorchFunctionMode``
(:class:`~selfspec.decode.cpu_linear.LinearRouter`) that reroutes ``F.linear`` for the packed weights.

Everything goes through the model's public ``forward``: token ids, a ``DynamicCache``, explicit
``position_ids`` and, for trees, a custom 4-D additive attention mask (tree attention, Miao et al. 2024,
"SpecInfer"; Cai et al. 2024, "Medusa").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from selfspec.decode import cpu_linear
from selfspec.decode.kv import backbone, call_with_cache, new_cache
from selfspec.decode.tree import tree_attention_bias, tree_position_ids

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


class Verifier:
    """The target's forwards for speculative decoding, with the CPU linear kernels of a plan.

    Args:
        target: the frozen ``transformers`` causal LM (batch size 1).
        plan: ``{tree size N: kernel}``; sizes not in it use plain ``linear``. See :meth:`set_plan`.

    Attributes:
        target: the wrapped model (never modified).

    Raises:
        ValueError, RuntimeError: see :meth:`set_plan`.
    """

    def __init__(self, target: PreTrainedModel, plan: Mapping[int, str] | None = None) -> None:
        self.target = target
        self._linears: tuple[torch.nn.Linear, ...] = tuple(
            m for m in backbone(target).modules() if type(m) is torch.nn.Linear
        )
        self._plan: dict[int, str] = {}
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # id(weight) -> (weight, packed)
        self._packed_head: torch.Tensor | None = None
        self._weight_first = frozenset(id(m.weight) for m in self._linears)
        if plan:
            self.set_plan(plan)

    # ------------------------------------------------------------------ plan
    @property
    def plan(self) -> dict[int, str]:
        """The kernel plan in use (sizes with a kernel other than ``linear``), sorted by size."""
        return dict(self._plan)

    @property
    def packed_bytes(self) -> int:
        """Bytes held by packed weight copies (0 when none)."""
        if self._packed is None:
            return 0
        return sum(p.numel() * p.element_size() for _, p in self._packed.values()) + (
            self._packed_head.numel() * self._packed_head.element_size()
        )

    def linear_weight_bytes(self) -> int:
        """Bytes of the backbone's linear weights plus the lm_head weight: what packing copies."""
        head = self.target.get_output_embeddings()
        return sum(m.weight.numel() * m.weight.element_size() for m in self._linears) + (
            head.weight.numel() * head.weight.element_size()
        )

    def packed_available(self) -> bool:
        """Whether the ``"packed"`` kernel can serve this target: on a CPU, float32 weights, oneDNN built
        into torch, and at most :data:`~selfspec.decode.cpu_linear.PACKED_MAX_BYTES` of weights to copy."""
        p = next(self.target.parameters())
        if p.device.type != "cpu" or p.dtype != torch.float32 or not cpu_linear.packed_available():
            return False
        return self.linear_weight_bytes() <= cpu_linear.PACKED_MAX_BYTES

    def set_plan(self, plan: Mapping[int, str], keep_packed: bool = False) -> None:
        """Choose which kernel computes the backbone's linears (and the lm_head in :meth:`lm_logits`) when
        a tree of N nodes is verified: ``plan`` maps N to one of ``cpu_linear.LINEAR_KERNELS``. Sizes not
        in ``plan`` use plain ``linear``; ``"weight_first"`` is ignored outside ``2..WEIGHT_FIRST_MAX_ROWS``.

        The first size planned as ``"packed"`` packs a copy of every backbone linear weight and of the
        lm_head weight (float32, as much memory again, held here); planning no ``"packed"`` size frees
        them, unless ``keep_packed`` (used while measuring, to switch plans without repacking). The
        weights must not change while packed: plan no ``"packed"`` size, then plan again, to repack.

        Raises:
            ValueError: a size that is not a positive integer, or an unknown kernel name.
            RuntimeError: ``"packed"`` where :meth:`packed_available` is False.
        """
        clean: dict[int, str] = {}
        for n, kernel in plan.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"tree sizes must be positive integers, got {n!r}")
            if kernel not in cpu_linear.LINEAR_KERNELS:
                raise ValueError(f"unknown linear kernel {kernel!r}; choose from {', '.join(cpu_linear.LINEAR_KERNELS)}")
            if kernel != "linear" and cpu_linear.kernel_applies(kernel, n):
                clean[n] = kernel
        wanted = "packed" in clean.values()
        if wanted and self._packed is None:
            if not self.packed_available():
                raise RuntimeError(
                    "packed linears need a float32 model on a CPU, a torch built with oneDNN (torch.backends.mkldnn) "
                    f"and at most {cpu_linear.PACKED_MAX_BYTES >> 30} GiB of linear weights; plan 'linear' or "
                    "'weight_first' instead"
                )
            self._packed = {id(m.weight): (m.weight, cpu_linear.pack_weight(m.weight)) for m in self._linears}
            self._packed_head = cpu_linear.pack_weight(self.target.get_output_embeddings().weight)
        elif self._packed is not None and not wanted and not keep_packed:
            self._packed = self._packed_head = None
        self._plan = dict(sorted(clean.items()))

    def kernel_for(self, rows: int) -> str:
        """The kernel a verification of ``rows`` nodes uses now: the plan's, or ``"linear"`` when the
        target was moved off the CPU or (for ``"packed"``) cast from float32 after planning."""
        kernel = self._plan.get(rows, "linear")
        if kernel == "linear":
            return kernel
        p = next(self.target.parameters())
        if p.device.type != "cpu" or (kernel == "packed" and (p.dtype != torch.float32 or self._packed is None)):
            return "linear"
        return kernel

    def _router(self, kernel: str) -> cpu_linear.LinearRouter:
        if kernel == "packed":
            return cpu_linear.LinearRouter(packed=self._packed)
        return cpu_linear.LinearRouter(weight_first=self._weight_first)

    # ------------------------------------------------------------------ forwards
    def new_cache(self) -> DynamicCache:
        """A fresh ``DynamicCache`` for the target."""
        return new_cache(self.target)

    def prefill(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Run the prompt through the target, filling ``cache``.

        Args:
            input_ids: LongTensor ``[T]``.
            cache: an empty ``DynamicCache``.

        Returns:
            Last hidden states after the final norm, ``[T, D]`` in the model dtype.
        """
        out = call_with_cache(backbone(self.target), cache, input_ids=input_ids.unsqueeze(0))
        return out.last_hidden_state[0]

    def forward_tree(
        self, tokens: torch.Tensor, parents: torch.Tensor, cache: DynamicCache, past_length: int
    ) -> torch.Tensor:
        """Verify a whole draft tree in one target forward (tree attention), with the planned kernel.

        Args:
            tokens: LongTensor ``[N]``, node 0 the root.
            parents: LongTensor ``[N]`` (see :mod:`selfspec.decode.tree`).
            cache: ``DynamicCache`` holding exactly ``past_length`` tokens; grows by N.
            past_length: cached prefix length.

        Returns:
            Hidden states ``[N, D]`` (after the final norm, model dtype) at every node; node i has
            attended to the prefix and its own ancestors only.
        """
        dtype = next(self.target.parameters()).dtype
        device = tokens.device
        n = tokens.numel()
        if n == 1 or bool((parents[1:] == torch.arange(n - 1, device=parents.device)).all()):
            # A chain: the ordinary causal mask is the tree mask; let the model build it (fast path).
            positions = torch.arange(past_length, past_length + n, device=device).unsqueeze(0)
            mask = None
        else:
            positions = tree_position_ids(parents.cpu(), past_length).to(device)
            mask = tree_attention_bias(parents.cpu(), past_length, dtype).to(device)
        kwargs = dict(input_ids=tokens.unsqueeze(0), attention_mask=mask, position_ids=positions)
        kernel = self.kernel_for(n)
        if kernel == "linear":
            out = call_with_cache(backbone(self.target), cache, **kwargs)
        else:
            with self._router(kernel):
                out = call_with_cache(backbone(self.target), cache, **kwargs)
        return out.last_hidden_state[0]

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target logits from last hidden states: ``[N, D] -> [N, V]`` float32.

        For 2..32 rows on a CPU the product is ``W @ h^T`` (:func:`~selfspec.decode.cpu_linear.project`);
        where the plan has ``"packed"`` for N rows, oneDNN computes it on the packed lm_head weight.
        Same math, another summation order.
        """
        head = self.target.get_output_embeddings()
        if self._packed_head is not None and hidden.dim() == 2 and self.kernel_for(hidden.shape[0]) == "packed":
            return cpu_linear.packed_linear(hidden, self._packed_head, head.bias).float()
        if head.bias is None:
            return cpu_linear.project(hidden, head.weight).float()
        return head(hidden).float()


def as_verifier(target: PreTrainedModel | Verifier) -> Verifier:
    """``target`` itself when it is a :class:`Verifier`, else a plain one (no kernel plan) around it."""
    return target if isinstance(target, Verifier) else Verifier(target)
