"""Import heads trained elsewhere (the speculators EAGLE-3, DFlash and DSpark layouts, the SGLang / SpecForge EAGLE
layouts, vLLM's ``MedusaModel``, the DFlash / DSpark layouts of SGLang and of the published checkpoints) into selfspec
heads, strictly.

The layouts are those :mod:`selfspec.export.speculators`, :mod:`selfspec.export.sglang` and
:mod:`selfspec.export.medusa_vllm` write (their docstrings cite the engine files); ``--format sglang`` reads the
three ``architectures`` SGLang's exports carry (``LlamaForCausalLMEagle3``, ``LlamaForCausalLMEagle`` with its
optional ``--speculative-token-map`` file, ``MedusaModel``). Reading refuses, with one
:class:`~selfspec.heads.io.HeadFormatError` that names the fix and before anything is written: an unknown format or
architecture, a truncated or corrupt safetensors file, missing / unexpected / wrong-shape tensors (all listed), tensor
names under a trainer prefix (``module.``, ``_orig_mod.``, ...), config flags the head cannot compute
(``norm_before_residual``, ``norm_before_fc``, a ``target_hidden_size`` of its own; in the SGLang layout any EAGLE-3.1
flag, which SGLang's ``LlamaForCausalLMEagle3`` does not compute) or that are not booleans, an embedding that is not
the target's, a head for another target (sizes, layer count, or the recorded fingerprint). A speculators EAGLE-3.1
checkpoint (``fc_norm`` and / or ``norm_output`` true, arXiv:2605.09992) becomes the EAGLE-3.1 head with the same
flags, its ``fc_norm.{0,1,2}.weight`` included. ``d2t`` is applied once: the draft ids are ``arange(S) + d2t``, and
``t2d`` must mark exactly those ids. Every tensor of the file is consumed: loaded into the head, or
(``embed_tokens.weight``) checked equal to the target's embedding, which selfspec heads use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

from selfspec.base.fingerprint import target_fingerprint
from selfspec.export.common import TOKEN_MAP_NAME, Head, rename_exact
from selfspec.export.medusa_vllm import MEDUSA_ARCHITECTURE, read_vllm_medusa
from selfspec.export.sglang import EAGLE3_ARCHITECTURE, EAGLE_ARCHITECTURE, eagle3_names, eagle_names
from selfspec.export.sglang_block import SGLANG_BLOCK_ARCHITECTURES, read_sglang_block
from selfspec.export.speculators import speculators_names
from selfspec.export.speculators_block import read_speculators_block
from selfspec.heads.dflash import BLOCK_HEAD_TYPES
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head, check_vocab_maps, default_target_layers
from selfspec.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadFormatError,
    check_draft_ids,
    check_fingerprint,
    check_state,
    read_config,
    read_safetensors,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["IMPORT_FORMATS", "import_heads", "read_foreign_head"]

IMPORT_FORMATS = ("speculators", "sglang")
# speculators' Eagle3SpeculatorConfig norm flags (speculators/models/eagle3/config.py), all default false.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
EAGLE31_FLAGS = ("fc_norm", "norm_output")  # the ones selfspec's head computes (Eagle3Config fields)


def _arch(raw: dict[str, Any], where: str) -> Any:
    cfg = dict(raw)
    model_type = cfg.pop("model_type", None)
    for key in ("architectures", "draft_vocab_size", "eagle_config", "target_model", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("selfspec_")}
    if model_type != "llama":
        raise HeadFormatError(f"{where}: the draft layer is {model_type!r}; these layouts hold Llama layers")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError, TypeError) as err:
        raise HeadFormatError(f"{where}: not a transformers Llama config ({err})") from err


def _check_target(arch: Any, target: PreTrainedModel, fingerprint: str, where: str) -> None:
    cfg = target.config
    if (arch.hidden_size, arch.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise HeadFormatError(
            f"{where}: the head has hidden {arch.hidden_size} / vocab {arch.vocab_size}, the target "
            f"{cfg.hidden_size} / {cfg.vocab_size}: it belongs to another target; pass the target it was trained on"
        )
    if cfg.model_type != "llama":
        raise HeadFormatError(f"{where}: the target is a {cfg.model_type!r} model; these layouts hold Llama heads")
    check_fingerprint(where, fingerprint, target_fingerprint(target), unrecorded_warning=False)


def _renamed(state: dict[str, torch.Tensor], names: dict[str, str], fmt: str, d: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``fmt`` layout under selfspec's module names (``names`` inverted: layout -> selfspec)."""
    fix = f"pass the directory the trainer exported for serving ({d / WEIGHTS_NAME}), or the right --format"
    return rename_exact(state, {v: k for k, v in names.items()}, fmt, fix=fix)


def _embed_consumed(state: dict[str, torch.Tensor], target: PreTrainedModel, where: str) -> None:
    emb = state.pop("embed_tokens.weight", None)
    if emb is None:
        return
    own = target.get_input_embeddings().weight.detach()
    # a checkpoint saved in a lower precision (speculators' trainer saves bf16) holds the target's embedding rounded
    if emb.shape != own.shape or not torch.equal(emb, own.to(emb.dtype)):
        raise HeadFormatError(
            f"{where}: embed_tokens.weight is not the target's embedding (selfspec heads use the target's); "
            "pass the target the head was trained on"
        )


def _norm_flags(raw: dict[str, Any], fmt: str, where: str) -> dict[str, bool]:
    """The EAGLE-3.1 flags of a config (``{fc_norm, norm_output}``, missing = false), refusing a flag that is not a
    boolean, a flag selfspec's head does not compute, and in the SGLang layout (whose ``LlamaForCausalLMEagle3``
    computes none of them) any set flag."""
    flags = {k: raw.get(k, False) for k in NORM_FLAGS}
    odd = sorted(k for k, v in flags.items() if not isinstance(v, bool))
    if odd:
        raise HeadFormatError(f"{where}: {odd} must be true or false, got {[flags[k] for k in odd]}")
    on = [k for k in NORM_FLAGS if flags[k]]
    unsupported = [k for k in on if fmt == "sglang" or k not in EAGLE31_FLAGS]
    if unsupported:
        fix = (
            "SGLang's LlamaForCausalLMEagle3 computes none of them; import the trainer's speculators export "
            "(--format speculators) if it has one"
            if fmt == "sglang"
            else f"selfspec's EAGLE-3 head computes {list(EAGLE31_FLAGS)} (EAGLE-3.1) and none of the others"
        )
        raise HeadFormatError(f"{where}: {unsupported} set; {fix}")
    return {k: flags[k] for k in EAGLE31_FLAGS}


def _eagle3(d: Path, raw: dict[str, Any], fmt: str, target: PreTrainedModel) -> Eagle3Head:
    where = str(d / CONFIG_NAME)
    flags = _norm_flags(raw, fmt, where)
    if fmt == "speculators":
        if raw.get("speculators_model_type") != "eagle3":
            raise HeadFormatError(
                f"{where}: speculators_model_type must be 'eagle3', got {raw.get('speculators_model_type')!r}"
            )
        if raw.get("target_hidden_size") not in (None, raw["transformer_layer_config"].get("hidden_size")):
            raise HeadFormatError(f"{where}: ['target_hidden_size'] set; selfspec's EAGLE-3 head computes none")
        layer_raw, names = raw["transformer_layer_config"], speculators_names(flags["fc_norm"])
        layers = raw.get("eagle_aux_hidden_state_layer_ids")
    else:
        for key in NORM_FLAGS:  # checked false above; not transformers config fields
            raw.pop(key, None)
        layer_raw, names = raw, eagle3_names("midlayer.")
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = raw.get("selfspec_target_layers") or ([i + 1 for i in aux] if aux else None)  # SGLang: layer outputs
    arch = _arch(layer_raw, where)
    _check_target(arch, target, raw.get("selfspec_target_fingerprint", ""), where)
    S = int(raw.get("draft_vocab_size") or arch.vocab_size)
    state = read_safetensors(d / WEIGHTS_NAME)
    _embed_consumed(state, target, str(d / WEIGHTS_NAME))
    state = _renamed(state, names, fmt, d)
    if S == arch.vocab_size and "d2t" not in state and "t2d" not in state:
        state["d2t"], state["t2d"] = torch.zeros(S, dtype=torch.long), torch.ones(S, dtype=torch.bool)
    if "d2t" in state and "t2d" in state:
        check_vocab_maps(state["d2t"], state["t2d"], S, arch.vocab_size, str(d / WEIGHTS_NAME))
    L = target.config.num_hidden_layers
    try:
        config = Eagle3Config(
            hidden_size=arch.hidden_size,
            vocab_size=arch.vocab_size,
            draft_vocab_size=S,
            num_target_layers=L,
            target_layers=tuple(layers) if layers else default_target_layers(L),
            target=str(
                raw.get("target_model")
                or (raw.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
                or ""
            ),
            target_fingerprint=target_fingerprint(target),
            **flags,
        )
    except ValueError as err:
        raise HeadFormatError(f"{where}: {err}") from err
    draft_ids = torch.arange(S) + state["d2t"] if "d2t" in state else None  # d2t applied here, once
    head = Eagle3Head(config, arch, draft_ids=draft_ids)
    check_state(d / WEIGHTS_NAME, state, head.state_dict())
    head.load_state_dict(state, strict=True)
    head.attach_target(target)
    return head


def _token_map(d: Path, raw: dict[str, Any], vocab_size: int) -> torch.Tensor | None:
    """The draft ids of SGLang's ``--speculative-token-map`` file beside an EAGLE-1 export, or None (full
    vocabulary). A config that names the file and a missing file are both errors."""
    named = raw.get("selfspec_speculative_token_map")
    path = d / (named or TOKEN_MAP_NAME)
    if not path.is_file():
        if named:
            raise HeadFormatError(f"{d / CONFIG_NAME} names the token map {named}, which is missing: copy it beside it")
        return None
    try:
        ids = torch.as_tensor(torch.load(path, weights_only=True), dtype=torch.long).reshape(-1)
    except (OSError, RuntimeError, EOFError, TypeError, ValueError) as err:  # torch.load's errors for a bad file
        raise HeadFormatError(f"cannot read {path}: {err} (truncated or corrupt); export the heads again") from err
    check_draft_ids(ids, ids.numel(), vocab_size, str(path))
    return ids


def _eagle(d: Path, raw: dict[str, Any], target: PreTrainedModel) -> EagleHead:
    where = str(d / CONFIG_NAME)
    arch = _arch(raw, where)
    _check_target(arch, target, raw.get("selfspec_target_fingerprint", ""), where)
    draft_ids = _token_map(d, raw, arch.vocab_size)
    state = _renamed(read_safetensors(d / WEIGHTS_NAME), eagle_names("layers.0."), "sglang", d)
    config = EagleConfig(
        hidden_size=arch.hidden_size,
        vocab_size=arch.vocab_size,
        fc_bias="fc.bias" in state,
        draft_vocab_size=None if draft_ids is None else draft_ids.numel(),
        target=str(raw.get("target_model") or ""),
        target_fingerprint=target_fingerprint(target),
    )
    head = EagleHead(config, arch, draft_ids=draft_ids)
    check_state(d / WEIGHTS_NAME, state, head.state_dict())
    head.load_state_dict(state, strict=True)
    head.attach_target(target)
    return head


def read_foreign_head(src: str | Path, fmt: str, target: PreTrainedModel) -> Head:
    """Read a head directory of another trainer into a selfspec head attached to ``target`` (fp32 as stored).

    Args:
        src: the directory (``config.json`` + ``model.safetensors``).
        fmt: ``"speculators"`` (EAGLE-3; DFlash and DSpark, :func:`~selfspec.export.speculators_block.
            read_speculators_block`) or ``"sglang"`` (``LlamaForCausalLMEagle3``, ``LlamaForCausalLMEagle``,
            vLLM's ``MedusaModel``; ``DFlashDraftModel`` and ``Qwen3DSparkModel``, also the published z-lab DFlash
            and DeepSpec DSpark checkpoints, :func:`~selfspec.export.sglang_block.read_sglang_block`).
        target: the frozen target the head drafts for; sizes, layers and any recorded fingerprint are checked.

    Raises:
        HeadFormatError: see the module docstring; nothing is returned half-loaded.
    """
    if fmt not in IMPORT_FORMATS:
        raise HeadFormatError(f"unknown import format {fmt!r}; choose one of {list(IMPORT_FORMATS)}")
    d = Path(src)
    raw = read_config(d)
    if fmt == "speculators":
        if "speculators_model_type" not in raw or not isinstance(raw.get("transformer_layer_config"), dict):
            raise HeadFormatError(
                f"{d / CONFIG_NAME} is not a speculators config (no speculators_model_type / "
                "transformer_layer_config); try --format sglang"
            )
        if raw["speculators_model_type"] in BLOCK_HEAD_TYPES:
            return read_speculators_block(d, raw, target)
        return _eagle3(d, raw, fmt, target)
    arch = list(raw.get("architectures") or [])
    if arch == [EAGLE3_ARCHITECTURE]:
        return _eagle3(d, raw, fmt, target)
    if arch == [EAGLE_ARCHITECTURE]:
        return _eagle(d, raw, target)
    if arch == [MEDUSA_ARCHITECTURE] or (not arch and raw.get("model_type") == "medusa"):
        return read_vllm_medusa(d, raw, target)
    if len(arch) == 1 and arch[0] in SGLANG_BLOCK_ARCHITECTURES.values():
        if "selfspec" in raw:
            raise HeadFormatError(
                f"{d / CONFIG_NAME} is a selfspec head directory already: load it with selfspec.load, no import"
            )
        return read_sglang_block(d, raw, target)
    known = [EAGLE3_ARCHITECTURE, EAGLE_ARCHITECTURE, MEDUSA_ARCHITECTURE, *SGLANG_BLOCK_ARCHITECTURES.values()]
    raise HeadFormatError(
        f"{d / CONFIG_NAME} has architectures {arch}; the sglang format reads one of {known} "
        "(a speculators directory: --format speculators)"
    )


def import_heads(src: str | Path, fmt: str, out_dir: str | Path, target: PreTrainedModel) -> Path:
    """:func:`read_foreign_head`, then ``save_pretrained(out_dir)`` (atomic): a selfspec head directory that
    ``selfspec.load`` decodes, benches and exports. Returns ``out_dir``.

    Raises:
        HeadFormatError: see :func:`read_foreign_head`; ``out_dir`` is not touched then. ``out_dir`` the source
            itself (the head would replace the files it came from).
    """
    if Path(out_dir).resolve() == Path(src).resolve():
        raise HeadFormatError(f"--out {out_dir} is the source directory; pass a new directory for the selfspec heads")
    head = read_foreign_head(src, fmt, target)
    return head.save_pretrained(out_dir)
