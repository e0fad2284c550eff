"""The draft layers of the DFlash / DSpark block heads (:mod:`selfspec.heads.dflash`): Qwen3-style decoder layers
whose attention reads the fused target context's keys and values (computed once per position and cached,
:class:`ContextKV`) followed by the block's own, bidirectionally within the block.

Per layer, for block inputs ``e [B, Q, D]`` at positions ``n + j`` and a context of ``C`` positions::

    a = input_layernorm(e);  Q, K, V from a (q/k norms, RoPE at n + j)
    e = e + o_proj(attention(Q, [K_ctx; K], [V_ctx; V]))          # every context position, the whole block
    e = e + mlp(post_attention_layernorm(e))                      # SwiGLU

Tensor names (``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``input_layernorm``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``) are those of the published checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

from selfspec.base.cpu_linear import project

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["BlockAttention", "BlockLayer", "ContextKV", "draft_layer_config", "rope_theta"]


def rope_theta(config: PretrainedConfig) -> float:
    """The RoPE base of a target's config, for a draft layer with RoPE of its own: ``rope_parameters["rope_theta"]``
    (transformers 5), that of the full-attention layers where the parameters are per layer type (Gemma-3 / 4), the
    top-level ``rope_theta`` of older configs, else 10000."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope = rope.get("full_attention", rope) if "rope_theta" not in rope else rope
    return float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))


def draft_layer_config(target_config: PretrainedConfig, num_layers: int, block_size: int) -> Qwen3Config:
    """The head's layers as a ``transformers`` Qwen3 config of the target's sizes (hidden, heads, KV heads, head
    dim, MLP width, RMS epsilon, RoPE base), whatever the target's architecture: the layer kind the engines load
    for DFlash / DSpark drafts. Attention is bidirectional in the block (``is_causal: false``). A target whose layers
    differ in size (``transformers``' per-layer configs: Gemma-4's full-attention layers have their own ``head_dim``)
    gives the sizes of its last layer."""
    c = target_config.per_layer_config[target_config.num_hidden_layers - 1]  # the config itself when layers agree
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    theta = rope_theta(c)
    return Qwen3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or 1e-6),
        vocab_size=c.vocab_size,
        max_position_embeddings=getattr(c, "max_position_embeddings", None) or 8192,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        block_size=block_size,
        is_causal=False,
    )


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (the NeoX half rotation Qwen3 uses) on ``x [B, H, T, hd]`` with ``cos, sin [B, T, hd]``."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class BlockAttention(nn.Module):
    """Qwen3-style attention whose keys and values are the fused context's (computed once, :meth:`context`) followed
    by the block's own; queries come from the block only."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = H, Hkv, hd
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.q_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], heads, self.head_dim).transpose(-3, -2)  # [B, heads, T, hd]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, D]`` -> ``(K, V)`` each ``[B, Hkv, T, hd]``: K normed and rotated, V as projected."""
        k = _rope(self.k_norm(self._split(project(x, self.k_proj.weight), self.kv_heads)), cos, sin)
        return k, self._split(project(x, self.v_proj.weight), self.kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x [B, Q, D]`` block inputs (already normed), ``context`` ``(K, V) [B, Hkv, C, hd]``, ``mask`` additive
        ``[B or 1, 1, Q, C + Q]`` or None (every key visible) -> ``[B, Q, D]``."""
        q = _rope(self.q_norm(self._split(project(x, self.q_proj.weight), self.heads)), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([context[0].to(k.dtype), k], dim=2)
        v = torch.cat([context[1].to(v.dtype), v], dim=2)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        out = out.transpose(1, 2).reshape(*x.shape[:-1], self.heads * self.head_dim)
        return project(out, self.o_proj.weight)


class BlockLayer(nn.Module):
    """One draft layer: pre-norm attention over context and block, then a pre-norm SwiGLU MLP (Qwen3's)."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, cos, sin, context, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ContextKV:
    """A sequence's fused context as every draft layer sees it: per layer ``(K, V)`` ``[1, Hkv, C, hd]``, C the
    positions fed so far (0 .. C - 1)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[2])

    def extended(self, more: list[tuple[torch.Tensor, torch.Tensor]]) -> ContextKV:
        """This context followed by ``more`` (the next positions), as a new record."""
        pairs = zip(self.layers, more, strict=True)
        return ContextKV([(torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2)) for (k, v), (k2, v2) in pairs])
