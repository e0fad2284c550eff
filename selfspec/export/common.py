"""Pieces every export format shares: the error, the Llama check, the one-layer config dict, the atomic write.

An export directory is written through :func:`selfspec.heads.io.write_head_dir` (a temporary sibling, fsynced,
renamed into place): a failed export leaves no directory, or the old one untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.heads.io import HeadFormatError, write_head_dir
from selfspec.heads.medusa import MedusaHeads

__all__ = [
    "ExportError",
    "Head",
    "family_name",
    "llama_config_dict",
    "rename_exact",
    "target_embedding",
    "require_llama",
    "write_export",
]

Head = MedusaHeads | EagleHead | Eagle3Head

# transformers' bookkeeping fields of PretrainedConfig.to_dict() that no engine reads.
_NOISE = (
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "is_encoder_decoder",
    "_name_or_path",
    "_attn_implementation_autoset",
    "head_type",
    "selfspec",
)


class ExportError(HeadFormatError):
    """An export that the format cannot hold (family, architecture, a tensor the layout does not name)."""


def family_name(head: Head) -> str:
    """``"medusa"``, ``"eagle"`` or ``"eagle3"`` (the ``head_type`` of the head's own directory).

    Raises:
        ExportError: ``head`` is not a selfspec head.
    """
    for cls, name in ((MedusaHeads, "medusa"), (EagleHead, "eagle"), (Eagle3Head, "eagle3")):
        if isinstance(head, cls):
            return name
    raise ExportError(f"not a selfspec head: {type(head).__name__}; load one with selfspec.heads.load_heads(DIR)")


def require_llama(head: EagleHead | Eagle3Head, fmt: str) -> None:
    """Refuse a head whose decoder layer is not a plain Llama layer (what ``LlamaForCausalLMEagle3`` /
    ``LlamaForCausalLMEagle`` / the speculators Llama layer build): model type ``llama``, SiLU MLP, no
    attention or MLP bias.

    Raises:
        ExportError: naming the field that differs and the fix.
    """
    cfg = head.arch_config
    bad = []
    if cfg.model_type != "llama":
        bad.append(f"model_type {cfg.model_type!r}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {cfg.hidden_act!r}")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(cfg, name, False):
            bad.append(f"{name}=True")
    if bad:
        raise ExportError(
            f"the {fmt} format holds heads with a Llama decoder layer; this head has {', '.join(bad)}. "
            "Export heads of a Llama-architecture target, or keep this head in selfspec's own format "
            "(save_pretrained)."
        )


def llama_config_dict(head: EagleHead | Eagle3Head) -> dict[str, Any]:
    """The head's one-layer transformers config as a plain dict for an engine: ``num_hidden_layers: 1``,
    ``dtype`` / ``torch_dtype`` the head's, transformers' bookkeeping fields dropped, and the RoPE fields in
    both spellings (transformers 5's ``rope_parameters`` and the top-level ``rope_theta`` plus a non-default
    ``rope_scaling`` that older serving stacks read, as SpecForge's ``apply_legacy_rope_scaling`` writes)."""
    cfg = head.arch_config.to_dict()
    for key in _NOISE:
        cfg.pop(key, None)
    dtype = str(head.fc.weight.dtype).removeprefix("torch.")
    cfg.update({"num_hidden_layers": 1, "dtype": dtype, "torch_dtype": dtype})
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def target_embedding(head: EagleHead | Eagle3Head) -> torch.Tensor:
    """The attached target's token embedding ``[V, D]`` (detached).

    Raises:
        ExportError: no target is attached (load the head with ``load_heads(DIR, target)``).
    """
    attached = getattr(head, "_target", None)  # set by attach_target; the heads keep it unregistered
    if attached is None:
        raise ExportError("this export writes the target's embedding: load the head with load_heads(DIR, target)")
    return attached[0].weight.detach()


def rename_exact(state: Mapping[str, torch.Tensor], names: Mapping[str, str], fmt: str) -> dict[str, torch.Tensor]:
    """Rename every tensor of ``state`` through ``names``; a tensor the layout does not name is an error.

    Raises:
        ExportError: listing the tensors the format has no name for (never silently dropped).
    """
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise ExportError(
            f"the {fmt} layout has no name for tensors {unknown}: the head's architecture does not fit it "
            "(export heads of a plain Llama layer, or keep this head in selfspec's own format)"
        )
    return {names[k]: v.detach() for k, v in state.items()}


def write_export(out_dir: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``config.json`` + ``model.safetensors`` atomically (tensors contiguous, on the CPU; the safetensors
    metadata carries ``format: pt`` and a checksum). Returns the directory."""
    return write_head_dir(out_dir, config, {"model.safetensors": dict(tensors)})
