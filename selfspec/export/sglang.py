"""Export to the SGLang / SpecForge draft layouts: ``LlamaForCausalLMEagle3`` (EAGLE-3) and ``LlamaForCausalLMEagle``
(EAGLE-1); DFlash and DSpark heads: :mod:`selfspec.export.sglang_block`.

The contract, read from the engines' code:

* EAGLE-3 (sglang ``python/sglang/srt/models/llama_eagle3.py``; SpecForge ``specforge/export/to_sglang.py`` and
  ``configs/*-eagle3.json``): ``config.json`` is a one-layer ``LlamaConfig`` with ``architectures:
  ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size`` S and ``tie_word_embeddings: false`` (with ``true`` SGLang
  makes the lm_head the embedding and the draft's own lm_head is lost). Tensors: ``fc.weight [D, 3D]``,
  ``midlayer.input_layernorm.weight`` (the token-embedding norm), ``midlayer.hidden_norm.weight``,
  ``midlayer.self_attn.{q,k,v}_proj.weight [., 2D]``, ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.post_attention_layernorm.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
  ``lm_head.weight [S, D]``, ``d2t`` int64 ``[S]`` (SGLang's ``hot_token_id = d2t + arange(S)``) and ``t2d`` bool
  ``[V]``; no ``embed_tokens`` (the target's is used). SGLang's loader skips a name it does not know, so every
  name written here is one the loader reads, and a head tensor without such a name is an error.
* The fused target layers: SGLang captures, for each id in ``eagle_config.eagle_aux_hidden_state_layer_ids``, the
  OUTPUT of that layer (``layers_to_capture = [id + 1 ...]``, the input of the next, in
  ``set_eagle3_layers_to_capture`` of ``python/sglang/srt/models/llama.py``); without ``eagle_config`` it takes the
  inputs of layers ``[2, L // 2, L - 3]``. selfspec's ``target_layers`` are layer inputs (``hidden_states[i]``), so
  the ids written are ``i - 1``; ``eagle_config`` is left out when the layers are SGLang's default.
* EAGLE-1 (sglang ``python/sglang/srt/models/llama_eagle.py``): a one-layer ``LlamaConfig`` with ``architectures:
  ["LlamaForCausalLMEagle"]`` and ``tie_word_embeddings: false`` (with ``true`` its lm_head is its embedding module,
  and ``set_embed_and_head`` of ``python/sglang/srt/models/llama.py`` deletes that module's weight twice); tensors
  ``fc.weight [D, 2D]``, ``fc.bias [D]`` (SGLang's ``fc`` always has a bias) and ``layers.0.*`` without
  ``input_layernorm`` (the first layer's norm is the identity); the lm_head and embeddings are the target's. The
  layer's output ``hidden + residual`` goes to the target's lm_head, as in :class:`selfspec.heads.eagle.EagleHead`.
* EAGLE-1 with a reduced draft vocabulary (FR-Spec): SGLang takes the draft ids from the file given to
  ``--speculative-token-map`` (``load_token_map`` in ``python/sglang/srt/speculative/spec_utils.py``:
  ``torch.load(path, weights_only=True)``, then ``torch.tensor(..., dtype=int64)``; a path that is not a local file
  is read as ``REPO_ID/FILE`` on the Hub) and drafts with the target's lm_head rows ``head[hot_token_id]``
  (``EAGLEWorker.__init__`` in ``eagle_worker.py``), exactly selfspec's ``lm_head[draft_ids]``. The export writes
  that file, a list of S target ids, as :data:`~selfspec.export.common.TOKEN_MAP_NAME` beside ``config.json``
  (``selfspec_speculative_token_map`` in the config names it); SGLang needs the flag to use it.
* EAGLE-3.1 heads (``fc_norm`` / ``norm_output``, arXiv:2605.09992) are refused (:func:`check_sglang_eagle31`): the
  ``llama_eagle3.py`` above computes neither (see there).
* Medusa heads (SGLang has no Medusa drafter) are written in vLLM's ``MedusaModel`` layout
  (:mod:`selfspec.export.medusa_vllm`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from selfspec.export.common import (
    TOKEN_MAP_NAME,
    ExportError,
    family_name,
    llama_config_dict,
    refuse_eagle31,
    rename_exact,
    require_llama,
    write_export,
)
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle3 import Eagle3Head

__all__ = [
    "EAGLE3_ARCHITECTURE",
    "EAGLE_ARCHITECTURE",
    "check_sglang_eagle31",
    "eagle3_names",
    "eagle_names",
    "export_sglang_eagle",
    "export_sglang_eagle3",
    "layer_tensors",
    "sglang_aux_layer_ids",
    "token_map_bytes",
]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
FORMAT = "sglang"

_LAYER = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def eagle3_names(layer_prefix: str = "midlayer.") -> dict[str, str]:
    """selfspec :class:`~selfspec.heads.eagle3.Eagle3Head` module names -> the EAGLE-3 file names, with the
    decoder layer under ``layer_prefix`` (``midlayer.`` for SGLang, ``layers.0.`` for speculators)."""
    names = {
        "fc.weight": "fc.weight",
        "layers.0.input_layernorm.embed_norm.weight": f"{layer_prefix}input_layernorm.weight",
        "layers.0.input_layernorm.hidden_norm.weight": f"{layer_prefix}hidden_norm.weight",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "d2t": "d2t",
        "t2d": "t2d",
    }
    names.update({f"layers.0.{k}": f"{layer_prefix}{k}" for k in _LAYER})
    return names


def eagle_names(layer_prefix: str = "layers.0.") -> dict[str, str]:
    """selfspec :class:`~selfspec.heads.eagle.EagleHead` module names -> the EAGLE-1 file names (no input norm)."""
    names = {"fc.weight": "fc.weight", "fc.bias": "fc.bias"}
    names.update({f"layers.0.{k}": f"{layer_prefix}{k}" for k in _LAYER})
    return names


def layer_tensors(head: EagleHead | Eagle3Head, names: dict[str, str], fmt: str) -> dict[str, torch.Tensor]:
    """The tensors of an EAGLE-1 / EAGLE-3 head under a layout's names (:func:`eagle_names`,
    :func:`eagle3_names`), for the Llama-layer layouts of SGLang and speculators.

    Raises:
        ExportError: the head's decoder layer is not Llama's, a trainer prefix, or a tensor the layout does not name.
    """
    require_llama(head, fmt)
    return rename_exact(head.state_dict(), names, fmt)


def sglang_aux_layer_ids(target_layers: tuple[int, ...], num_layers: int) -> list[int] | None:
    """SGLang's ``eagle_aux_hidden_state_layer_ids`` for selfspec ``target_layers`` (layer inputs): ``i - 1`` each
    (SGLang captures layer outputs), or None when the set is SGLang's default ``{2, L // 2, L - 3}`` of inputs.

    Raises:
        ExportError: a layer input 0 (the embeddings), which SGLang cannot capture by id, outside the default.
    """
    default = {2, num_layers // 2, num_layers - 3}
    if len(set(target_layers)) == 3 and set(target_layers) == default:
        return None
    if min(target_layers) < 1:
        raise ExportError(
            f"target_layers {list(target_layers)} fuse the embeddings (layer input 0), which SGLang's "
            "eagle_aux_hidden_state_layer_ids cannot name; train the head with target_layers >= 1"
        )
    return [i - 1 for i in target_layers]


def check_sglang_eagle31(head: Eagle3Head) -> None:
    """Refuse an EAGLE-3.1 head: SGLang would load it and draft with another function, silently.

    Read in sglang ``python/sglang/srt/models/llama_eagle3.py`` (``LlamaModel.forward``,
    ``LlamaForCausalLMEagle3.load_weights``): ``fc`` is applied to the raw fused target states (no per-layer norm:
    ``fc_norm``), the state handed to the next draft step is the pre-norm ``hidden_states_to_aux`` (not ``norm(o)``:
    ``norm_output``), neither flag is read from the config, and the loader skips names it does not know, so
    ``fc_norm.*`` would be dropped without a word. (SpecForge PR #879 points at a later SGLang whose
    ``llama_eagle3.py`` has a ``norm_output`` config field, default false; the refusal stays until an SGLang that
    computes both flags is read and its draft logits checked.)

    Raises:
        ExportError: naming the flags and the formats that take the head.
    """
    refuse_eagle31(
        head,
        "SGLang",
        "SGLang's LlamaForCausalLMEagle3 (llama_eagle3.py) applies fc to the raw fused states, feeds the pre-norm "
        "state to the next draft step and skips tensors it does not know",
    )


def _eagle3(head: Eagle3Head, target_name_or_path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    check_sglang_eagle31(head)
    tensors = layer_tensors(head, eagle3_names("midlayer."), FORMAT)
    cfg = llama_config_dict(head)
    cfg.update(
        {
            "architectures": [EAGLE3_ARCHITECTURE],
            "tie_word_embeddings": False,
            "draft_vocab_size": head.config.draft_vocab_size,
            "vocab_size": head.config.vocab_size,
            "target_model": target_name_or_path,
            "selfspec_target_fingerprint": head.config.target_fingerprint,
            "selfspec_target_layers": list(head.config.target_layers),
        }
    )
    aux = sglang_aux_layer_ids(head.config.target_layers, head.config.num_target_layers)
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    return cfg, tensors


def token_map_bytes(draft_ids: torch.Tensor) -> bytes:
    """SGLang's ``--speculative-token-map`` file for ``draft_ids`` (LongTensor ``[S]``): ``torch.save`` of the list
    of S target ids, which ``torch.load(..., weights_only=True)`` reads back."""
    buf = io.BytesIO()
    torch.save([int(i) for i in draft_ids.tolist()], buf)
    return buf.getvalue()


def _eagle(head: EagleHead, target_name_or_path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict]:
    tensors = layer_tensors(head, eagle_names("layers.0."), FORMAT)
    if not head.config.fc_bias:
        raise ExportError(
            "SGLang's LlamaForCausalLMEagle has fc.bias; this EAGLE-1 head was trained without one. "
            "Train it with fc_bias=True to export to sglang."
        )
    cfg = llama_config_dict(head)
    cfg.update(
        {
            "architectures": [EAGLE_ARCHITECTURE],
            "tie_word_embeddings": False,
            "target_model": target_name_or_path,
            "selfspec_target_fingerprint": head.config.target_fingerprint,
        }
    )
    extra = {}
    if head.config.n_draft < head.config.vocab_size:
        extra[TOKEN_MAP_NAME] = token_map_bytes(head.draft_ids)
        cfg["selfspec_speculative_token_map"] = TOKEN_MAP_NAME
    elif not torch.equal(head.draft_ids.cpu(), torch.arange(head.config.vocab_size)):
        raise ExportError(
            "this EAGLE-1 head orders a full-size draft vocabulary differently from the target; "
            "LlamaForCausalLMEagle drafts over the target's lm_head in its own order: "
            "retrain with draft_vocab_size=None"
        )
    return cfg, tensors, extra


def export_sglang_eagle3(head: Eagle3Head, out_dir: str | Path, *, target_name_or_path: str) -> Path:
    """Write an EAGLE-3 head as SGLang / SpecForge's ``LlamaForCausalLMEagle3`` draft directory (``config.json`` +
    ``model.safetensors``; the module docstring has the names and shapes), atomically: the ``sglang`` exporter of the
    EAGLE-3 family (:mod:`selfspec.family_records`; ``selfspec export`` reaches it through the family's record).

    This is also the Hugging Face layout that llama.cpp's ``convert_hf_to_gguf.py`` reads for an EAGLE-3 draft, and the
    one optimum-intel's OpenVINO exporter converts.

    Args:
        head: an :class:`Eagle3Head`, fp32 or any float dtype (written as it is).
        out_dir: the directory to write (created, or a previous export replaced as a whole).
        target_name_or_path: the target model the head drafts for (its Hub id or directory), written as
            ``target_model`` in the config for the user and for converters that ask for it.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ExportError: not an EAGLE-3 head, a decoder layer that is not Llama's, a tensor the layout does not name or a
            trainer prefix, an EAGLE-3.1 head (:func:`check_sglang_eagle31`), target layers SGLang cannot name, an
            ``out_dir`` holding other files. Nothing is written then.
    """
    if not isinstance(head, Eagle3Head):
        raise ExportError(f"LlamaForCausalLMEagle3 holds EAGLE-3 heads, not {family_name(head)}")
    cfg, tensors = _eagle3(head, target_name_or_path)
    return write_export(out_dir, cfg, tensors, {})


def export_sglang_eagle(head: EagleHead, out_dir: str | Path, *, target_name_or_path: str) -> Path:
    """Write an EAGLE-1 head as SGLang's ``LlamaForCausalLMEagle`` draft directory, atomically, with
    :data:`~selfspec.export.common.TOKEN_MAP_NAME` for a reduced draft vocabulary (``--speculative-token-map
    OUT_DIR/speculative_token_map.pt``): the ``sglang`` exporter of the EAGLE-1 family.

    Args and returns: as :func:`export_sglang_eagle3`, for an :class:`EagleHead`.

    Raises:
        ExportError: not an EAGLE-1 head, no ``fc.bias``, a decoder layer that is not Llama's, a full-size draft
            vocabulary in another order than the target's, an ``out_dir`` holding other files. Nothing is written.
    """
    if not isinstance(head, EagleHead):
        raise ExportError(f"LlamaForCausalLMEagle holds EAGLE-1 heads, not {family_name(head)}")
    cfg, tensors, extra = _eagle(head, target_name_or_path)
    return write_export(out_dir, cfg, tensors, extra)
