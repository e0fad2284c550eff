"""heads/dflash.py: DFlash / DSpark heads save in the published checkpoint layout and load back strictly."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads import load_heads
from selfspec.heads.block_layers import draft_layer_config
from selfspec.heads.dflash import BlockConfig, BlockHead, default_target_layer_ids
from selfspec.heads.io import HeadFormatError
from tests.helpers.archs import tiny_target

V = 96


def head_of(target, head_type="dspark", draft=40) -> BlockHead:
    c = target.config
    cfg = BlockConfig(
        head_type=head_type, hidden_size=32, vocab_size=V, num_target_layers=c.num_hidden_layers, block_size=4,
        num_layers=2, mask_token_id=95, draft_vocab_size=draft, markov_rank=8 if head_type == "dspark" else 0,
        confidence=head_type == "dspark", target_fingerprint=target_fingerprint(target),
    )  # fmt: skip
    torch.manual_seed(0)
    return BlockHead(cfg, draft_layer_config(c, 2, 4), torch.arange(0, 80, 2), target)


def test_default_layers_follow_dflash_and_never_take_the_last_layer():
    assert default_target_layer_ids(30) == (1, 14, 27)
    assert default_target_layer_ids(3) == (1, 1, 1)  # tiny targets: repeated, never the last layer (2)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    with pytest.raises(ValueError):
        default_target_layer_ids(1)


def test_config_refuses_what_no_engine_loads():
    base = dict(hidden_size=32, vocab_size=V, num_target_layers=3, block_size=4, num_layers=1, mask_token_id=5)
    with pytest.raises(HeadFormatError, match="target_layer_ids"):
        BlockConfig(head_type="dflash", target_layer_ids=(2,), **base)  # the last layer's output is normed
    with pytest.raises(HeadFormatError, match="Markov head"):
        BlockConfig(head_type="dspark", **base)
    with pytest.raises(HeadFormatError, match="mask_token_id"):
        BlockConfig(head_type="dflash", **{**base, "mask_token_id": V})
    with pytest.raises(HeadFormatError, match="not one of"):
        BlockConfig(head_type="eagle3", **base)


@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_saved_layout_and_strict_round_trip(tmp_path, head_type):
    target = tiny_target("gemma2")
    head = head_of(target, head_type)
    head.save_pretrained(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel" if head_type == "dflash" else "DSparkDraftModel"]
    assert cfg["model_type"] == "qwen3" and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"block_size": 4, "mask_token_id": 95, "target_layer_ids": [1, 1, 1]}
    from safetensors.torch import load_file

    names = set(load_file(tmp_path / "h" / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "layers.1.self_attn.q_norm.weight" in names and not any("embed" in n for n in names)
    assert ("markov_head.markov_w1.weight" in names) == (head_type == "dspark")
    again = load_heads(tmp_path / "h", target=target)
    assert isinstance(again, BlockHead) and again.config == head.config
    for (k, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    # another target is refused; a tampered layout key is refused
    with pytest.raises(HeadFormatError):
        load_heads(tmp_path / "h", target=tiny_target("llama", seed=1))
    cfg["dflash_config"]["block_size"] = 8
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="dflash_config"):
        load_heads(tmp_path / "h")
