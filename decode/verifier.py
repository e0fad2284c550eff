"""The verification engine: the target's forwards of a decode (prefill, tree verification, logits).

A :class:`Verifier` wraps a frozen ``transformers`` causal LM and owns what makes its verification fast
on this machine: a kernel plan (tree size -> one of :data:`~selfspec.base.cpu_linear.LINEAR_KERNELS`),
the oneDNN-packed weight copies that plan needs, and, per kernel in the plan, a *twin* of the target's
backbone: a copy of its module structure that shares every parameter and buffer with the target (no
tensor is copied) and in which every ``nn.Linear`` is one of :mod:`~selfspec.base.cpu_linear`'s kernel
modules. A planned tree forward runs the twin; everything else runs the target's own backbone. Nothing is
stored on or set on the target, and a forward costs nothing beyond its kernels (no per-call patching or
interception).

Everything goes through the model's public ``forward``: token ids, a ``DynamicCache``, explicit
``position_ids`` and, for trees, a custom 4-D additive attention mask (tree attention, Miao et al. 2024,
"SpecInfer"; Cai et al. 2024, "Medusa").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from selfspec.base import cpu_linear
from selfspec.decode.host import HostTree, read_tree, to_device
from selfspec.decode.kv import backbone, call_with_cache, new_cache
from selfspec.decode.masks import FULL, additive, attention_layout, block_attention_masks, tree_attention_masks
from selfspec.decode.tree import ancestor_mask

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

TREE_SHAPES_KEPT = 8  # tree shapes whose depths and ancestor mask stay on the device (see Verifier._tree_block)


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
        self._twins: dict[str, torch.nn.Module] = {}  # kernel -> twin of the backbone
        self._shared: tuple[tuple[dict, str, torch.Tensor], ...] = ()  # what the twins share, see _in_sync
        self._built_for: tuple[torch.device, torch.dtype] | None = None
        self._tree_blocks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # see _tree_block
        # a target with recurrent / convolution state layers is verified on chains, one prompt at a time
        self.chains_only = attention_layout(target.config).chains_only  # (selfspec.decode.state)
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
        into torch, and at most :data:`~selfspec.base.cpu_linear.PACKED_MAX_BYTES` of weights to copy."""
        p = next(self.target.parameters())
        if p.device.type != "cpu" or p.dtype != torch.float32 or not cpu_linear.packed_available():
            return False
        return self.linear_weight_bytes() <= cpu_linear.PACKED_MAX_BYTES

    def set_plan(self, plan: Mapping[int, str], keep_packed: bool = False) -> None:
        """Choose which kernel computes the backbone's linears (and the lm_head in :meth:`lm_logits`) when
        a tree of N nodes is verified: ``plan`` maps N to one of ``cpu_linear.LINEAR_KERNELS``. Sizes not
        in ``plan`` use plain ``linear``; ``"weight_first"`` is ignored outside ``2..WEIGHT_FIRST_MAX_ROWS``.

        Each kernel planned for some size gets one twin of the backbone (:func:`backbone_twin`; module
        objects only, every tensor shared with the target). The first size planned as ``"packed"`` also
        packs a copy of every backbone linear weight and of the lm_head weight (float32, as much memory
        again, held here); planning no ``"packed"`` size frees them and drops the twins no longer
        planned, unless ``keep_packed`` (used while measuring, to switch plans without repacking). The
        weights must not change while packed: plan no ``"packed"`` size, then plan again, to repack. A
        target moved, cast or given new tensors since the twins were built gets new twins (and a repack).

        Raises:
            ValueError: a size that is not a positive integer, or an unknown kernel name.
            RuntimeError: ``"packed"`` where :meth:`packed_available` is False.
        """
        clean: dict[int, str] = {}
        for n, kernel in plan.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"tree sizes must be positive integers, got {n!r}")
            if kernel not in cpu_linear.LINEAR_KERNELS:
                choices = ", ".join(cpu_linear.LINEAR_KERNELS)
                raise ValueError(f"unknown linear kernel {kernel!r}; choose from {choices}")
            if kernel != "linear" and cpu_linear.kernel_applies(kernel, n):
                clean[n] = kernel
        wanted = set(clean.values())
        if "packed" in wanted and self._packed is None and not self.packed_available():
            raise RuntimeError(
                "packed linears need a float32 model on a CPU, a torch built with oneDNN (torch.backends.mkldnn) "
                f"and at most {cpu_linear.PACKED_MAX_BYTES >> 30} GiB of linear weights; plan 'linear' or "
                "'weight_first' instead"
            )
        if self._twins and not self._in_sync():
            self._twins, self._packed, self._packed_head = {}, None, None
        if not keep_packed:
            self._twins = {k: twin for k, twin in self._twins.items() if k in wanted}
            if "packed" not in wanted:
                self._packed = self._packed_head = None
        if "packed" in wanted and self._packed is None:
            self._packed = {id(m.weight): (m.weight, cpu_linear.pack_weight(m.weight)) for m in self._linears}
            self._packed_head = cpu_linear.pack_weight(self.target.get_output_embeddings().weight)
        for kernel in wanted - set(self._twins):
            self._twins[kernel] = self._build_twin(kernel)
        self._plan = dict(sorted(clean.items()))

    def _build_twin(self, kernel: str) -> torch.nn.Module:
        if kernel == "packed":
            packed = self._packed

            def replace(linear: torch.nn.Linear) -> torch.nn.Module:
                return cpu_linear.PackedLinear(linear, packed[id(linear.weight)][1])
        else:
            replace = cpu_linear.WeightFirstLinear
        model = backbone(self.target)
        # The target's own parameter/buffer tables (read, never written): _in_sync compares them by
        # identity on every planned forward, ~300 dict lookups for SmolLM2-135M (the public iterators
        # walk the module tree and cost ~10x more).
        self._shared = tuple(
            (table, name, t)
            for m in model.modules()
            for table in (m._parameters, m._buffers)
            for name, t in table.items()
            if t is not None
        )
        p = next(self.target.parameters())
        self._built_for = (p.device, p.dtype)
        return backbone_twin(model, replace)

    def _in_sync(self) -> bool:
        """Whether the twins still compute with the target's tensors: same device and dtype as when they
        were built, and every parameter and buffer of the target the very tensor they share."""
        p = next(self.target.parameters())
        if (p.device, p.dtype) != self._built_for:
            return False
        return all(table.get(name) is t for table, name, t in self._shared)

    def kernel_for(self, rows: int) -> str:
        """The kernel a verification of ``rows`` nodes uses now: the plan's, or ``"linear"`` when the
        target was moved off the CPU, cast, or given new parameter or buffer tensors after planning."""
        kernel = self._plan.get(rows, "linear")
        if kernel == "linear":
            return kernel
        if self._built_for is None or self._built_for[0].type != "cpu" or not self._in_sync():
            return "linear"
        return kernel

    # ------------------------------------------------------------------ forwards
    def new_cache(self) -> DynamicCache:
        """A fresh ``DynamicCache`` for the target."""
        return new_cache(self.target)

    def prefill(
        self, input_ids: torch.Tensor, cache: DynamicCache, layers: Sequence[int] | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the prompt through the target, filling ``cache``.

        Args:
            input_ids: LongTensor ``[T]``.
            cache: an empty ``DynamicCache``.
            layers: optional decoder-layer indices (in ``[0, L)``) whose input hidden states to return too.

        Returns:
            Last hidden states after the final norm, ``[T, D]`` in the model dtype; with ``layers``, the pair
            ``(that, layer_states [T, len(layers) * D])`` (see :func:`layer_states`).
        """
        out = call_with_cache(
            backbone(self.target),
            cache,
            input_ids=input_ids.unsqueeze(0),
            **({"output_hidden_states": True} if layers else {}),
        )
        hidden = out.last_hidden_state[0]
        return (hidden, layer_states(out, layers)) if layers else hidden

    def forward_tree(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        cache: DynamicCache,
        past_length: int,
        layers: Sequence[int] | None = None,
        host: HostTree | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Verify a whole draft tree in one target forward (tree attention), with the planned kernel.

        Args:
            tokens: LongTensor ``[N]``, node 0 the root.
            parents: LongTensor ``[N]`` (see :mod:`selfspec.decode.tree`).
            cache: ``DynamicCache`` holding exactly ``past_length`` tokens; grows by N.
            past_length: cached prefix length.
            layers: optional decoder-layer indices whose input hidden states to return too.
            host: the tree's structure already on the host (:func:`~selfspec.decode.host.read_tree`); then
                the chain test, the positions and the mask read nothing from the device. Without it,
                ``parents`` is read (one host synchronisation on a GPU when it lives there). When every
                layer attends fully, the depths and ancestor block of the last :data:`TREE_SHAPES_KEPT`
                tree shapes stay on the device: the positions and the mask are then built there, and a
                static tree is copied once.

        Returns:
            Hidden states ``[N, D]`` (after the final norm, model dtype) at every node; node i has
            attended to the prefix and its own ancestors only. With ``layers``, the pair
            ``(that, layer_states [N, len(layers) * D])`` (see :func:`layer_states`).
        """
        dtype = next(self.target.parameters()).dtype
        device = tokens.device
        n = tokens.numel()
        if host is None and n > 1:
            host = read_tree(tokens, parents)
        if n == 1 or host.is_chain:
            # A chain: the ordinary causal mask is the tree mask; let the model build it (fast path).
            positions = torch.arange(past_length, past_length + n, device=device).unsqueeze(0)
            mask = None
        elif (layout := attention_layout(self.target.config)).kinds == (FULL,):
            # Full attention only: the mask is the cached prefix (all 0) then the tree's ancestor block, and
            # the positions are past_length + depth; depth and block stay on the device per tree shape.
            depths, block = self._tree_block(host, dtype, device)
            positions = (depths + past_length).unsqueeze(0)
            mask = torch.cat([block.new_zeros(1, 1, n, past_length), block], dim=-1)
        else:
            # One mask per attention-layer type: sliding layers see only their window (selfspec.decode.masks).
            positions = to_device([past_length + d for d in host.depths], device).unsqueeze(0)
            mask = tree_attention_masks(host.parents, past_length, dtype, layout, device)
        kwargs = dict(input_ids=tokens.unsqueeze(0), attention_mask=mask, position_ids=positions)
        if layers:
            kwargs["output_hidden_states"] = True
        kernel = self.kernel_for(n)
        model = backbone(self.target) if kernel == "linear" else self._twins[kernel]
        out = call_with_cache(model, cache, **kwargs)
        hidden = out.last_hidden_state[0]
        return (hidden, layer_states(out, layers)) if layers else hidden

    def _tree_block(
        self, host: HostTree, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(depths [N] long, additive ancestor mask [1, 1, N, N] in dtype)`` of the tree's shape on ``device``
        (:func:`~selfspec.decode.masks.additive` of :func:`~selfspec.decode.tree.ancestor_mask`). The last
        :data:`TREE_SHAPES_KEPT` shapes are kept, so a static tree is sent to the device once, not every step."""
        key = (tuple(host.parents), dtype, device)
        hit = self._tree_blocks.get(key)
        if hit is None:
            hit = (to_device(host.depths, device), to_device(additive(ancestor_mask(host.parents), dtype), device))
            if len(self._tree_blocks) >= TREE_SHAPES_KEPT:
                del self._tree_blocks[next(iter(self._tree_blocks))]
            self._tree_blocks[key] = hit
        return hit

    def forward_block(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        parents: Sequence[torch.Tensor | Sequence[int]],
        cache: DynamicCache,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One target forward over a batch of ragged rows, each a tree (or a prompt, as a chain) after its cache.

        Row b's block is its tree of ``len(parents[b])`` nodes padded to Q; its cache slots hold positions
        ``key_positions[b]`` (``-1``: empty). The masks are :func:`~selfspec.decode.masks.block_attention_masks`
        (per attention-layer type, sliding windows by position). The linears run the planned kernel of
        ``B * Q`` rows (:meth:`kernel_for`: the plan is by the rows a linear multiplies, which a batch-1 tree
        of that many nodes has too).

        Args:
            tokens: LongTensor ``[B, Q]`` (padding: any valid id).
            positions: LongTensor ``[B, Q]``, each node's position (``length_b + depth``).
            key_positions: LongTensor ``[B, S]``, the positions the cache's slots hold
                (:class:`~selfspec.decode.batch_cache.SlotTable`).
            parents: B LongTensors ``[N_b]`` or their values as ints, ``N_b <= Q``.
            cache: ``DynamicCache`` with S slots for B rows (or empty); grows by Q.
            layers: optional decoder-layer indices whose input hidden states to return too.

        Returns:
            Hidden states ``[B, Q, D]`` after the final norm (model dtype; padding nodes' are meaningless);
            with ``layers`` the pair ``(that, [B, Q, len(layers) * D])``.
        """
        dtype = next(self.target.parameters()).dtype
        device = tokens.device
        layout = attention_layout(self.target.config)
        mask = block_attention_masks(key_positions, list(parents), positions, dtype, layout, device)
        kwargs = dict(input_ids=tokens, attention_mask=mask, position_ids=positions.to(device))
        if layers:
            kwargs["output_hidden_states"] = True
        kernel = self.kernel_for(tokens.numel())
        model = backbone(self.target) if kernel == "linear" else self._twins[kernel]
        out = call_with_cache(model, cache, **kwargs)
        hidden = out.last_hidden_state
        if not layers:
            return hidden
        return hidden, torch.cat([out.hidden_states[i] for i in _checked_layers(out, layers)], dim=-1)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target logits from last hidden states: ``[N, D] -> [N, V]`` float32.

        For 2..32 rows on a CPU the product is ``W @ h^T`` (:func:`~selfspec.base.cpu_linear.project`);
        where the plan has ``"packed"`` for N rows, oneDNN computes it on the packed lm_head weight.
        Same math, another summation order. A config's ``final_logit_softcapping`` (Gemma-2) is applied
        as the model's own forward applies it.
        """
        head = self.target.get_output_embeddings()
        if self._packed_head is not None and hidden.dim() == 2 and self.kernel_for(hidden.shape[0]) == "packed":
            logits = cpu_linear.packed_linear(hidden, self._packed_head, head.bias)
        elif head.bias is None:
            logits = cpu_linear.project(hidden, head.weight)
        else:
            logits = head(hidden)
        cap = getattr(self.target.config, "final_logit_softcapping", None)
        if cap is not None:
            # Gemma-2 / Gemma-3 soft-cap their logits in the forward, in the model dtype: cap * tanh(logits / cap).
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def layer_states(output, layers: Sequence[int], row: int = 0) -> torch.Tensor:
    """The hidden states entering decoder layers ``layers`` (``output.hidden_states[i]``: index 0 is the
    embedding output, i the output of layer i - 1, as EAGLE-3's ``eagle_aux_hidden_state_layer_ids`` count),
    concatenated: ``[T, len(layers) * D]`` for batch row ``row``.

    Raises:
        ValueError: a layer index outside ``[0, L)`` (``hidden_states[L]`` is after the final norm).
    """
    states = output.hidden_states
    return torch.cat([states[i][row] for i in _checked_layers(output, layers)], dim=-1)


def _checked_layers(output, layers: Sequence[int]) -> list[int]:
    """``layers`` as a list, each checked to lie in ``[0, L)`` (raises ValueError otherwise)."""
    n_layers = len(output.hidden_states) - 1
    if any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"layers must lie in [0, {n_layers}), got {list(layers)}")
    return list(layers)


def backbone_twin(module: torch.nn.Module, replace: Callable[[torch.nn.Linear], torch.nn.Module]) -> torch.nn.Module:
    """A twin of ``module``: a copy of its module structure that shares every tensor with it, in which each
    ``nn.Linear`` (exactly that type, without a ``forward`` of its own) is ``replace(linear)``.

    ``copy.deepcopy`` with a memo holding every parameter, buffer and tensor attribute of ``module``'s
    modules, and their ``config`` objects: those are the originals in the twin (same tensors, same
    storage), so the twin costs only module objects and computes with the module's current weights.
    ``module`` is not modified (only read).

    Args:
        module: e.g. a causal LM's decoder stack.
        replace: builds the stand-in of one ``nn.Linear`` (given the twin's copy, which holds the
            original weight and bias tensors).

    Returns:
        The twin, an ``nn.Module`` of ``module``'s class.
    """
    memo: dict[int, object] = {}
    for m in module.modules():
        for value in m.__dict__.values():
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
        config = m.__dict__.get("config")
        if config is not None:
            memo[id(config)] = config
    for _, t in module.named_parameters(remove_duplicate=False):
        memo[id(t)] = t
    for _, t in module.named_buffers(remove_duplicate=False):
        memo[id(t)] = t
    twin = copy.deepcopy(module, memo)
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and "forward" not in child.__dict__:
                setattr(parent, name, replace(child))
    return twin


def as_verifier(target: PreTrainedModel | Verifier) -> Verifier:
    """``target`` itself when it is a :class:`Verifier`, else a plain one (no kernel plan) around it."""
    return target if isinstance(target, Verifier) else Verifier(target)
