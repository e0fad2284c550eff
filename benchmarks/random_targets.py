"""Randomly initialised Llama targets of real shapes, built in place (no download), for cost measurements.

The shapes (:data:`SIZES`):

* ``135m``: SmolLM2-135M (hidden 576, 30 layers, 9/3 heads, MLP 1536, vocab 49,152, tied embeddings)
* ``1b``:   Llama-3.2-1B's shape (2048, 16 layers, 32/8 heads, MLP 8192, vocab 128,256, tied)
* ``8b``:   Llama-3.1-8B's shape (4096, 32 layers, 32/8 heads, MLP 14,336, vocab 128,256)
* ``tiny``: 2 layers, hidden 64, vocab 512 (CPU dry runs; a wide init gives well-separated logits, so fp32
  greedy paths have no near-ties)

Used by :mod:`benchmarks.gpu_curves` and :mod:`benchmarks.gpu_cycle`, whose reports open with
:func:`machine_record`.
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Llama shapes by name, one row each: the real models' (SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B) and a tiny one.
_SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
SIZES: dict[str, dict[str, Any]] = {
    name: dict(zip(_SIZE_FIELDS, row, strict=True))
    for name, row in {
        "135m": (576, 30, 9, 3, 1536, 49152, True),
        "1b": (2048, 16, 32, 8, 8192, 128256, True),
        "8b": (4096, 32, 32, 8, 14336, 128256, False),
        "tiny": (64, 2, 4, 2, 128, 512, False),
    }.items()
}
SIZES["tiny"]["initializer_range"] = 0.2
REAL_SIZES = ("135m", "1b", "8b")


def build_target(size: str, dtype: torch.dtype, device: str, eos_token_id: int | None = None) -> PreTrainedModel:
    """A randomly initialised ``LlamaForCausalLM`` of ``SIZES[size]`` (seed 0), made directly on ``device`` in
    ``dtype``: eval mode, frozen, SDPA attention, 4,096 positions.

    Args:
        eos_token_id: the EOS (and pad) id of its config and generation config; None: no EOS, so every decode
            runs to its length.

    Raises:
        KeyError: ``size`` is not a key of :data:`SIZES`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy import, only when a target is built

    cfg = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model.eval().requires_grad_(False)


def machine_record(device: str, dtype: str) -> dict[str, Any]:
    """What a measurement ran on, the first keys of a GPU report: ``device`` and ``dtype`` as given, the
    ``accelerator`` (the CUDA device's name, else the CPU's, else ``"cpu"``), the torch version and its threads."""
    return {
        "device": device,
        "accelerator": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        "dtype": dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
