"""DFlash (arXiv:2602.06036) and DSpark (arXiv:2607.05147) heads in the ``speculators`` format (0.9.0), both ways.

The contract, read from the ``speculators`` package 0.9.0: ``speculators/models/dflash/config.py``
(``DFlashSpeculatorConfig``), ``core.py`` (``DFlashDraftModel``: ``__init__``, ``load_verifier_weights``,
``_backbone_forward``), ``model_definitions.py`` (``Qwen3DFlashAttention``, ``Qwen3DFlashDecoderLayer``),
``attention.py`` (``create_anchor_block_mask_mod``), ``speculators/models/dspark/config.py``
(``DSparkSpeculatorConfig``), ``core.py`` (``DSparkDraftModel.forward``), ``model_definitions.py`` (``MarkovHead``,
``ConfidenceHead``), ``speculators/model.py`` (``DraftVocabMixin``) and ``speculators/convert/dflash/converter.py``
(how it reads a published DFlash checkpoint).

What speculators computes, for one anchor at position ``n`` (token ``x_n``) of a sequence with fused target states
``h [1, T, kD]`` (``hidden_states``, the target layers ``aux_hidden_state_layer_ids`` concatenated in that order)::

    g        = hidden_norm(fc(h))                                  # every position; the mask lets the block see t < n
    block    = embed_tokens([x_n, mask, .., mask])                 # block_size slots at positions n .. n + B - 1
    layer l: K, V = k_norm(k_proj([g; a])), v_proj([g; a])         # a = input_layernorm(block): context then block
             Q = q_norm(q_proj(a)); RoPE (Qwen3RotaryEmbedding of transformer_layer_config) at the positions
             block += o_proj(attention(Q, K, V)), mask: context t < n (same document) and the whole block
             block += mlp(post_attention_layernorm(block))
    logits   = lm_head(norm(block))                                # [1, B, S], no soft-capping
    DSpark:  logits += markov_w2(markov_w1[prev]);  conf = proj(concat(norm(block), markov_w1[prev]))

with ``prev`` the token before each slot's prediction (``sample_from_anchor``: slot k predicts ``x_{n+k+1}``, its
``prev`` is ``x_{n+k}``; without it slot k predicts ``x_{n+k}``). ``embed_tokens`` is a plain ``nn.Embedding`` and,
for a full vocabulary, ``lm_head`` the verifier's, both refilled from the verifier by ``load_verifier_weights``
(``overwrite_embed_tokens=True``); ``aux_hidden_state_layer_ids`` are layer *inputs* (the converter adds 1 to a
DFlash checkpoint's ``target_layer_ids``). That is selfspec's :class:`~selfspec.heads.dflash.BlockHead` exactly
(``dflash``: ``sample_from_anchor`` false; ``dspark``: true, a ``vanilla`` Markov head, the confidence head reading
the Markov code), for a full block of ``block_size`` slots: selfspec's drafter may run a shorter block when it
drafts fewer tokens, which speculators never does (attention inside the block is bidirectional, so slot outputs
depend on the block's length).

The layout: ``config.json`` with ``architectures`` ``[DFlashDraftModel]`` / ``[DSparkDraftModel]``,
``speculators_model_type``, ``transformer_layer_config`` (the head's Qwen3 layer config: ``num_hidden_layers`` the
head's layers, ``vocab_size`` the target's), ``draft_vocab_size``, ``block_size``, ``aux_hidden_state_layer_ids``,
``mask_token_id``, ``sample_from_anchor``, DSpark's ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_with_markov``, and ``speculators_config``; ``model.safetensors`` with selfspec's tensor names, which
are speculators' (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``; ``lm_head`` + ``d2t`` / ``t2d`` only with a
reduced vocabulary; ``markov_head.markov_w{1,2}``, ``confidence_head.proj``); no ``embed_tokens`` (speculators'
own ``save_pretrained`` writes none either).

Export refuses what speculators would compute differently: a target whose token embedding is not a plain
``nn.Embedding`` (Gemma's scaled embedding: speculators looks up the raw ``embed_tokens.weight`` rows), a target with
final-logit soft-capping (speculators' ``lm_head`` output is not capped); and repeated target layers, which
speculators' ``resolve_target_layer_ids`` refuses. Import refuses what selfspec's head does not compute:
sliding-window layers, attention bias, a non-Qwen3 layer, another Markov head type, a confidence head without the
Markov code, ``sample_from_anchor`` other than the family's, aux layers 0 (the embedding output) or the target's last
(vLLM's pre-norm final state, which ``transformers`` returns after the final norm).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import Qwen3Config

from selfspec.base.fingerprint import target_fingerprint
from selfspec.export.common import ExportError, rename_exact, write_export
from selfspec.heads.dflash import BlockConfig, BlockHead
from selfspec.heads.eagle3 import check_vocab_maps
from selfspec.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadFormatError,
    check_fingerprint,
    load_state,
    read_json,
    read_safetensors,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "SPECULATORS_BLOCK_ARCHITECTURES",
    "block_config",
    "block_tensor_names",
    "check_plain_block",
    "dspark_heads",
    "export_speculators_block",
    "read_speculators_block",
    "verifier_copy",
]

SPECULATORS_VERSION = "0.9.0"
SPECULATORS_BLOCK_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
"""The model classes speculators' ``save_pretrained`` names (``speculators_model_type`` picks the class on load)."""
FORMAT = "speculators"
# The layer config keys selfspec adds that speculators' Qwen3 layer config does not hold.
_LAYER_EXTRAS = ("block_size", "_attn_implementation_autoset", "torch_dtype", "head_type", "selfspec")


def block_tensor_names(head: BlockHead) -> dict[str, str]:
    """The head's tensor names, which are speculators' and SGLang's (identity), without the RoPE buffer."""
    return {k: k for k in head.state_dict() if not k.startswith("rotary.")}


def check_plain_block(head: BlockHead, engine: str, *, embed_code: str, cap_code: str) -> None:
    """Refuse a block head an engine would compute with another function: a target whose token embedding is not a
    plain ``nn.Embedding`` (Gemma's scaled embedding), a target with final-logit soft-capping, repeated target layers.

    Args:
        head: the head, its target attached.
        engine: the engine, named in the messages.
        embed_code: how the engine embeds the block (where its code shows it), for the scaled-embedding refusal.
        cap_code: how the engine computes draft logits (where its code shows it), for the soft-cap refusal.

    Raises:
        ExportError: naming the reason and the fix.
    """
    if not head.has_target:
        raise ExportError(
            f"the {engine} export checks the target's embedding: load the head with load_heads(DIR, target)"
        )
    embed = head.target_modules()[0]
    if type(embed) is not torch.nn.Embedding:
        raise ExportError(
            f"the target's token embedding is a {type(embed).__name__} (scaled), but {engine} embeds the block "
            f"with the raw rows ({embed_code}), so it would draft from unscaled rows; keep this head in selfspec"
        )
    if head.logit_softcap is not None:
        raise ExportError(
            f"the target soft-caps its logits (final_logit_softcapping {head.logit_softcap}), and so do the head's "
            f"draft logits, but {engine}'s are not capped ({cap_code}), so it would draft with another function; "
            "keep this head in selfspec"
        )
    layers = list(head.config.target_layers)
    if len(set(layers)) != len(layers):
        raise ExportError(
            f"target_layer_ids {list(head.config.target_layer_ids)} repeat a layer; {engine} captures each target "
            "layer once (speculators: resolve_target_layer_ids, speculators/models/utils.py, refuses repeats): train "
            "with distinct target_layer_ids (a target of at least 6 layers gives distinct defaults)"
        )


def _layer_config(head: BlockHead) -> dict[str, Any]:
    cfg = head.layer_config.to_dict()
    for key in _LAYER_EXTRAS:
        cfg.pop(key, None)
    cfg["dtype"] = str(head.fc.weight.dtype).removeprefix("torch.")
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    return cfg


def export_speculators_block(head: BlockHead, out_dir: str | Path, *, target_name_or_path: str) -> Path:
    """Write a DFlash / DSpark ``head`` in the speculators layout (module docstring), atomically.

    Args:
        head: a :class:`BlockHead` with its target attached, any float dtype (written as it is).
        out_dir: the directory to write (created, or replaced as a whole).
        target_name_or_path: the verifier, ``speculators_config.verifier.name_or_path``; speculators and vLLM read
            its embedding (and, for a full vocabulary, its lm_head) from it. A local directory's ``config.json``
            gives ``speculators_config.verifier.architectures`` (empty for a Hub id).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ExportError: no target attached, a scaled embedding or soft-capped logits of the target, repeated target
            layers (see the module docstring), a tensor the layout does not name.
    """
    check_plain_block(
        head,
        "speculators",
        embed_code="a plain nn.Embedding of the verifier's embed_tokens.weight, speculators/model.py DraftVocabMixin",
        cap_code="speculators/models/dflash/core.py _backbone_forward",
    )
    cfg = head.config
    verifier = Path(target_name_or_path) / CONFIG_NAME
    verifier_architectures = list(read_json(verifier).get("architectures") or []) if verifier.is_file() else []
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    tensors = rename_exact(state, block_tensor_names(head), FORMAT)
    anchor = cfg.head_type == "dspark"
    config: dict[str, Any] = {
        "architectures": [SPECULATORS_BLOCK_ARCHITECTURES[cfg.head_type]],
        "aux_hidden_state_layer_ids": list(cfg.target_layers),
        "block_size": cfg.block_size,
        "draft_vocab_size": cfg.n_draft,
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": anchor,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": cfg.head_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.max_drafts,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": verifier_architectures, "name_or_path": target_name_or_path},
        },
        "speculators_model_type": cfg.head_type,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "transformer_layer_config": _layer_config(head),
        "selfspec_target_fingerprint": cfg.target_fingerprint,
    }
    if anchor:
        config.update(
            {
                "markov_rank": cfg.markov_rank,
                "markov_head_type": "vanilla",
                "enable_confidence_head": cfg.confidence,
                "confidence_head_with_markov": True,
            }
        )
    return write_export(out_dir, config, tensors)


def _refuse(where: str, problems: list[str]) -> None:
    if problems:
        raise HeadFormatError(f"{where}: " + "; ".join(problems))


def _layer(raw: dict[str, Any], where: str) -> Qwen3Config:
    layer = dict(raw.get("transformer_layer_config") or {})
    problems = []
    if layer.get("model_type") != "qwen3":
        problems.append(f"the draft layer is {layer.get('model_type')!r}; selfspec's block heads hold Qwen3 layers")
    if layer.get("attention_bias"):
        problems.append("attention_bias is set; selfspec's block layers have no attention bias")
    if "sliding_attention" in (layer.get("layer_types") or []):
        problems.append("sliding-window layers; selfspec's block layers attend the whole context")
    _refuse(where, problems)
    for key in ("model_type", "architectures", "dtype", "torch_dtype", "transformers_version"):
        layer.pop(key, None)
    try:
        return Qwen3Config(**layer)
    except (TypeError, ValueError) as err:
        raise HeadFormatError(f"{where}: not a Qwen3 layer config ({err})") from err


def dspark_heads(raw: dict[str, Any], problems: list[str], no_markov: str, default_rank: int) -> tuple[int, bool]:
    """A DSpark checkpoint's ``(markov_rank, enable_confidence_head)``, appending to ``problems`` what selfspec's head
    does not compute: no Markov head (``no_markov`` says why), a Markov head type other than ``vanilla``, a
    confidence head without the Markov code. ``default_rank``: the layout's ``markov_rank`` when absent."""
    rank, confidence = int(raw.get("markov_rank", default_rank) or 0), bool(raw.get("enable_confidence_head", True))
    if rank < 1:
        problems.append(no_markov)
    if raw.get("markov_head_type", "vanilla") != "vanilla":
        problems.append(f"markov_head_type {raw.get('markov_head_type')!r}; selfspec computes 'vanilla' only")
    if confidence and not raw.get("confidence_head_with_markov", True):
        problems.append("confidence_head_with_markov is false; selfspec's confidence head reads the Markov code")
    return rank, confidence


def block_config(raw: dict[str, Any], layer: Qwen3Config, target: PreTrainedModel, where: str) -> BlockConfig:
    """The :class:`BlockConfig` of a speculators ``dflash`` / ``dspark`` config ``raw`` (layer config ``layer``) for
    ``target``; the SGLang reader translates its layouts into this one.

    Raises:
        HeadFormatError: a head for another target, aux layers outside ``[1, L - 1]``, no ``mask_token_id``, a
            ``sample_from_anchor`` other than the family's, DSpark settings selfspec does not compute
            (:func:`dspark_heads`), fields :class:`BlockConfig` refuses.
    """
    kind = raw["speculators_model_type"]
    L, c = target.config.num_hidden_layers, target.config
    aux = raw.get("aux_hidden_state_layer_ids")
    problems = []
    if (layer.hidden_size, layer.vocab_size) != (c.hidden_size, c.vocab_size):
        problems.append(
            f"the head has hidden {layer.hidden_size} / vocab {layer.vocab_size}, the target {c.hidden_size} / "
            f"{c.vocab_size}: it belongs to another target; pass the target it was trained on"
        )
    if raw.get("target_hidden_size") not in (None, layer.hidden_size):
        problems.append("target_hidden_size differs from the layer's; selfspec's block heads fuse states of their size")
    if not aux or not all(isinstance(i, int) and 1 <= i <= L - 1 for i in aux):
        problems.append(
            f"aux_hidden_state_layer_ids {aux} must be target layer inputs in [1, {L - 1}]: selfspec fuses layer "
            "outputs 0 .. L - 2 (transformers returns the last layer's state after the final norm)"
        )
    if raw.get("mask_token_id") is None:
        problems.append("mask_token_id is not set")
    if raw.get("sample_from_anchor", kind == "dspark") is not (kind == "dspark"):
        problems.append(
            f"sample_from_anchor is {raw.get('sample_from_anchor')}; selfspec's {kind} head predicts "
            + ("from the anchor slot (true)" if kind == "dspark" else "in place from slot 1 (false)")
        )
    rank, confidence = 0, False
    if kind == "dspark":
        rank, confidence = dspark_heads(
            raw, problems, "markov_rank is 0; a selfspec dspark head has a Markov head (import it as dflash)", 256
        )
    _refuse(where, problems)
    try:
        return BlockConfig(
            head_type=kind,
            hidden_size=layer.hidden_size,
            vocab_size=layer.vocab_size,
            num_target_layers=L,
            block_size=int(raw.get("block_size", 8)),
            num_layers=layer.num_hidden_layers,
            mask_token_id=int(raw["mask_token_id"]),
            target_layer_ids=tuple(i - 1 for i in aux),
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            markov_rank=rank,
            confidence=confidence,
            target=str(((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""),
            target_fingerprint=target_fingerprint(target),
        )
    except (TypeError, ValueError) as err:
        raise HeadFormatError(f"{where}: {err}") from err


def verifier_copy(state: dict[str, torch.Tensor], name: str, own: torch.Tensor, where: str) -> None:
    """Consume ``state[name]`` (optional): the engines take it from the target (speculators refills it from the
    verifier, SGLang skips it), so it must be the target's.

    Raises:
        HeadFormatError: ``state[name]`` is there and is not ``own``.
    """
    got = state.pop(name, None)
    if got is not None and (got.shape != own.shape or not torch.equal(got.to(own.dtype), own)):
        raise HeadFormatError(
            f"{where}: {name} is not the target's (the engines and selfspec use the target's); pass the target the "
            "head was trained on"
        )


def read_speculators_block(d: Path, raw: dict[str, Any], target: PreTrainedModel) -> BlockHead:
    """Read a speculators ``dflash`` / ``dspark`` checkpoint into a :class:`BlockHead` attached to ``target``.

    Args:
        d: the directory (``config.json`` + ``model.safetensors``).
        raw: its parsed ``config.json`` (``speculators_model_type`` ``dflash`` or ``dspark``).
        target: the frozen target; sizes, layers and a recorded ``selfspec_target_fingerprint`` are checked.

    Returns:
        The head, fp32 or as stored, with the target attached.

    Raises:
        HeadFormatError: a config selfspec's head does not compute (module docstring), a head for another target,
            missing / unexpected / mis-shaped tensors, invalid ``d2t`` / ``t2d``, an ``embed_tokens.weight`` or
            full-vocabulary ``lm_head.weight`` that is not the target's.
    """
    where = str(d / CONFIG_NAME)
    recorded = raw.get("selfspec_target_fingerprint") or ""  # published checkpoints record none
    check_fingerprint(d, recorded, target_fingerprint(target), unrecorded_warning=False)
    layer = _layer(raw, where)
    config = block_config(raw, layer, target, where)
    path = d / WEIGHTS_NAME
    state = read_safetensors(path)
    verifier_copy(state, "embed_tokens.weight", target.get_input_embeddings().weight.detach(), str(path))
    if config.n_draft == config.vocab_size:
        verifier_copy(state, "lm_head.weight", target.get_output_embeddings().weight.detach(), str(path))
    draft_ids = None
    if "d2t" in state and "t2d" in state:
        check_vocab_maps(state["d2t"], state["t2d"], config.n_draft, config.vocab_size, str(path))
        draft_ids = torch.arange(config.n_draft) + state["d2t"]  # d2t applied here, once
    head = BlockHead(config, layer, draft_ids)
    fix = f"pass the directory speculators saved ({path}), or the right --format"
    state = rename_exact(state, {v: k for k, v in block_tensor_names(head).items()}, FORMAT, fix=fix)
    load_state(head, path, state)
    head.attach_target(target)
    return head
