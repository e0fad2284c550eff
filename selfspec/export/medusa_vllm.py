"""Medusa heads in vLLM's ``MedusaModel`` layout, both ways (the layout ``--format sglang`` writes for Medusa heads).

The contract, read from vLLM's code (``vllm/model_executor/models/medusa.py``: ``ResidualBlock``, ``Medusa``,
``Medusa.load_weights``; ``vllm/transformers_utils/configs/medusa.py``: ``MedusaConfig``):

* ``config.json``: ``architectures: ["MedusaModel"]``, ``model_type: "medusa"``, ``hidden_size`` D, ``vocab_size`` V,
  ``num_heads`` K, ``num_hidden_layers`` L (residual blocks per head), ``truncated_vocab_size`` S, ``medusa_fc_bias:
  true`` (vLLM's blocks have no bias unless it is set; selfspec's ``x + SiLU(W x + b)`` has one), ``original_lm_head``
  (one lm_head shared by every head), ``max_paths`` / ``topk`` (vLLM's defaults). ``MedusaConfig.from_pretrained``
  renames every key holding ``num`` and ``heads`` to ``num_heads`` and ``num`` and ``layers`` to
  ``num_hidden_layers``, so no other key of the config holds those words.
* ``model.safetensors``: ``blocks.{k}.layers.{l}.weight [D, D]`` and ``.bias [D]``; ``lm_heads.{k}.weight [S, D]``
  per head, or with ``original_lm_head`` one ``lm_head.weight [S, D]`` (selfspec heads sharing the target's frozen
  lm_head: its rows ``draft_ids``); and with a reduced draft vocabulary (S < V) ``token_map`` int64 ``[S]``, the
  target id of each lm_head row (vLLM scatters the S logits to ``logits[..., token_map]`` over V, ``-inf``
  elsewhere; without it vLLM asserts ``truncated_vocab_size == vocab_size``). A full vocabulary writes no
  ``token_map``. vLLM's loader skips a name it does not know (and strips ``medusa_heads.``), so every name written is
  one it reads, and a head tensor without such a name, or under a trainer prefix, is an error.

vLLM feeds the heads the target's last hidden state after the final norm, as selfspec does; head k predicts token
t+2+k. selfspec's ``head_topk_accuracy`` (its static tree) travels as ``selfspec_head_topk_accuracy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.fingerprint import target_fingerprint
from selfspec.export.common import ExportError, Head, check_trainer_prefix, family_name, rename_exact, write_export
from selfspec.heads.config import config_from_dict
from selfspec.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadFormatError,
    check_draft_ids,
    check_fingerprint,
    load_state,
    read_safetensors,
)
from selfspec.heads.medusa import MedusaConfig, MedusaHeads

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MEDUSA_ARCHITECTURE", "export_vllm_medusa", "medusa_names", "read_vllm_medusa", "vllm_config_keys"]

MEDUSA_ARCHITECTURE = "MedusaModel"
FORMAT = "sglang (vLLM MedusaModel)"


def medusa_names(num_heads: int, num_layers: int, own_lm_head: bool) -> dict[str, str]:
    """selfspec :class:`~selfspec.heads.medusa.MedusaHeads` tensor names -> vLLM ``MedusaModel`` names (the same
    names: selfspec's follow vLLM's), ``draft_ids`` -> ``token_map``; the shared lm_head (``lm_head.weight``) is not
    a head tensor and is added by the exporter."""
    names = {"draft_ids": "token_map"}
    for k in range(num_heads):
        for layer in range(num_layers):
            for p in ("weight", "bias"):
                names[f"blocks.{k}.layers.{layer}.{p}"] = f"blocks.{k}.layers.{layer}.{p}"
        if own_lm_head:
            names[f"lm_heads.{k}.weight"] = f"lm_heads.{k}.weight"
    return names


def vllm_config_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """The config as vLLM's ``MedusaConfig.from_pretrained`` reads it: a key holding ``num`` and ``heads`` becomes
    ``num_heads``, one holding ``num`` and ``layers`` becomes ``num_hidden_layers`` (e.g. ``medusa_num_heads``)."""
    cfg = dict(raw)
    for k in list(cfg):
        if "num" in k and "heads" in k:
            cfg["num_heads"] = cfg.pop(k)
        elif "num" in k and "layers" in k:
            cfg["num_hidden_layers"] = cfg.pop(k)
    return cfg


def export_vllm_medusa(head: Head, out_dir: str | Path, *, target_name_or_path: str) -> Path:
    """Write Medusa heads in vLLM's ``MedusaModel`` layout (see the module docstring), atomically.

    Serve with ``vllm serve TARGET --speculative-config '{"method": "medusa", "model": OUT_DIR,
    "num_speculative_tokens": K}'``.

    Args:
        head: :class:`MedusaHeads`, own lm_heads or the target's shared one (then attached: ``load_heads(DIR,
            target)``), any float dtype (written as it is).
        out_dir: the directory to write (created, or a previous export replaced as a whole).
        target_name_or_path: the target the heads draft for, written as ``target_model``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ExportError: not Medusa heads, a tensor the layout does not name or a trainer prefix, shared-lm_head heads
            without their target, a full-size draft vocabulary that is not the target's order. Nothing is written.
    """
    family = family_name(head)
    if not isinstance(head, MedusaHeads):
        raise ExportError(f"vLLM's MedusaModel layout holds Medusa heads, not {family}")
    cfg: MedusaConfig = head.config
    K, L, D, V, S = cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.n_draft
    names = medusa_names(K, L, cfg.own_lm_head)
    tensors = rename_exact(head.state_dict(), names, FORMAT, fix="keep these heads in selfspec's own format")
    if S == V:
        if not torch.equal(head.draft_ids.cpu(), torch.arange(V)):
            raise ExportError(
                "these heads order a full-size draft vocabulary differently from the target; vLLM's MedusaModel "
                "reads rows in the target's order without a token_map: retrain with draft_vocab_size=None"
            )
        del tensors["token_map"]
    if not cfg.own_lm_head:
        shared = getattr(head, "_shared", None)  # set by attach_target: the target's lm_head rows draft_ids [S, D]
        if shared is None:
            raise ExportError(
                "these heads share the target's lm_head, which the export writes: load them with "
                "load_heads(DIR, target)"
            )
        tensors["lm_head.weight"] = shared.detach().to(head.blocks[0].layers[0].weight.dtype)
    dtype = str(head.blocks[0].layers[0].weight.dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architectures": [MEDUSA_ARCHITECTURE],
        "model_type": "medusa",
        "hidden_size": D,
        "vocab_size": V,
        "num_heads": K,
        "num_hidden_layers": L,
        "truncated_vocab_size": S,
        "medusa_fc_bias": True,
        "original_lm_head": not cfg.own_lm_head,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": dtype,
        "target_model": target_name_or_path,
        "selfspec_target_fingerprint": cfg.target_fingerprint,
    }
    if cfg.head_topk_accuracy is not None:
        config["selfspec_head_topk_accuracy"] = cfg.head_topk_accuracy
    return write_export(out_dir, config, tensors)


def _lm_rows(w: torch.Tensor, draft_ids: torch.Tensor, V: int, D: int, where: str, name: str) -> torch.Tensor:
    """An lm_head of the file as ``[S, D]``: as it is, or a full ``[V, D]`` one cut to the token map's rows, as
    vLLM's ``load_weights`` cuts it."""
    S = draft_ids.numel()
    if tuple(w.shape) == (S, D):
        return w
    if tuple(w.shape) == (V, D):
        return w[draft_ids]
    raise HeadFormatError(
        f"{where}: {name} has shape {tuple(w.shape)}, expected [{S}, {D}] (truncated_vocab_size) or [{V}, {D}]"
    )


def read_vllm_medusa(d: Path, raw: dict[str, Any], target: PreTrainedModel) -> MedusaHeads:
    """Read a vLLM ``MedusaModel`` directory into :class:`MedusaHeads` attached to ``target``, strictly: every
    tensor consumed, shapes checked against the config and the target, ``token_map`` applied once (it becomes
    ``draft_ids``). Blocks without bias (``medusa_fc_bias`` false, vLLM's default) load with zero bias, which is the
    same function. A shared ``lm_head`` equal to the target's rows becomes ``own_lm_head=False``, any other one a
    copy per head.

    Raises:
        HeadFormatError: another target (sizes or recorded fingerprint), missing / unexpected / mis-shaped tensors
            (a trainer prefix named), an invalid ``token_map``, a truncated or corrupt file.
    """
    where, wfile = str(d / CONFIG_NAME), str(d / WEIGHTS_NAME)
    cfg = vllm_config_keys(raw)
    try:
        D, V, K = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg.get("num_heads", 5))
        L, S = int(cfg.get("num_hidden_layers", 1)), int(cfg.get("truncated_vocab_size") or cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise HeadFormatError(f"{where}: not a MedusaModel config ({err!r} missing or not a number)") from err
    if not 1 <= S <= V:
        raise HeadFormatError(f"{where}: truncated_vocab_size {S} must lie in [1, vocab_size={V}]")
    lm = target.get_output_embeddings().weight.detach()
    if (D, V) != (lm.shape[1], lm.shape[0]):
        raise HeadFormatError(
            f"{where}: the heads have hidden {D} / vocab {V}, the target {lm.shape[1]} / {lm.shape[0]}: they belong "
            "to another target; pass the target they were trained on"
        )
    recorded = raw.get("selfspec_target_fingerprint") or ""  # vLLM's own MedusaModel checkpoints record none
    check_fingerprint(where, recorded, target_fingerprint(target), unrecorded_warning=False)
    state = read_safetensors(d / WEIGHTS_NAME)
    shared = bool(cfg.get("original_lm_head", False))
    bias = bool(cfg.get("medusa_fc_bias", False))
    expected = set(medusa_names(K, L, not shared).values()) | ({"lm_head.weight"} if shared else set())
    if not bias:
        expected -= {n for n in expected if n.endswith(".bias")}
    if S == V:
        expected.discard("token_map")
    check_trainer_prefix(state, dict.fromkeys(expected), "vLLM MedusaModel")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise HeadFormatError(
            f"{wfile} does not match its config (num_heads {K}, num_hidden_layers {L}, truncated_vocab_size {S}, "
            f"original_lm_head {shared}, medusa_fc_bias {bias}): missing={missing} unexpected={unexpected}; pass the "
            "directory the trainer exported for serving"
        )
    if S < V:
        draft_ids = state.pop("token_map")
        if draft_ids.dtype in (torch.int32, torch.int16):
            draft_ids = draft_ids.to(torch.long)
        check_draft_ids(draft_ids, S, V, wfile)
    else:
        draft_ids = torch.arange(V)
    if not bias:
        for k in range(K):
            for layer in range(L):
                state[f"blocks.{k}.layers.{layer}.bias"] = torch.zeros(D)
    own = True
    if shared:
        w = _lm_rows(state.pop("lm_head.weight"), draft_ids, V, D, wfile, "lm_head.weight")
        own = not torch.equal(w.to(lm.dtype), lm[draft_ids])
        if own:
            for k in range(K):
                state[f"lm_heads.{k}.weight"] = w.clone()
    else:
        for k in range(K):
            name = f"lm_heads.{k}.weight"
            state[name] = _lm_rows(state[name], draft_ids, V, D, wfile, name)
    values = {
        "hidden_size": D,
        "vocab_size": V,
        "num_heads": K,
        "num_layers": L,
        "own_lm_head": own,
        "draft_vocab_size": S if S < V else None,
        "target": str(raw.get("target_model") or ""),
        "target_fingerprint": target_fingerprint(target),
        "head_topk_accuracy": raw.get("selfspec_head_topk_accuracy"),
    }
    try:
        config = config_from_dict(MedusaConfig, values, where=where)
    except ValueError as err:  # e.g. num_heads < 1
        raise HeadFormatError(f"{where}: {err}") from err
    heads = MedusaHeads(config, draft_ids=draft_ids)
    state["draft_ids"] = draft_ids
    load_state(heads, d / WEIGHTS_NAME, state)
    heads.attach_target(lm)
    return heads
