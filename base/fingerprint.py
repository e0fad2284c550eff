"""Which target a head was trained on: a short fingerprint stored with every head and checked on load.

A bare target's fingerprint is 16 hex characters (architecture, sizes, a hash of embedding slices). A target
adapted by a PEFT adapter (LoRA) is named by both parts, ``"<base 16 hex>+<adapter 16 hex>"``, so a head
trained on the adapted target is refused on the bare base and the other way round
(:func:`mismatch_hint` says which fix applies). The adapter part comes from the ``PeftModel`` itself
(:func:`adapter_fingerprint`) or, for a model merged from one (``merge_and_unload``, as
:func:`selfspec.base.adapter.load_adapted` does), from :func:`register_adapter`: a weak table kept here, so no
attribute is ever set on the target.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# merged model -> fingerprint of the adapter merged into it (entries die with the model)
_ADAPTED: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``AutoPeftModelForCausalLM`` returns one): by the class names of
    its type, so asking never imports ``peft``."""
    return any(c.__name__ == "PeftModel" for c in type(model).__mro__)


def adapter_fingerprint(peft_model: torch.nn.Module) -> str:
    """A short, stable fingerprint of the adapters held by a ``peft.PeftModel``: each adapter's type, rank,
    scaling and target modules, and a hash of slices of every adapter tensor (``lora_A`` / ``lora_B`` ...).

    Args:
        peft_model: a ``PeftModel`` (anything with a ``peft_config`` dict).

    Returns:
        16 hex characters.

    Raises:
        ValueError: ``peft_model`` holds no adapter.
    """
    configs = getattr(peft_model, "peft_config", None)
    if not configs:
        raise ValueError("not a PeftModel: it holds no adapter config (peft_config)")
    h = hashlib.sha256()
    for name in sorted(configs):
        c = configs[name]
        fields = [str(getattr(c, "peft_type", "")), getattr(c, "r", None), getattr(c, "lora_alpha", None)]
        fields += [sorted(getattr(c, "target_modules", None) or []), bool(getattr(c, "use_rslora", False))]
        h.update(json.dumps([name, *fields], default=str).encode())
    for key, p in sorted(peft_model.state_dict().items()):
        if "lora_" in key or "hada_" in key or "lokr_" in key or "ia3_" in key:
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].to(torch.float32).cpu()
            h.update(key.encode())
            h.update(sample.numpy().round(4).tobytes())
    return h.hexdigest()[:16]


def register_adapter(model: torch.nn.Module, adapter_fp: str) -> None:
    """Record that ``model`` is a base model with the adapter of fingerprint ``adapter_fp`` merged into it,
    so :func:`target_fingerprint` names both. The model is not modified (a weak table holds the entry)."""
    _ADAPTED[model] = adapter_fp


def target_fingerprint(model: PreTrainedModel) -> str:
    """A short, stable fingerprint of a target: architecture, sizes and a hash of a few weight slices, plus
    the adapter's part when the target is a PEFT-adapted model (module docstring).

    Heads store it so that loading them onto a different target is refused.

    Returns:
        16 hex characters for a bare target; ``"<base>+<adapter>"`` (33 characters) for an adapted one.
    """
    cfg = model.config
    h = hashlib.sha256()
    h.update(json.dumps([cfg.model_type, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers]).encode())
    emb = model.get_input_embeddings().weight
    sample = emb[:: max(1, emb.shape[0] // 64), :8].detach().to(torch.float32).cpu()
    h.update(sample.numpy().round(3).tobytes())
    base = h.hexdigest()[:16]
    adapter = adapter_fingerprint(model) if is_peft_model(model) else _ADAPTED.get(model)
    return f"{base}+{adapter}" if adapter else base


def mismatch_hint(stored: str, given: str) -> str:
    """What to do when a head's fingerprint ``stored`` differs from the target's ``given``: a sentence naming
    the fix when the two share their base model and differ in the adapter, else ``""``."""
    s_base, _, s_adapter = stored.partition("+")
    g_base, _, g_adapter = given.partition("+")
    if s_base != g_base:
        return ""
    if s_adapter and not g_adapter:
        return (
            " The heads were trained on this base model with a PEFT adapter merged in: load the target with that "
            "adapter (selfspec.load(target, heads, adapter=ADAPTER_DIR); in training, target_adapter: ADAPTER_DIR; "
            "the heads' training_record.json names it)."
        )
    if g_adapter and not s_adapter:
        return (
            " The heads were trained on the bare base model, and this target has a PEFT adapter: load the target "
            "without the adapter, or train heads on the adapted target (target_adapter: ADAPTER_DIR)."
        )
    return " The heads were trained on this base model with another adapter: load the adapter they were trained with."
