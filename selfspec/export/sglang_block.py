"""DFlash (arXiv:2602.06036) and DSpark (arXiv:2607.05147) heads in the layouts SGLang loads, both ways; the same
layouts are the published checkpoints' (z-lab's DFlash, DeepSpec's DSpark), which import reads.

The contract, read from sglang's ``python/sglang/srt/models/dflash.py`` (``DFlashDraftModel``: ``__init__``,
``load_weights``), ``python/sglang/srt/speculative/dflash_utils.py`` (``parse_dflash_draft_config``),
``dflash_worker.py``, ``python/sglang/srt/models/qwen3.py`` (``set_dflash_layers_to_capture``),
``python/sglang/srt/models/dspark.py`` (``Qwen3DSparkModel``) and ``speculative/dspark_components/dspark_config.py``,
and from the reference ``dflash/model.py`` of z-lab's DFlash:

* **DFlash** (``--speculative-algorithm DFLASH``): ``config.json`` is a Qwen3 layer config (``model_type`` qwen3,
  ``num_hidden_layers`` the head's layers, ``layer_types`` all ``full_attention``, which SGLang runs as
  non-causal attention) with ``architectures: ["DFlashDraftModel"]``, ``block_size`` and ``dflash_config``
  ``{block_size, mask_token_id, target_layer_ids}``. ``target_layer_ids`` are layer *outputs* (SGLang captures the
  input of layer ``id + 1``; the reference indexes ``hidden_states[id + 1]``), which is what selfspec's
  :class:`~selfspec.heads.dflash.BlockConfig` stores. Tensors: ``fc.weight [D, kD]``, ``hidden_norm``,
  ``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
  mlp.{gate,up,down}_proj}``, ``norm``: selfspec's own names. The block ``[anchor, mask, ..]`` is embedded with the
  target's embedding, slot ``j >= 1`` predicts ``x_{n+j}`` through the target's lm_head: selfspec's DFlash head.
* **DSpark** (``--speculative-algorithm DSPARK``): the same layers with ``architectures: ["Qwen3DSparkModel"]`` and,
  at the top level as DeepSpec's checkpoints write them, ``block_size`` (gamma: every slot predicts, slot ``j`` the
  token ``x_{n+1+j}``, and SGLang's ``--speculative-num-draft-tokens`` is ``block_size + 1``), ``mask_token_id``,
  ``target_layer_ids``, ``markov_rank``, ``markov_head_type: vanilla``, ``enable_confidence_head`` and
  ``confidence_head_with_markov: true``; tensors also ``markov_head.markov_w{1,2}.weight [V, R]`` and
  ``confidence_head.proj.{weight [1, D + R], bias}``. No ``speculators_model_type`` (SGLang's DSPARK refuses a
  speculators config for its other slot convention).

SGLang skips a tensor name it does not know and keeps no reduced draft vocabulary (it drafts the argmax over the
target's lm_head; ``d2t`` is never read), so export refuses, with the reason: a head with a reduced draft
vocabulary, a target whose embedding is scaled (Gemma: SGLang applies the normalizer in the target model's forward,
not in the embedding module the draft shares) or whose logits are soft-capped, and repeated target layers. Import
reads these layouts and the published checkpoints (``z-lab/Qwen3-*-DFlash-b16``; DeepSpec's
``deepseek-ai/dspark_*``, whose ``embed_tokens.weight`` / ``lm_head.weight`` must be the target's), refusing what
selfspec's head does not compute: a ``Qwen3DSparkModel`` without a Markov head (DeepSpec's DFlash checkpoints
predict from the anchor slot, selfspec's DFlash in place), sliding-window or biased attention, another Markov head
type, a confidence head without the Markov code, target layer 0's input or the last layer's output, and the extras
DFlash variants add (``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale``, ``conv_*``,
``selector_*``, ``projector_type``, ``attention_sink_bias``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import Qwen3Config

from selfspec.base.fingerprint import target_fingerprint
from selfspec.export.common import ExportError, rename_exact, write_export
from selfspec.export.speculators_block import block_config, block_tensor_names, check_plain_block, verifier_copy
from selfspec.heads.dflash import BlockHead
from selfspec.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadFormatError,
    check_fingerprint,
    load_state,
    read_safetensors,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SGLANG_BLOCK_ARCHITECTURES", "export_sglang_block", "read_sglang_block"]

SGLANG_BLOCK_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}
FORMAT = "sglang"
# config keys of DFlash variants that change what the draft computes; selfspec's head computes none of them.
_VARIANT_KEYS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale", "projector_type")
_VARIANT_PREFIXES = ("conv_", "selector_", "attention_sink")
# keys of the layout that are not Qwen3 layer config fields.
_LAYOUT_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "block_size",
        "dflash_config",
        "mask_token_id",
        "target_layer_ids",
        "num_target_layers",
        "num_anchors",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "target_model",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "model_type",
        "draft_vocab_size",
    }
)


def export_sglang_block(head: BlockHead, out_dir: str | Path, *, target_name_or_path: str) -> Path:
    """Write a DFlash / DSpark ``head`` in the layout SGLang's ``DFLASH`` / ``DSPARK`` drafters load (module
    docstring), atomically.

    Args:
        head: a :class:`BlockHead` with its target attached and a full draft vocabulary, any float dtype.
        out_dir: the directory to write (created, or replaced as a whole).
        target_name_or_path: the target model, written as ``target_model`` for the user.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ExportError: no target attached, a reduced draft vocabulary, a scaled embedding or soft-capped logits of the
            target, repeated target layers; nothing is written then.
    """
    cfg = head.config
    check_plain_block(
        head,
        "SGLang",
        embed_code="the draft embeds the block with the target's embed_tokens module (sglang models/dflash.py), "
        "and Gemma's normalizer is applied in the target's forward, not in that module",
        cap_code="SGLang's DFLASH / DSPARK drafters take the argmax of the target lm_head's raw output",
    )
    if cfg.n_draft < cfg.vocab_size:
        raise ExportError(
            f"the head drafts over a reduced vocabulary of {cfg.n_draft} tokens; SGLang's DFLASH / DSPARK drafters "
            "take the target's full lm_head and never read d2t (sglang models/dflash.py), so they would draft with "
            "another function: train with draft_vocab_size=null, or export --format speculators / gguf"
        )
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    tensors = rename_exact(state, block_tensor_names(head), FORMAT)
    config = head.layer_config.to_dict()
    for key in ("_attn_implementation_autoset", "torch_dtype", "head_type", "selfspec", "architectures"):
        config.pop(key, None)
    layers = list(cfg.target_layer_ids)
    config.update(
        {
            "architectures": [SGLANG_BLOCK_ARCHITECTURES[cfg.head_type]],
            "model_type": "qwen3",
            "dtype": str(head.fc.weight.dtype).removeprefix("torch."),
            "layer_types": ["full_attention"] * cfg.num_layers,
            "tie_word_embeddings": False,
            "block_size": cfg.block_size,
            "num_target_layers": cfg.num_target_layers,
            "target_model": target_name_or_path,
            "selfspec_target_fingerprint": cfg.target_fingerprint,
        }
    )
    if cfg.head_type == "dflash":
        config["dflash_config"] = {
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": layers,
        }
    else:
        config.update(
            {
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": layers,
                "markov_rank": cfg.markov_rank,
                "markov_head_type": "vanilla",
                "enable_confidence_head": cfg.confidence,
                "confidence_head_with_markov": True,
            }
        )
    return write_export(out_dir, config, tensors)


def _setting(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    """``dflash_config.KEY``, else the top-level ``KEY`` (SGLang's ``parse_dflash_draft_config`` order)."""
    nested = raw.get("dflash_config") or {}
    return nested[key] if key in nested else raw.get(key, default)


def _layer(raw: dict[str, Any], kind: str, where: str) -> Qwen3Config:
    problems = []
    if raw.get("model_type") != "qwen3":
        problems.append(f"the draft layer is {raw.get('model_type')!r}; selfspec's block heads hold Qwen3 layers")
    if raw.get("attention_bias"):
        problems.append("attention_bias is set; selfspec's block layers have no attention bias")
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        problems.append("sliding-window (causal) layers; selfspec's block layers attend the whole block and context")
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw.get('hidden_act')!r}; selfspec's block layers use silu")
    variants = sorted(
        k for k, v in raw.items() if v not in (None, False) and (k in _VARIANT_KEYS or k.startswith(_VARIANT_PREFIXES))
    )
    variants += sorted(
        k for k, v in (raw.get("dflash_config") or {}).items() if v is not None and k not in _LAYOUT_KEYS
    )
    if variants:
        problems.append(f"{variants} set: a DFlash variant selfspec's {kind} head does not compute")
    if problems:
        raise HeadFormatError(f"{where}: " + "; ".join(problems))
    layer = {k: v for k, v in raw.items() if k not in _LAYOUT_KEYS and not k.startswith("selfspec_")}
    try:
        return Qwen3Config(**layer)
    except (TypeError, ValueError) as err:
        raise HeadFormatError(f"{where}: not a Qwen3 layer config ({err})") from err


def _block_config(raw: dict[str, Any], kind: str, layer: Qwen3Config, target: PreTrainedModel, where: str):
    """Refuse what the SGLang layouts say that selfspec's head does not compute, then read the config through the
    speculators reader (:func:`~selfspec.export.speculators_block.block_config`), the layout translated."""
    L = target.config.num_hidden_layers
    problems = []
    if raw.get("draft_vocab_size") not in (None, target.config.vocab_size):
        problems.append(f"draft_vocab_size {raw.get('draft_vocab_size')}: SGLang's layouts draft the full vocabulary")
    ids = _setting(raw, "target_layer_ids")
    if not ids or not all(isinstance(i, int) and 0 <= i <= L - 2 for i in ids):
        problems.append(
            f"target_layer_ids {ids} must be layer outputs in [0, {L - 2}]: transformers returns the last layer's "
            "state after the final norm"
        )
    mask = _setting(raw, "mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < target.config.vocab_size:
        problems.append(f"mask_token_id {mask} must be a token id of the target (0 .. {target.config.vocab_size - 1})")
    if kind == "dspark" and not raw.get("markov_rank"):
        problems.append(
            "markov_rank is 0: a DeepSpec DFlash checkpoint, whose slots predict from the anchor (slot j the token "
            "x_{n+1+j}), while selfspec's dflash head predicts in place; selfspec does not compute it"
        )
    if problems:
        raise HeadFormatError(f"{where}: " + "; ".join(problems))
    speculators = {
        "speculators_model_type": kind,
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],  # layer inputs
        "block_size": int(_setting(raw, "block_size", 16)),
        "mask_token_id": mask,
        "sample_from_anchor": kind == "dspark",
        "speculators_config": {"verifier": {"name_or_path": raw.get("target_model") or ""}},
    }
    if kind == "dspark":
        keys = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
        speculators.update({k: raw[k] for k in keys if k in raw})
    return block_config(speculators, layer, target, where)


def read_sglang_block(d: Path, raw: dict[str, Any], target: PreTrainedModel) -> BlockHead:
    """Read an SGLang ``DFlashDraftModel`` / ``Qwen3DSparkModel`` directory, or a published z-lab DFlash / DeepSpec
    DSpark checkpoint, into a :class:`BlockHead` attached to ``target``.

    Args:
        d: the directory (``config.json`` + ``model.safetensors``).
        raw: its parsed ``config.json``.
        target: the frozen target; its hidden size, layer count and a recorded ``selfspec_target_fingerprint`` are
            checked.

    Returns:
        The head, as stored (fp32 or bf16 tensors loaded into an fp32 head), with the target attached.

    Raises:
        HeadFormatError: a config selfspec's head does not compute (module docstring), a head for another target,
            missing / unexpected / mis-shaped tensors, an ``embed_tokens.weight`` or ``lm_head.weight`` that is not
            the target's. Nothing is returned half-loaded.
    """
    where = str(d / CONFIG_NAME)
    kind = {v: k for k, v in SGLANG_BLOCK_ARCHITECTURES.items()}[raw["architectures"][0]]
    recorded = raw.get("selfspec_target_fingerprint") or ""  # published checkpoints record none
    check_fingerprint(d, recorded, target_fingerprint(target), unrecorded_warning=False)
    layer = _layer(raw, kind, where)
    config = _block_config(raw, kind, layer, target, where)
    path = d / WEIGHTS_NAME
    state = read_safetensors(path)
    verifier_copy(state, "embed_tokens.weight", target.get_input_embeddings().weight.detach(), str(path))
    verifier_copy(state, "lm_head.weight", target.get_output_embeddings().weight.detach(), str(path))
    head = BlockHead(config, layer)
    fix = f"pass the directory SGLang loads ({path}), or the right --format"
    state = rename_exact(state, {v: k for k, v in block_tensor_names(head).items()}, FORMAT, fix=fix)
    load_state(head, path, state)
    head.attach_target(target)
    return head
