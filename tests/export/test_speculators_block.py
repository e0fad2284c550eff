"""selfspec/export/speculators_block.py: DFlash and DSpark heads in the speculators format, proven by speculators.

Fast: the layout, export -> import gives identical draft logits, the refusals at both ends. Slow: the speculators
package 0.9.0 (its own venv, :mod:`selfspec.engine_envs`) loads the exports with
``DFlashDraftModel`` / ``DSparkDraftModel.from_pretrained`` + ``load_verifier_weights`` and runs its own training
``forward`` on one anchor block (one valid anchor, so ``select_anchors`` has one choice); the logits (and DSpark's
confidence logits) are read where the forward hands them to ``compute_metrics``, and equal selfspec's for the same
block, fp32, within 1e-5.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from selfspec.export.cli import export_heads
from selfspec.export.common import ExportError
from selfspec.export.importer import read_foreign_head
from selfspec.heads.io import HeadFormatError, read_safetensors
from tests.helpers.archs import tiny_target
from tests.helpers.engines import run_engine_script
from tests.helpers.heads import ANCHOR, assert_same_block_outputs, block_head, block_inputs, block_logits

LAYERS = (0, 1)  # distinct target layers of the 3-layer tiny target


def make(target, head_type: str, draft: int | None = None):
    return block_head(target, head_type, 4, draft=draft, target_layer_ids=LAYERS)


def test_layout(target, tmp_path):
    head = make(target, "dspark", draft=40)
    out = export_heads(head, "speculators", tmp_path / "spec", target_name_or_path="tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["speculators_model_type"] == "dspark"
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2]  # layer inputs: target_layer_ids + 1
    assert (cfg["block_size"], cfg["draft_vocab_size"], cfg["mask_token_id"]) == (4, 40, 95)
    assert (cfg["sample_from_anchor"], cfg["markov_rank"], cfg["markov_head_type"]) == (True, 8, "vanilla")
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("qwen3", 2, 96)
    state = read_safetensors(out / "model.safetensors")
    assert "embed_tokens.weight" not in state and state["lm_head.weight"].shape == (40, 32)
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool
    assert state["markov_head.markov_w1.weight"].shape == (96, 8)
    assert state["confidence_head.proj.weight"].shape == (1, 40)  # [z; markov code]: D + R
    flash = export_heads(make(target, "dflash"), "speculators", tmp_path / "f", target_name_or_path="tiny")
    cfg = json.loads((flash / "config.json").read_text())
    assert cfg["sample_from_anchor"] is False and "markov_rank" not in cfg
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert not {"lm_head.weight", "d2t", "t2d"} & set(read_safetensors(flash / "model.safetensors"))


@pytest.mark.parametrize(("head_type", "draft"), [("dflash", None), ("dflash", 40), ("dspark", None), ("dspark", 40)])
def test_round_trip_gives_identical_logits(target, tmp_path, head_type, draft):
    head = make(target, head_type, draft)
    out = export_heads(head, "speculators", tmp_path / "spec", target_name_or_path="tiny")
    back = read_foreign_head(out, "speculators", target).eval()
    assert dataclasses.replace(back.config, target="", target_fingerprint="") == head.config  # the helper's: ""
    assert back.config.target == "tiny"
    assert_same_block_outputs(head, back)


def test_scaled_embedding_and_softcap_targets_are_refused(tmp_path):
    gemma = tiny_target("gemma2")
    with pytest.raises(ExportError, match="scaled"):
        export_heads(make(gemma, "dflash"), "speculators", tmp_path / "g", target_name_or_path="tiny")
    head = make(tiny_target("llama"), "dflash")
    head.logit_softcap = 30.0
    with pytest.raises(ExportError, match="not capped"):
        export_heads(head, "speculators", tmp_path / "s", target_name_or_path="tiny")


def test_repeated_target_layers_are_refused(target, tmp_path):
    head = block_head(target, "dflash", 4, target_layer_ids=(1, 1))
    with pytest.raises(ExportError, match="repeat a layer"):
        export_heads(head, "speculators", tmp_path / "r", target_name_or_path="tiny")


@pytest.mark.parametrize(
    ("head_type", "edit", "match"),
    [
        ("dflash", lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
        ("dflash", lambda c: c.update(aux_hidden_state_layer_ids=[0, 2]), r"in \[1, 2\]"),
        ("dflash", lambda c: c.update(aux_hidden_state_layer_ids=[1, 3]), r"in \[1, 2\]"),
        ("dflash", lambda c: c.update(mask_token_id=None), "mask_token_id"),
        ("dflash", lambda c: c["transformer_layer_config"].update(attention_bias=True), "attention_bias"),
        ("dflash", lambda c: c["transformer_layer_config"].update(model_type="llama"), "Qwen3"),
        (
            "dflash",
            lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"]),
            "sliding-window",
        ),
        # other DSpark heads
        ("dspark", lambda c: c.update(markov_head_type="gated"), "vanilla"),
        ("dspark", lambda c: c.update(confidence_head_with_markov=False), "Markov code"),
        ("dspark", lambda c: c.update(sample_from_anchor=False), "sample_from_anchor"),
        ("dspark", lambda c: c.update(markov_rank=0), "markov_rank"),
    ],
)
def test_import_refuses_what_selfspec_does_not_compute(target, tmp_path, head_type, edit, match):
    out = export_heads(make(target, head_type), "speculators", tmp_path / "spec", target_name_or_path="tiny")
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match=match):
        read_foreign_head(out, "speculators", target)


def test_import_refuses_another_targets_embedding(target, tmp_path):
    from safetensors.torch import save_file

    out = export_heads(make(target, "dflash"), "speculators", tmp_path / "spec", target_name_or_path="tiny")
    state = read_safetensors(out / "model.safetensors")
    state["embed_tokens.weight"] = torch.zeros(96, 32)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HeadFormatError, match="not the target's"):
        read_foreign_head(out, "speculators", target)


SCRIPT = r"""
import sys, torch
import speculators.models.dflash.core as dflash_core
import speculators.models.dspark.core as dspark_core
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
d, io, kind = sys.argv[1], torch.load(sys.argv[2]), sys.argv[4]
classes = {"dflash": (DFlashSpeculatorConfig, DFlashDraftModel), "dspark": (DSparkSpeculatorConfig, DSparkDraftModel)}
Config, Model = classes[kind]
cfg = Config.from_pretrained(d)
cfg.transformer_layer_config._attn_implementation = "eager"  # CPU: speculators' default is flex attention
model = Model.from_pretrained(d, config=cfg).eval()
model.load_verifier_weights()
got = {}
def capture(logits, targets, *rest, **kw):  # where the forward hands its logits to the loss
    got["logits"] = logits
    if kind == "dspark":
        got["confidence"] = rest[0]
    return torch.zeros(()), {}
dflash_core.compute_metrics = dspark_core.compute_metrics = capture
feats, ids, pos, anchor = io["features"], io["ids"], io["pos"], io["anchor"]
loss_mask = torch.zeros_like(ids)
loss_mask[0, anchor] = 1  # the one valid anchor
with torch.no_grad():
    model(feats, ids, loss_mask, torch.randn(1, ids.shape[1], model.hidden_size), torch.zeros_like(ids),
          position_ids=pos, max_anchors=1)
torch.save(got, sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.parametrize(("head_type", "draft"), [("dflash", None), ("dflash", 40), ("dspark", None), ("dspark", 40)])
def test_speculators_computes_our_block_head(spec_python, target, tmp_path, head_type, draft):
    head = make(target, head_type, draft)
    target.save_pretrained(tmp_path / "target")
    out = export_heads(head, "speculators", tmp_path / "spec", target_name_or_path=str(tmp_path / "target"))
    feats, ids, pos = block_inputs(head)
    io = {"features": feats, "ids": ids, "pos": pos, "anchor": ANCHOR}
    theirs = run_engine_script(spec_python, SCRIPT, out, io, tmp_path, head_type)
    logits, confidence = block_logits(head)
    B, S = head.config.block_size, head.config.n_draft
    assert theirs["logits"].shape == (1, B, S)
    diffs = [(theirs["logits"][0] - logits).abs().max().item()]
    if confidence is not None:
        assert theirs["confidence"].shape == (1, B)
        diffs.append((theirs["confidence"][0] - confidence).abs().max().item())
    print(f"speculators vs selfspec {head_type} S={S}: max |diff| logits, confidence = {diffs}")
    assert max(diffs) < 1e-5
    seen_anchor = block_logits(head, context=ANCHOR + 1)[0]  # the anchor's own features too: another function
    assert (theirs["logits"][0] - seen_anchor).abs().max().item() > 1e-3
