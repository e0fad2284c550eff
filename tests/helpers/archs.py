"""Tiny random targets of several architecture families, built in place (no downloads), and :func:`tiny_llama`,
the 2-layer Llama most tests decode with.

Each family keeps what makes it different from Llama: sliding-window attention (window
:data:`WINDOW` tokens, so contexts longer than the window are cheap), mixed local/global layers,
per-layer-type rotary embeddings, q/k norms, soft-capped logits, scaled or tied embeddings; the
:data:`SERVED_ARCHS` their routed experts, latent attention, attention sinks and per-layer head sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

WINDOW = 8  # sliding-window size of the families that have one

_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=None,  # no implicit stop: tests pass EOS ids explicitly
    pad_token_id=0,
)


def _llama() -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON)


def _mistral() -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, sliding_window=WINDOW)  # every layer sliding


def _qwen2() -> PretrainedConfig:
    from transformers import Qwen2Config

    # layer 0 global, layers 1-2 sliding
    return Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _qwen3() -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, head_dim=8)  # q/k RMSNorm


def _gemma2() -> PretrainedConfig:
    from transformers import Gemma2Config

    return Gemma2Config(
        **{**_COMMON, "tie_word_embeddings": True},
        head_dim=8,
        sliding_window=WINDOW,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        query_pre_attn_scalar=8,
    )


def _gemma3() -> PretrainedConfig:
    from transformers import Gemma3TextConfig

    # sliding / global / sliding, two rotary bases (local and global), scaled embeddings
    return Gemma3TextConfig(
        **{**_COMMON, "tie_word_embeddings": True},
        head_dim=8,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        query_pre_attn_scalar=8,
    )


def _phi3() -> PretrainedConfig:
    from transformers import Phi3Config

    return Phi3Config(**_COMMON)


def _qwen3_moe() -> PretrainedConfig:
    from transformers import Qwen3MoeConfig

    # 8 experts, 2 routed per token (normalised top-k), q/k norms
    return Qwen3MoeConfig(
        **_COMMON, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    )


def _mixtral() -> PretrainedConfig:
    from transformers import MixtralConfig

    return MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)  # 4 experts, 2 per token


def _gpt_oss() -> PretrainedConfig:
    from transformers import GptOssConfig

    # attention sinks, sliding / full / sliding layers, 4 experts (2 per token), biased q/k/v
    return GptOssConfig(
        **_COMMON,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


def _deepseek_v3(q_lora_rank: int | None = None) -> PretrainedConfig:
    from transformers import DeepseekV3Config

    # multi-head latent attention (keys and values through a rank-16 latent, queries full rank: q_lora_rank None),
    # a dense first layer then routed experts (4, 2 per token) with a shared one
    return DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _smollm3() -> PretrainedConfig:
    from transformers import SmolLM3Config

    return SmolLM3Config(**_COMMON, no_rope_layer_interval=3)  # every third layer without RoPE


def _gemma4() -> PretrainedConfig:
    from transformers import Gemma4TextConfig

    # sliding / sliding / full layers, the full layer with a wider head (16 vs 8) and its own partial rotary,
    # per-layer token embeddings (8 wide), k = v norms, scaled embeddings
    return Gemma4TextConfig(
        **{**_COMMON, "tie_word_embeddings": True},
        head_dim=8,
        global_head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=96,
    )


_LINEAR = dict(
    head_dim=8,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
)


def _qwen3_next() -> PretrainedConfig:
    from transformers import Qwen3NextConfig

    # gated delta net / gated delta net / gated full attention, 4 experts (2 per token) with a shared one
    return Qwen3NextConfig(
        **_COMMON,
        **_LINEAR,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
    )


def _qwen3_5() -> PretrainedConfig:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_COMMON, **_LINEAR)  # gated delta nets and full attention, dense MLPs


def _lfm2() -> PretrainedConfig:
    from transformers import Lfm2Config

    # short convolution / attention / short convolution
    return Lfm2Config(
        **{k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"},
        layer_types=["conv", "full_attention", "conv"],
    )


def _granite4() -> PretrainedConfig:
    from transformers import GraniteMoeHybridConfig

    # Mamba-2 / attention / Mamba-2, no RoPE
    return GraniteMoeHybridConfig(
        **_COMMON,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_expand=1,
        num_local_experts=0,
    )


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "smollm3": _smollm3,
    "gemma4": _gemma4,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "lfm2": _lfm2,
    "granite4": _granite4,
}
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
"""The families every decode and training test of the matrix runs (the exhaustive matrix)."""
SERVED_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "smollm3", "gemma4")
"""The architectures served in 2026 (mixture-of-experts, latent attention, attention sinks, no-RoPE layers, per-layer
head sizes and inputs): their own, leaner matrix (tests/decode/test_served_architectures.py)."""
STATE_ARCHS = ("qwen3_next", "qwen3_5", "lfm2", "granite4")
"""Hybrid targets whose layers keep a recurrent or convolution state (gated delta nets, short convolutions, Mamba-2),
verified as chains with the state rolled back (tests/decode/test_state_targets.py)."""


def tiny_target(arch: str, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised causal LM of family ``arch`` (a key of :data:`CONFIGS`), fp32, eval, frozen.

    Raises:
        KeyError: an unknown family.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    model.requires_grad_(False)
    return model


def tiny_llama(vocab_size: int = 96, hidden_size: int = 32, layers: int = 2, seed: int = 0):
    """A randomly initialised LlamaForCausalLM small enough for exhaustive tests (fp32, eval, frozen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=None,  # no implicit stop: tests pass EOS ids explicitly
        pad_token_id=0,
    )
    # Untied and a wide init: varied, non-repeating greedy paths with few near-ties.
    model = LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model
