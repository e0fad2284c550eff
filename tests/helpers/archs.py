"""Tiny random targets of several architecture families, built in place (no downloads), and :func:`tiny_llama`,
the 2-layer Llama most tests decode with.

Each family keeps what makes it different from Llama: sliding-window attention (window
:data:`WINDOW` tokens, so contexts longer than the window are cheap), mixed local/global layers,
per-layer-type rotary embeddings, q/k norms, soft-capped logits, scaled or tied embeddings.
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


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
}
ARCHS = tuple(CONFIGS)


def tiny_target(arch: str, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised causal LM of family ``arch`` (one of :data:`ARCHS`), fp32, eval, frozen.

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
