"""selfspec/export/sglang_block.py: DFlash and DSpark heads in the layouts SGLang loads (``DFlashDraftModel``,
``Qwen3DSparkModel``), and the published z-lab DFlash / DeepSpec DSpark checkpoints read back.

SGLang runs on GPUs only, so its loader is not run here: the layout is checked against the names and keys its
``DFlashDraftModel.load_weights`` and ``parse_dflash_draft_config`` read (module docstring), export -> import gives
identical draft logits, and a checkpoint written as the published ones are (extra keys, the target's embedding and
lm_head inside) imports to the same head.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.base.fingerprint import target_fingerprint
from selfspec.export.cli import export_heads
from selfspec.export.common import ExportError
from selfspec.export.importer import read_foreign_head
from selfspec.heads.io import HeadFormatError
from tests.helpers.archs import tiny_target
from tests.helpers.heads import assert_same_block_outputs, block_head

LAYERS = (0, 1)  # distinct target layers of the 3-layer tiny target
# every tensor name SGLang's DFlashDraftModel.load_weights reads for a 2-layer head (it skips any other name).
SGLANG_LAYER = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
SGLANG_DFLASH = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{n}.weight" for i in range(2) for n in SGLANG_LAYER
}
SGLANG_DSPARK = SGLANG_DFLASH | {
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",
    "confidence_head.proj.bias",
}


def make(target, head_type: str, draft: int | None = None):
    return block_head(target, head_type, 4, draft=draft, target_layer_ids=LAYERS)


def test_dflash_layout_is_what_sglang_reads(target, tmp_path):
    out = export_heads(make(target, "dflash"), "sglang", tmp_path / "sg", target_name_or_path="tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"block_size": 4, "mask_token_id": 95, "target_layer_ids": [0, 1]}  # outputs
    assert (cfg["block_size"], cfg["num_hidden_layers"], cfg["hidden_size"]) == (4, 2, 32)
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["hidden_act"] == "silu"
    assert not cfg.get("attention_bias") and "speculators_model_type" not in cfg
    state = load_file(out / "model.safetensors")
    assert set(state) == SGLANG_DFLASH
    assert state["fc.weight"].shape == (32, 64)  # [D, k D], SGLang's only shape check


def test_dspark_layout_is_what_sglang_reads(target, tmp_path):
    out = export_heads(make(target, "dspark"), "sglang", tmp_path / "sg", target_name_or_path="tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and "speculators_model_type" not in cfg
    assert (cfg["block_size"], cfg["mask_token_id"], cfg["target_layer_ids"]) == (4, 95, [0, 1])  # top level
    assert (cfg["markov_rank"], cfg["markov_head_type"]) == (8, "vanilla")
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    state = load_file(out / "model.safetensors")
    assert set(state) == SGLANG_DSPARK
    assert state["markov_head.markov_w1.weight"].shape == (96, 8)  # [V, R]
    assert state["markov_head.markov_w2.weight"].shape == (96, 8)  # Linear R -> V
    assert state["confidence_head.proj.weight"].shape == (1, 40)  # [z; markov code]: D + R


@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_round_trip_gives_identical_logits(target, tmp_path, head_type):
    head = make(target, head_type)
    out = export_heads(head, "sglang", tmp_path / "sg", target_name_or_path="tiny")
    back = read_foreign_head(out, "sglang", target).eval()
    assert dataclasses.replace(back.config, target="", target_fingerprint="") == head.config
    assert back.config.target == "tiny"
    assert_same_block_outputs(head, back)


def published(out, edit_config=None, extra_tensors=None):
    """Rewrite an export as the published checkpoints are written: the reference loader's extra config keys, no
    selfspec keys, optionally more tensors and other config edits."""
    cfg = json.loads((out / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("selfspec_") and k != "target_model"}
    cfg.update({"auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "torch_dtype": "bfloat16", "num_anchors": 512})
    if edit_config:
        edit_config(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    if extra_tensors:
        state = load_file(out / "model.safetensors")
        save_file({**state, **extra_tensors}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_published_checkpoints_import(target, tmp_path, head_type):
    """A z-lab DFlash / DeepSpec DSpark checkpoint: extra keys, no fingerprint; DeepSpec's carries the target's
    embedding and lm_head, which must be the target's."""
    head = make(target, head_type)
    own = {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "lm_head.weight": target.get_output_embeddings().weight.detach().clone(),
    }
    out = published(export_heads(head, "sglang", tmp_path / "sg", target_name_or_path="t"), extra_tensors=own)
    back = read_foreign_head(out, "sglang", target).eval()
    assert back.config.target == "" and back.config.markov_rank == head.config.markov_rank
    assert_same_block_outputs(head, back)
    other = dict(own, **{"lm_head.weight": torch.zeros_like(own["lm_head.weight"])})
    out = published(export_heads(head, "sglang", tmp_path / "sg2", target_name_or_path="t"), extra_tensors=other)
    with pytest.raises(HeadFormatError, match="lm_head.weight is not the target's"):
        read_foreign_head(out, "sglang", target)


def test_export_refuses_what_sglang_would_compute_otherwise(target, tmp_path):
    with pytest.raises(ExportError, match="reduced vocabulary of 40 tokens"):
        export_heads(make(target, "dflash", draft=40), "sglang", tmp_path / "v", target_name_or_path="t")
    with pytest.raises(ExportError, match="scaled"):
        export_heads(make(tiny_target("gemma2"), "dspark"), "sglang", tmp_path / "g", target_name_or_path="t")
    head = make(target, "dflash")
    head.logit_softcap = 30.0
    with pytest.raises(ExportError, match="not capped"):
        export_heads(head, "sglang", tmp_path / "s", target_name_or_path="t")
    with pytest.raises(ExportError, match="repeat a layer"):
        repeated = block_head(target, "dflash", 4, target_layer_ids=(1, 1))
        export_heads(repeated, "sglang", tmp_path / "r", target_name_or_path="t")
    assert not any((tmp_path / d).exists() for d in ("v", "g", "s", "r"))


@pytest.mark.parametrize(
    ("head_type", "edit", "match"),
    [
        ("dflash", lambda c: c["dflash_config"].update(target_layer_ids=[0, 2]), r"in \[0, 1\]"),
        ("dflash", lambda c: c["dflash_config"].update(mask_token_id=None), "mask_token_id"),
        ("dflash", lambda c: c.update(attention_bias=True), "attention_bias"),
        ("dflash", lambda c: c.update(model_type="llama"), "Qwen3"),
        ("dflash", lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "sliding-window"),
        ("dflash", lambda c: c.update(final_logit_softcapping=30.0), "variant"),
        ("dflash", lambda c: c["dflash_config"].update(projector_type="mlp"), "variant"),
        ("dflash", lambda c: c.update(hidden_size=64), "another target"),
        ("dspark", lambda c: c.update(markov_rank=0), "DeepSpec DFlash checkpoint"),
        ("dspark", lambda c: c.update(markov_head_type="gated"), "vanilla"),
        ("dspark", lambda c: c.update(confidence_head_with_markov=False), "Markov code"),
        ("dspark", lambda c: c.update(architectures=["Qwen3DFlashRNN"]), "architectures"),
    ],
)
def test_import_refuses_what_selfspec_does_not_compute(target, tmp_path, head_type, edit, match):
    out = published(export_heads(make(target, head_type), "sglang", tmp_path / "sg", target_name_or_path="t"), edit)
    with pytest.raises(HeadFormatError, match=match):
        read_foreign_head(out, "sglang", target)


def test_import_refuses_another_target_and_a_selfspec_directory(target, tmp_path):
    head = make(target, "dflash")
    head.config = dataclasses.replace(head.config, target_fingerprint=target_fingerprint(target))
    out = export_heads(head, "sglang", tmp_path / "sg", target_name_or_path="t")
    assert json.loads((out / "config.json").read_text())["selfspec_target_fingerprint"]
    with pytest.raises(HeadFormatError, match="fingerprint"):
        read_foreign_head(out, "sglang", tiny_target("llama", seed=1))
    own = make(target, "dflash").save_pretrained(tmp_path / "own")
    cfg = json.loads((own / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    (own / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="selfspec head directory"):
        read_foreign_head(own, "sglang", target)
