"""Which target a head was trained on: a short fingerprint stored with every head and checked on load.

A bare target's fingerprint (version 2) is ``"v2-"`` and 16 hex characters: a hash of the architecture, the sizes,
and, for every weight tensor of the model in module order (the embeddings, every decoder layer's projections and
norms, the final norm, an untied lm_head), its shape and the sign bits of up to :data:`SAMPLE` of its values (64
evenly spaced slices). Why sign bits: a value's sign survives every rounding a load can do (fp32 -> bf16 or
fp16 rounds to nearest, keeps the sign, and flushes what underflows to a zero of the same sign; what overflows
fp16 becomes an infinity of the same sign), so fp32, bf16 and fp16 loads of the same weights, from a checkpoint in
any of them, have the same fingerprint exactly, with no rounding boundary to fall on; a finer grid of magnitudes
cannot promise that (a fp16 load of fp32 weights rounds twice, and about one value in eight then lands a bf16 step
away from the bf16 load's). A fine-tune moves the weights near zero across it: a move of 1e-3 of a tensor's spread
flips about 0.03 % of its signs (1 / pi of it), some 20 of the 65,536 sampled, so a changed layer changes the
fingerprint (the norms, whose weights stay positive, count by their shape and signs only; the layers around them
change with them).

A target adapted by a PEFT adapter (LoRA) is named by both parts, ``"v2-<base 16 hex>+<adapter 16 hex>"``, so a
head trained on the adapted target is refused on the bare base and the other way round (:func:`mismatch_hint` says
which fix applies). The adapter part comes from the ``PeftModel`` itself (:func:`adapter_fingerprint`) or, for a
model merged from one (``merge_and_unload``, as :func:`selfspec.base.adapter.load_adapted` does), from
:func:`register_fingerprint`: a weak table kept here, so no attribute is ever set on the target; the base part is the
base's before the merge. A target whose decoder layers are sharded across processes (:mod:`selfspec.base.
target_shards`) is registered the same way, with the fingerprint of its whole weights taken before the sharding.

Version 1 (16 hex characters, no prefix; heads saved before version 2 carry it) hashed the sizes and a slice of the
input embeddings only. :func:`target_fingerprint` returns a :class:`TargetFingerprint`, which also carries the
target's version-1 fingerprint, so such heads are still checked, the old way (:func:`fingerprint_as_stored`).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FINGERPRINT_VERSION = 2
PREFIX = f"v{FINGERPRINT_VERSION}-"
SAMPLE = 1 << 16  # sign bits per weight tensor (a tensor of up to 65,536 values counts whole)
BLOCKS = 64  # runs of consecutive values a larger tensor's sample is taken in
ADAPTER_KEYS = ("lora_", "hada_", "lokr_", "ia3_", "oft_", "boft_")  # the names of adapter tensors in a PeftModel
_NOT_BASE = (*ADAPTER_KEYS, "modules_to_save.")  # tensors a PeftModel holds beside its base model's
_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# merged model -> its fingerprint, taken before the merge (entries die with the model)
_REGISTERED: weakref.WeakKeyDictionary[torch.nn.Module, TargetFingerprint] = weakref.WeakKeyDictionary()


class TargetFingerprint(str):
    """A target's fingerprint (the string, version :data:`FINGERPRINT_VERSION`) that also carries the same target's
    version-1 fingerprint (``legacy``), for heads saved with one (:func:`fingerprint_as_stored`)."""

    legacy: str

    def __new__(cls, value: str, legacy: str = "") -> TargetFingerprint:
        self = super().__new__(cls, value)
        self.legacy = legacy
        return self

    def __getnewargs__(self) -> tuple[str, str]:  # copies and pickles keep the legacy part
        return str(self), self.legacy


def fingerprint_version(fingerprint: str) -> int:
    """The version a stored fingerprint was computed by: ``"v<N>-..."`` is N, a bare hex string is 1."""
    head, dash, _ = fingerprint.partition("-")
    if dash and head[:1] == "v" and head[1:].isdigit():
        return int(head[1:])
    return 1


def fingerprint_as_stored(stored: str, given: str) -> str:
    """The fingerprint of the target ``given`` names, in the version ``stored`` was computed by: ``given`` itself,
    or its version-1 fingerprint when ``stored`` is a version-1 one and ``given`` carries it
    (a :class:`TargetFingerprint`). Compare the result with ``stored``."""
    if fingerprint_version(stored) == 1 and isinstance(given, TargetFingerprint) and given.legacy:
        return given.legacy
    return given


def _sign_bits(tensor: torch.Tensor) -> bytes:
    """The sign bits of up to :data:`SAMPLE` values of ``tensor``, packed: all of them, or :data:`BLOCKS` evenly spaced
    runs of consecutive values (slices of rows: cheap to read on any device)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():  # the sign is the top bit of every IEEE format: read it as an integer's
        flat = flat.view(_SAME_WIDTH_INT[flat.element_size()])
    n, run = flat.numel(), SAMPLE // BLOCKS
    if n <= SAMPLE:
        values = flat.cpu().numpy()
    else:
        runs = [flat[i * (n - run) // (BLOCKS - 1) :][:run] for i in range(BLOCKS)]
        on_cpu = flat.device.type == "cpu"  # numpy joins views there without a torch kernel; elsewhere one copy back
        values = np.concatenate([r.numpy() for r in runs]) if on_cpu else torch.cat(runs).cpu().numpy()
    return np.packbits(values < 0).tobytes()


def _base_digest(model: torch.nn.Module) -> str:
    """16 hex: the sizes, and every base weight tensor's shape and sign bits (module docstring)."""
    cfg = model.config
    h = hashlib.sha256()
    sizes = [FINGERPRINT_VERSION, cfg.model_type, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers]
    h.update(json.dumps(sizes).encode())
    for name, p in model.named_parameters():
        if any(key in name for key in _NOT_BASE):
            continue
        h.update(json.dumps(list(p.shape)).encode())
        h.update(_sign_bits(p))
    return h.hexdigest()[:16]


def _legacy_base_digest(model: torch.nn.Module) -> str:
    """16 hex: version 1 (the sizes and a slice of the input embeddings rounded at fp32 precision)."""
    cfg = model.config
    h = hashlib.sha256()
    h.update(json.dumps([cfg.model_type, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers]).encode())
    emb = model.get_input_embeddings().weight
    sample = emb[:: max(1, emb.shape[0] // 64), :8].detach().to(torch.float32).cpu()
    h.update(sample.numpy().round(3).tobytes())
    return h.hexdigest()[:16]


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``AutoPeftModelForCausalLM`` returns one): by the class names of
    its type, so asking never imports ``peft``."""
    return any(c.__name__ == "PeftModel" for c in type(model).__mro__)


def _adapter_digest(peft_model: torch.nn.Module, legacy: bool) -> str:
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
        if legacy and any(k in key for k in ("lora_", "hada_", "lokr_", "ia3_")):
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].to(torch.float32).cpu()
            h.update(key.encode())
            h.update(sample.numpy().round(4).tobytes())
        elif not legacy and any(k in key for k in ADAPTER_KEYS):
            h.update(json.dumps([key, list(p.shape)]).encode())
            h.update(_sign_bits(p))
    return h.hexdigest()[:16]


def adapter_fingerprint(peft_model: torch.nn.Module) -> str:
    """A short, stable fingerprint of the adapters held by a ``peft.PeftModel``: each adapter's type, rank,
    scaling and target modules, and every adapter tensor's name, shape and sign bits (``lora_A`` / ``lora_B`` ...;
    the same in every dtype, as for the base: module docstring).

    Args:
        peft_model: a ``PeftModel`` (anything with a ``peft_config`` dict).

    Returns:
        16 hex characters.

    Raises:
        ValueError: ``peft_model`` holds no adapter.
    """
    return _adapter_digest(peft_model, legacy=False)


def register_fingerprint(model: torch.nn.Module, fingerprint: TargetFingerprint) -> None:
    """Record ``fingerprint`` as ``model``'s, taken before ``model`` was changed in place: a base model with an
    adapter merged into it (the fingerprint of the ``PeftModel`` before the merge: base and adapter parts), or a target
    whose decoder layers were then sharded across processes (each process holds a part of their weights). From then
    on :func:`target_fingerprint` returns it. The model is not modified (a weak table holds the entry)."""
    _REGISTERED[model] = fingerprint


def target_fingerprint(model: PreTrainedModel) -> TargetFingerprint:
    """A short, stable fingerprint of a target: architecture, sizes and the sign bits of every weight tensor
    (module docstring: why it is the same in every dtype), plus the adapter's part when the target is a
    PEFT-adapted model.

    Heads store it so that loading them onto a different target is refused.

    Returns:
        ``"v2-"`` and 16 hex characters for a bare target; ``"v2-<base>+<adapter>"`` for an adapted one; as a
        :class:`TargetFingerprint`, whose ``legacy`` is the version-1 fingerprint of the same target.
    """
    registered = _REGISTERED.get(model)
    if registered is not None:
        return registered
    base, legacy = PREFIX + _base_digest(model), _legacy_base_digest(model)
    if is_peft_model(model):
        base += "+" + adapter_fingerprint(model)
        legacy += "+" + _adapter_digest(model, legacy=True)
    return TargetFingerprint(base, legacy)


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
