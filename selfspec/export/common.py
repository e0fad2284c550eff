"""Pieces every export format shares: the error, the trainer-prefix and Llama checks, the one-layer config dict, the
whole-directory write.

An export directory is written by :func:`write_export`: staged in a sibling directory (through
:func:`selfspec.heads.io.write_head_dir`, fsynced), then renamed into place. A failed export leaves no directory, or
the previous export untouched; a directory holding other files is refused, never replaced.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from selfspec.base.files import replace_dir, staging_dir
from selfspec.heads.dflash import BlockHead
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.heads.families import family_of as head_family_of
from selfspec.heads.families import head_families, head_family
from selfspec.heads.io import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError, write_head_dir
from selfspec.heads.medusa import MedusaHeads

__all__ = [
    "EXPORT_FILES",
    "TOKEN_MAP_NAME",
    "TRAINER_PREFIXES",
    "ExportError",
    "Head",
    "check_trainer_prefix",
    "family_name",
    "llama_config_dict",
    "rename_exact",
    "target_embedding",
    "require_llama",
    "write_export",
]

Head = MedusaHeads | EagleHead | Eagle3Head | BlockHead

TOKEN_MAP_NAME = "speculative_token_map.pt"
"""SGLang's ``--speculative-token-map`` file, written beside an EAGLE-1 export with a reduced draft vocabulary."""

EXPORT_FILES = frozenset({CONFIG_NAME, WEIGHTS_NAME, TOKEN_MAP_NAME})
"""Every file an export directory can hold; a directory holding anything else is not replaced."""

TRAINER_PREFIXES = ("module.", "_orig_mod.", "medusa_heads.", "medusa_head.", "model.", "draft_model.", "base_model.")
"""Name prefixes that training wrappers put on tensors (DDP / DeepSpeed ``module.``, ``torch.compile``'s
``_orig_mod.``, Medusa and EAGLE trainers' wrappers). Engines strip some of them and skip others silently."""

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
    """The head's family, the ``head_type`` of its own directory (``"medusa"``, ``"eagle"``, ``"eagle3"``, ...: a
    family of :mod:`selfspec.heads.families`).

    Raises:
        ExportError: ``head`` is not a selfspec head (or wraps one: the message says which attribute holds it).
    """
    classes = tuple(head_family(name).head_class for name in head_families())
    if isinstance(head, classes):
        return head_family_of(head).name
    for attr in ("_orig_mod", "module"):  # torch.compile's OptimizedModule; DDP / DeepSpeed wrappers
        inner = getattr(head, attr, None)
        if isinstance(inner, classes):
            raise ExportError(
                f"this is a {type(head).__name__} wrapping a selfspec head (its tensors carry the trainer prefix "
                f"'{attr}.'); export the head itself: head.{attr}"
            )
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


def refuse_eagle31(head: Eagle3Head, engine: str, computes: str) -> None:
    """Refuse an EAGLE-3.1 head (``fc_norm`` / ``norm_output``, arXiv:2605.09992) for an engine that computes neither.

    Args:
        head: the EAGLE-3 head being exported.
        engine: the engine and its format, e.g. ``"llama.cpp"``.
        computes: what the engine's code does instead (names its files), one clause.

    Raises:
        ExportError: the head sets a flag; names the flags, the engine, what it computes and the formats that take
            the head.
    """
    flags = head.config.eagle31_flags
    if flags:
        raise ExportError(
            f"this is an EAGLE-3.1 head ({', '.join(f'{k}=true' for k in flags)}); {computes}, so {engine} would "
            "draft with another function. Export it with --format speculators (vLLM), serve it with selfspec, or "
            f"train with eagle3.fc_norm / eagle3.norm_output false for {engine}"
        )


def gguf_field(reader: Any, path: str | Path, key: str, draft: str) -> list:
    """One metadata field of a GGUF file as a list (a scalar field becomes a one-item list).

    Args:
        reader: the file's ``gguf.GGUFReader``. path: the file, for the message. key: the metadata key.
        draft: what the converter was asked to write, for the message (``"an EAGLE-3 draft"``).

    Raises:
        ExportError: the key is missing (the converter did not see such a draft).
    """
    found = reader.fields.get(key)
    if found is None:
        raise ExportError(f"{path}: no {key} in the GGUF metadata; the converter did not see {draft}")
    value = found.contents()
    return value if isinstance(value, list) else [value]


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


def rename_exact(
    state: Mapping[str, torch.Tensor],
    names: Mapping[str, str],
    fmt: str,
    fix: str = "the head's architecture does not fit it (export heads of a plain Llama layer, or keep this head in "
    "selfspec's own format)",
) -> dict[str, torch.Tensor]:
    """Rename every tensor of ``state`` through ``names``; a tensor the layout does not name is an error. Serves
    exports (selfspec names -> the format's) and imports (the format's names -> selfspec's) alike.

    Raises:
        ExportError: tensors with a trainer prefix (:func:`check_trainer_prefix`), or listing the tensors the format
            has no name for (never silently dropped), followed by ``fix``.
    """
    check_trainer_prefix(state, names, fmt)
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise ExportError(f"unexpected tensors {unknown}: the {fmt} layout has no name for them; {fix}")
    return {names[k]: v.detach() for k, v in state.items()}


def check_trainer_prefix(state: Mapping[str, torch.Tensor], names: Mapping[str, str], fmt: str) -> None:
    """Refuse tensor names that are a layout name under a trainer prefix (:data:`TRAINER_PREFIXES`), such as
    ``module.fc.weight``: an engine that strips or skips the prefix would load nothing of them, silently.

    Args:
        state: the tensors to write or read, by name.
        names: the layout's names (the keys are checked).
        fmt: the format, named in the message.

    Raises:
        ExportError: naming the prefix and the fix (export or save the unwrapped head).
    """
    for prefix in TRAINER_PREFIXES:
        hits = sorted(k for k in state if k.startswith(prefix) and k[len(prefix) :] in names and k not in names)
        if hits:
            raise ExportError(
                f"tensors {hits[:3]} carry the trainer prefix {prefix!r}, which the {fmt} layout does not have: "
                f"strip it (save the unwrapped head, e.g. model.{prefix.rstrip('.')} of a wrapper) and export again"
            )


def write_export(
    out_dir: str | Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write an export directory as a whole: ``config.json`` + ``model.safetensors`` (tensors contiguous, on the
    CPU; the metadata carries ``format: pt`` and a checksum) and ``extra_files`` (name -> bytes, e.g.
    :data:`TOKEN_MAP_NAME`), staged in a sibling directory and renamed into place. A previous export at
    ``out_dir`` is replaced whole (no stale token map survives); a failure leaves it as it was.

    Returns:
        ``out_dir`` (resolved).

    Raises:
        ExportError: ``out_dir`` is a file, or a directory holding files no export writes (it is never replaced
            then: pass a new or empty directory); an extra file name outside :data:`EXPORT_FILES`.
        OSError: the disk refused a write.
    """
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory; pass a new directory for the export")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES)
        if foreign:
            raise ExportError(
                f"{out} holds files an export does not write ({foreign[:5]}); an export replaces its directory as "
                "a whole: pass a new or empty directory"
            )
    bad = sorted(set(extra_files or {}) - EXPORT_FILES)
    if bad:
        raise ExportError(f"export files must be among {sorted(EXPORT_FILES)}, got {bad}")
    stage = staging_dir(out, "export")
    try:
        write_head_dir(stage, config, {WEIGHTS_NAME: dict(tensors)})
        for name, data in (extra_files or {}).items():
            with open(stage / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out
