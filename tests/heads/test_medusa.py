"""Medusa heads: shapes, identity at init, strict save/load, refusal of wrong files."""

import json

import pytest
import torch

from selfspec.heads import load_heads
from selfspec.heads.config import HeadFormatError
from selfspec.heads.medusa import MedusaConfig, MedusaHeads


def make(own=True, draft=None, D=16, V=40, K=3):
    torch.manual_seed(0)
    lm = torch.randn(V, D)
    ids = torch.arange(0, V, 2)[:draft] if draft else None
    cfg = MedusaConfig(
        hidden_size=D, vocab_size=V, num_heads=K, own_lm_head=own, draft_vocab_size=draft, target_fingerprint="abc"
    )
    return MedusaHeads(cfg, target_lm_head=lm, draft_ids=ids), lm, ids


@pytest.mark.parametrize("own", [True, False])
def test_fresh_heads_reproduce_target_projection(own):
    heads, lm, ids = make(own=own, draft=10)
    h = torch.randn(5, 16)
    logits = heads(h)
    assert logits.shape == (3, 5, 10)
    # W is zero-initialised, so every head starts as the target's lm_head restricted to the draft vocab
    for k in range(3):
        torch.testing.assert_close(logits[k], h @ lm[ids].T)


@pytest.mark.parametrize("own", [True, False])
def test_save_load_round_trip_same_outputs(tmp_path, own):
    heads, lm, _ = make(own=own, draft=10)
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    heads.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "medusa" and saved["num_heads"] == 3
    loaded = MedusaHeads.from_pretrained(tmp_path, target_lm_head=lm, target_fingerprint="abc")
    h = torch.randn(4, 16)
    assert torch.equal(heads(h), loaded(h))
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert all(k.startswith(("blocks.", "lm_heads.", "draft_ids")) for k in keys)  # head keys only
    if own:
        assert "lm_heads.0.weight" in keys and "blocks.2.layers.0.weight" in keys


def test_wrong_target_is_refused(tmp_path):
    heads, lm, _ = make()
    heads.save_pretrained(tmp_path)
    with pytest.raises(HeadFormatError, match="another|not on the target"):
        MedusaHeads.from_pretrained(tmp_path, target_fingerprint="zzz")
    with pytest.raises(HeadFormatError, match="another target"):
        MedusaHeads.from_pretrained(tmp_path, target_lm_head=torch.randn(41, 16))


def test_corrupt_or_mismatched_files_are_refused(tmp_path):
    heads, _, _ = make()
    heads.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # truncated file
    with pytest.raises(HeadFormatError, match="cannot read"):
        MedusaHeads.from_pretrained(tmp_path)
    weights.write_bytes(good)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_heads=4)))  # config disagrees with weights
    with pytest.raises(HeadFormatError, match="missing"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, typo_key=1)))
    with pytest.raises(HeadFormatError, match="unknown keys"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HeadFormatError):
        load_heads(tmp_path)
    with pytest.raises(HeadFormatError, match="no config.json"):
        load_heads(tmp_path / "nowhere")
