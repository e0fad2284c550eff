"""One-layer heads of the targets whose layers differ from Llama's where a head is built from them: Gemma-4 (full
layers wider than sliding ones, a strictly typed ``sliding_window``, per-layer token inputs, KV-sharing layer calls)
and DeepSeek-V3's latent attention (hidden states read through ``kv_a_proj_with_mqa``, with or without a query
latent). Each head is built, drafts, saves and reloads to the same outputs; a head that cannot be built as asked is
refused when it is built, naming the layer."""

from __future__ import annotations

import pytest
import torch

from selfspec.heads.block_layers import draft_layer_config
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.heads.io import HeadFormatError
from tests.helpers.archs import CONFIGS, tiny_target
from tests.helpers.heads import draft_logits

V, D = 96, 32


@pytest.fixture(scope="module")
def gemma4():
    return tiny_target("gemma4")


def test_gemma4_eagle_head_takes_the_full_layer_sizes(gemma4, tmp_path):
    """EAGLE-1 started from the target's last (full-attention) layer: that layer's head size (16, the sliding
    layers' is 8), its weights, full attention, no per-layer inputs; saved and reloaded, the same outputs."""
    full = gemma4.model.layers[2].self_attn
    assert (full.head_dim, gemma4.model.layers[0].self_attn.head_dim) == (16, 8)
    head = EagleHead(EagleConfig(D, V), gemma4.config, target=gemma4, init_from_target_layer=True).eval()
    attn = head.layers[0].self_attn
    assert attn.head_dim == 16 and attn.sliding_window is None and head.arch_config.layer_types == ["full_attention"]
    assert head.arch_config.hidden_size_per_layer_input == 0
    torch.testing.assert_close(attn.q_proj.weight, full.q_proj.weight, rtol=0, atol=0)
    head.save_pretrained(tmp_path)
    again = EagleHead.from_pretrained(tmp_path, target=gemma4).eval()
    assert again.layers[0].self_attn.head_dim == 16
    torch.testing.assert_close(draft_logits(again, D), draft_logits(head, D), rtol=0, atol=0)


def test_gemma4_eagle3_head_builds_saves_and_reloads(gemma4, tmp_path):
    head = Eagle3Head(Eagle3Config(D, V, 40, 3), gemma4.config, target=gemma4, init_layer=-1, init_lm_head=True).eval()
    assert head.config.draft_layer == "target" and head.layers[0].self_attn.head_dim == 16
    assert head.layers[0].self_attn.q_proj.in_features == 2 * D
    head.save_pretrained(tmp_path)
    again = Eagle3Head.from_pretrained(tmp_path, target=gemma4).eval()
    torch.testing.assert_close(draft_logits(again, 3 * D), draft_logits(head, 3 * D), rtol=0, atol=0)


def test_gemma4_start_from_a_layer_of_other_sizes_is_refused(gemma4):
    with pytest.raises(HeadFormatError, match=r"target layer 0 has sizes .*start it from layer 2"):
        Eagle3Head(Eagle3Config(D, V, 40, 3), gemma4.config, target=gemma4, init_layer=0)


def test_gemma4_block_layers_take_the_last_layer_sizes(gemma4):
    cfg = draft_layer_config(gemma4.config, 2, 4)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size) == (16, 4, D)


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_deepseek_eagle3_head_is_a_llama_layer(q_lora_rank, tmp_path):
    """Latent attention reads the hidden states through ``kv_a_proj_with_mqa`` (and ``q_a_proj`` with a query
    latent), which the q/k/v widening does not cover: the head's layer is a Llama layer of the target's sizes with
    its own RoPE (the engines' EAGLE-3 layout for DeepSeek), it drafts, saves as a Llama layer and reloads."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    t = AutoModelForCausalLM.from_config(CONFIGS["deepseek_v3"](q_lora_rank=q_lora_rank)).eval()
    head = Eagle3Head(Eagle3Config(D, V, 40, 3), t.config, target=t, init_layer=-1, init_lm_head=True).eval()
    assert head.config.draft_layer == "llama" and type(head.layers[0]).__name__ == "LlamaDecoderLayer"
    assert head.arch_config.model_type == "llama" and head.arch_config.head_dim == D // 4
    logits = draft_logits(head, 3 * D)
    assert logits.shape == (1, 7, 40) and bool(logits.isfinite().all())
    head.save_pretrained(tmp_path)
    again = Eagle3Head.from_pretrained(tmp_path, target=t).eval()
    assert again.config.draft_layer == "llama"
    torch.testing.assert_close(draft_logits(again, 3 * D), logits, rtol=0, atol=0)
    with pytest.raises(HeadFormatError, match=r"DeepseekV3DecoderLayer reads the hidden states through .*kv_a_proj"):
        Eagle3Head(Eagle3Config(D, V, 40, 3, draft_layer="target"), t.config, target=t)


def test_draft_layer_must_be_known():
    with pytest.raises(ValueError, match="draft_layer must be one of"):
        Eagle3Config(D, V, 40, 3, draft_layer="mla")
