"""The decoder layer of an EAGLE-3 head (:mod:`selfspec.heads.eagle3`): the target's own layer class with its q/k/v
projections widened to take ``concat(embed_norm(e), hidden_norm(h))`` (:class:`FusedInputNorm`, :func:`widen_qkv`), or,
for a target whose attention reads the hidden states through other projections too (DeepSeek's multi-head latent
attention), a Llama layer of the target's sizes (:func:`llama_layer_config`), the layer the engines' EAGLE-3 layouts
for DeepSeek and Kimi targets use; :func:`draft_layer_arch` decides which when the head is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from selfspec.heads.block_layers import rope_theta
from selfspec.heads.io import HeadFormatError
from selfspec.heads.layer_config import decoder_layer_class, one_layer_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "DRAFT_LAYERS",
    "OUTPUT_NAMES",
    "QKV_NAMES",
    "FusedInputNorm",
    "draft_layer_arch",
    "llama_layer_config",
    "unwidened_inputs",
    "widen_qkv",
]

QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj")
# The attention's output projection: the one linear besides QKV_NAMES an attention that can be widened has.
OUTPUT_NAMES = ("o_proj", "dense", "out_proj")
DRAFT_LAYERS = ("auto", "target", "llama")


class FusedInputNorm(nn.Module):
    """The attention input of an EAGLE-3 layer, standing in for the layer's ``input_layernorm``:
    ``forward(h [.., D]) -> concat(embed_norm(e), hidden_norm(h)) [.., 2D]``, where ``e`` (the token embeddings
    ``[.., D]`` of the same positions) is set by :meth:`Eagle3Head.forward` for the duration of one layer call."""

    def __init__(self, embed_norm: nn.Module, hidden_norm: nn.Module) -> None:
        super().__init__()
        self.embed_norm, self.hidden_norm = embed_norm, hidden_norm
        self.embeds: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embeds is None:
            raise RuntimeError("FusedInputNorm is called by Eagle3Head.forward, which sets the token embeddings")
        return torch.cat([self.embed_norm(self.embeds), self.hidden_norm(hidden)], dim=-1)


def unwidened_inputs(attn: nn.Module) -> list[str]:
    """The linears of an attention module besides its q/k/v (:data:`QKV_NAMES`) and output projection
    (:data:`OUTPUT_NAMES`), e.g. multi-head latent attention's ``kv_a_proj_with_mqa`` and ``kv_b_proj``: an attention
    that has any may read the hidden states through a projection the EAGLE-3 widening does not cover, so its layer
    cannot be the head's (``[]``: it can)."""
    return sorted(
        name
        for name, module in attn.named_children()
        if isinstance(module, nn.Linear) and name not in QKV_NAMES + OUTPUT_NAMES
    )


def llama_layer_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """A one-layer ``LlamaConfig`` of the target's sizes (hidden, vocabulary, heads, KV heads, MLP width, RMS epsilon,
    RoPE base; head dim ``hidden / heads``): the Llama-style draft layer of ``draft_layer: "llama"``, the layer
    ``LlamaForCausalLMEagle3`` (vLLM, SGLang, SpecForge) loads for any target."""
    from transformers import LlamaConfig

    c = target_config.per_layer_config[target_config.num_hidden_layers - 1]  # the config itself when layers agree
    heads = c.num_attention_heads
    return LlamaConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=c.hidden_size // heads,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or 1e-6),
        vocab_size=c.vocab_size,
        max_position_embeddings=getattr(c, "max_position_embeddings", None) or 8192,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta(c)},
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        architectures=["LlamaForCausalLM"],
    )


def draft_layer_arch(
    kind: str, arch_config: PretrainedConfig, target: PreTrainedModel | None
) -> tuple[str, PretrainedConfig, type[nn.Module]]:
    """Which decoder layer an EAGLE-3 head of ``draft_layer: kind`` gets (:class:`Eagle3Config`): the resolved kind
    (``"target"`` or ``"llama"``), its one-layer config and its class.

    Raises:
        HeadFormatError: ``kind`` ``"target"`` and a layer that cannot be widened: an attention with projections the
            widening does not cover, or no ``input_layernorm`` for :class:`FusedInputNorm` to stand in for (LFM2's
            ``operator_norm``); the message names the layer class, why, and ``draft_layer: "llama"``.
    """
    if kind != "llama":
        one_layer = one_layer_config(arch_config)
        layer_cls = decoder_layer_class(one_layer, target)
        with torch.device("meta"):  # no memory: only its module names are read
            probe = layer_cls(one_layer, layer_idx=0)
        extra = unwidened_inputs(probe.self_attn)
        why = f"reads the hidden states through {extra} besides {QKV_NAMES}" if extra else None
        if "input_layernorm" not in dict(probe.named_children()):
            why = "has no input_layernorm (the norm of the attention input that EAGLE-3 doubles)"
        if why is None:
            return "target", arch_config, layer_cls
        if kind == "target":
            raise HeadFormatError(
                f"{layer_cls.__name__} {why}: its layer cannot be widened into an EAGLE-3 layer; use "
                'draft_layer: "llama" (a Llama layer of its sizes)'
            )
    llama = llama_layer_config(arch_config)
    return "llama", llama, decoder_layer_class(one_layer_config(llama))


def widen_qkv(attn: nn.Module, in_features: int) -> list[str]:
    """Rebuild the attention's q/k/v (or fused qkv) linears with ``in_features`` inputs; returns their names."""
    names = []
    for name in QKV_NAMES:
        old = getattr(attn, name, None)
        if isinstance(old, nn.Linear):
            new = nn.Linear(in_features, old.out_features, bias=old.bias is not None)
            setattr(attn, name, new.to(dtype=old.weight.dtype))
            names.append(name)
    if not names:
        raise HeadFormatError(f"{type(attn).__name__} has none of {QKV_NAMES}: cannot build an EAGLE-3 layer")
    return names
