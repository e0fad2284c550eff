"""Adapter targets: a base model plus a PEFT adapter (LoRA; Hu et al. 2021, arXiv:2106.09685), merged at load.

Why merge (``peft``'s ``merge_and_unload``, ``W + scale * B @ A`` written into each adapted linear layer of a
model selfspec owns) instead of decoding through the ``PeftModel``: the verifier runs the target's own
backbone and lm_head (``decode/verifier.py``), and on a CPU swaps its ``nn.Linear`` layers for twins holding
packed kernels (``base/cpu_linear.py``); a LoRA layer is not an ``nn.Linear`` and its two extra matmuls
would be skipped or need their own path. The merged model is a plain ``PreTrainedModel``: every verifier
path, the target check and the feature capture see the same forward, so speculative decoding is exactly the
merged model's own greedy ``generate``. The merged weights differ from the unmerged adapter's two-matmul
forward by float rounding only (about 1e-6 relative in float32); the merge is done in float32 and the model
cast to the requested dtype after.

The merged model's fingerprint names base and adapter (:func:`selfspec.base.fingerprint.register_fingerprint`), the
base part taken from the base's weights before the merge changed them, so heads trained on it are refused on the
bare base and the other way round.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftModel

from selfspec.base.errors import UserError
from selfspec.base.fingerprint import register_fingerprint, target_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# PEFT methods whose adapter merges into the base weights (prompt-learning methods do not)
MERGEABLE = ("LORA", "ADALORA", "LOHA", "LOKR", "IA3", "OFT", "BOFT")


class AdapterError(UserError):
    """An adapter that cannot be applied to the target given (missing, of another base model, not mergeable)."""


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of a directory written by ``PeftModel.save_pretrained``.

    Raises:
        AdapterError: the directory or its ``adapter_config.json`` is missing (the message names the fix).
    """
    d = Path(adapter_dir).expanduser()
    if not d.is_dir():
        raise AdapterError(
            f"adapter directory {d} does not exist: pass the directory PeftModel.save_pretrained wrote "
            "(for a Hub adapter, download it first: `huggingface-cli download ORG/NAME --local-dir DIR`)."
        )
    cfg_file = d / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{d} has no adapter_config.json: pass the directory PeftModel.save_pretrained wrote.")
    return json.loads(cfg_file.read_text())


def _names(model: PreTrainedModel, target_name: str | None) -> set[str]:
    """The lower-cased last path parts a base model goes by (its name, its resolved path, ``_name_or_path``)."""
    names = {target_name, getattr(model.config, "_name_or_path", None)}
    return {Path(str(n).rstrip("/")).name.lower() for n in names if n}


def _adapter_shapes(adapter_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    f = adapter_dir / "adapter_model.safetensors"
    if not f.is_file():
        return {}
    with safe_open(str(f), "pt") as fh:
        return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118 (safe_open is no dict)


def check_adapter_base(adapter_dir: str | Path, model: PreTrainedModel, target_name: str | None = None) -> None:
    """Refuse an adapter made for another base model before it is applied: by the base model named in its
    ``adapter_config.json`` (``base_model_name_or_path``, compared by the last path part, case-insensitive)
    and by the shapes of its LoRA tensors against the base's linear layers.

    Args:
        adapter_dir: the adapter directory.
        model: the loaded base model.
        target_name: the name the base was loaded by (an alias, a Hub id, a directory).

    Raises:
        AdapterError: missing directory, a method that does not merge, another base model by name, or a
            LoRA tensor whose shape does not fit the layer it adapts (the message names the fix).
    """
    d = Path(adapter_dir).expanduser()
    cfg = read_adapter_config(d)
    kind = str(cfg.get("peft_type", "")).upper()
    if kind not in MERGEABLE:
        raise AdapterError(
            f"adapter {d} is a {kind or 'unknown'} adapter; only {MERGEABLE} adapters merge into a target"
        )
    named = cfg.get("base_model_name_or_path")
    mine = _names(model, target_name)
    if named and mine and Path(str(named).rstrip("/")).name.lower() not in mine:
        raise AdapterError(
            f"adapter {d} was made for base model {named!r}, not for this target ({sorted(mine)}): load it on "
            f"{named!r}; if the target is that model under another name, set base_model_name_or_path in "
            f"{d / 'adapter_config.json'} to the target's name."
        )
    modules = dict(model.named_modules())
    for key, shape in _adapter_shapes(d).items():
        kind_a = ".lora_A." in key or key.endswith(".lora_A.weight")
        kind_b = ".lora_B." in key or key.endswith(".lora_B.weight")
        if not (kind_a or kind_b):
            continue
        path = key.removeprefix("base_model.model.").split(".lora_")[0]
        layer = modules.get(path)
        if layer is None:
            raise AdapterError(
                f"adapter {d} adapts layer {path!r}, which this target does not have: it is for another base model"
            )
        want = getattr(layer, "in_features", None) if kind_a else getattr(layer, "out_features", None)
        got = shape[1] if kind_a else shape[0]
        if want is not None and got != want:
            raise AdapterError(
                f"adapter {d}: {key} has shape {list(shape)}, but {path} takes {layer.in_features} -> "
                f"{layer.out_features}: the adapter is for another base model; load it on its own base."
            )


def merge_adapter(peft_model: PeftModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A plain model with the adapters of ``peft_model`` merged in (module docstring: why), fingerprinted as
    base + adapter, in eval mode with ``requires_grad`` off.

    ``peft_model`` is left as it is: a copy is merged (peak memory: twice the model) unless ``peft_model``
    was made by this module for itself.

    Args:
        peft_model: a ``PeftModel`` (``PeftModel.from_pretrained``, ``get_peft_model``,
            ``AutoPeftModelForCausalLM.from_pretrained``).
        dtype: the merged model's dtype (None: the base model's).

    Raises:
        AdapterError: an adapter method that does not merge.
    """
    return _merge(copy.deepcopy(peft_model), dtype)


def _merge(peft_model: PeftModel, dtype: torch.dtype | None) -> PreTrainedModel:
    kinds = {str(c.peft_type).split(".")[-1].upper() for c in peft_model.peft_config.values()}
    if not kinds <= set(MERGEABLE):
        raise AdapterError(f"{sorted(kinds)} adapters do not merge into a target; only {MERGEABLE} do")
    fingerprint = target_fingerprint(peft_model)  # the base's weights before the merge changes them, + the adapter
    base_dtype = next(peft_model.get_base_model().parameters()).dtype
    merged = peft_model.float().merge_and_unload()
    merged = merged.to(dtype or base_dtype).eval()
    merged.requires_grad_(False)
    register_fingerprint(merged, fingerprint)
    adapter = fingerprint.partition("+")[2]
    logger.info("merged the %s adapter (fingerprint %s) into the target", "/".join(sorted(kinds)), adapter)
    return merged


def load_adapted(
    base: PreTrainedModel,
    adapter: str | Path | PeftModel,
    target_name: str | None = None,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """The target ``base`` with ``adapter`` merged in (:func:`merge_adapter`).

    Args:
        base: the loaded base model; with an adapter directory it is consumed (merged in place: pass a model
            loaded for this call, as :func:`selfspec.target.load_target` does).
        adapter: a directory written by ``PeftModel.save_pretrained`` (checked first,
            :func:`check_adapter_base`), or a ``PeftModel`` wrapping ``base`` itself (a copy is merged; the
            ``PeftModel`` stays usable).
        target_name: the name ``base`` was loaded by, for the base-model check.
        dtype: the merged model's dtype (None: ``base``'s).

    Returns:
        The merged model (on ``base``'s device), fingerprinted as base + adapter.

    Raises:
        AdapterError: see :func:`check_adapter_base`; a ``PeftModel`` that does not wrap ``base``.
    """
    dtype = dtype or next(base.parameters()).dtype
    if isinstance(adapter, PeftModel):
        if adapter.get_base_model() is not base:
            raise AdapterError(
                "the PeftModel passed as adapter does not wrap this target: pass the PeftModel itself as the "
                "target (selfspec.load(peft_model, heads)), or its adapter directory as adapter=DIR."
            )
        return merge_adapter(adapter, dtype)
    check_adapter_base(adapter, base, target_name)
    peft_model = PeftModel.from_pretrained(base, str(Path(adapter).expanduser()), is_trainable=False)
    return _merge(peft_model, dtype)
