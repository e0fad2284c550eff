"""Training on the architectures served in 2026 (tests/helpers/archs.py ``SERVED_ARCHS``, and the hybrid Qwen3-Next
and LFM2): one optimiser step of an EAGLE-3 head on each (DeepSeek-V3's and LFM2's with a Llama draft layer: latent
attention, and a layer without ``input_layernorm``, cannot be widened), the head saved, reloaded and decoding exactly
like the target's ``generate``; and one step of every other family on a mixture-of-experts target (Qwen3-MoE) and on
Gemma-4 (per-layer head sizes)."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.loop import speculative_generate
from selfspec.train.inputs import RunInputs
from tests.helpers.archs import SERVED_ARCHS, tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96
NEW = 12
ONE_STEP = dict(
    self_distill=False,
    target="tiny",
    max_length=32,
    draft_vocab_size=64,
    lr=3e-3,
    warmup_steps=1,
    max_steps=1,
    eval_every=1000,
    save_every=1000,
    seed=0,
    calibrate_prompts=0,
    max_train_minutes=None,
)
FAMILIES = {
    "eagle3": {"eagle3": {"batch_tokens": 64, "ttt_steps": 2}},
    "eagle": {"eagle": {"batch_tokens": 64, "ttt_steps": 2}},
    "medusa": {"medusa": {"num_heads": 2, "batch_positions": 32}},
    "dflash": {"block": {"block_size": 4, "batch_tokens": 64}},
}


def train_one_step(tmp_path, target, head: str):
    from accelerate import Accelerator

    from selfspec.train.config import TrainConfig
    from selfspec.train.recipes import recipe_for

    cfg = TrainConfig(**ONE_STEP, **FAMILIES[head], head=head, output_dir=str(tmp_path))
    convs = conversations(10)
    return recipe_for(cfg).train(RunInputs(cfg, Accelerator(cpu=True), target, tiny_tokenizer(), convs[:8], convs[8:]))


def decodes_exactly(target, heads_dir) -> None:
    from selfspec.api import make_drafter

    ids = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(5))
    ref = target.generate(ids[None], do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
    drafter = make_drafter(target, heads_dir, tune="off")
    assert speculative_generate(target, drafter, ids, max_new_tokens=NEW).tokens == ref[0, 12:].tolist()


# Granite-4 (no RoPE) takes no EAGLE head: refused at build (tests/decode/test_state_targets.py)
@pytest.mark.parametrize("arch", SERVED_ARCHS + ("qwen3_next", "lfm2"))
def test_eagle3_trains_a_step_reloads_and_decodes_exactly(arch, tmp_path):
    from selfspec.heads import load_heads

    target = tiny_target(arch)
    heads_dir = train_one_step(tmp_path, target, "eagle3")
    head = load_heads(heads_dir, target=target)
    # latent attention, and LFM2's layer without input_layernorm: a Llama draft layer
    assert head.config.draft_layer == ("llama" if arch in ("deepseek_v3", "lfm2") else "target")
    assert head.config.n_draft == 64
    decodes_exactly(target, heads_dir)


@pytest.mark.parametrize("head", ["eagle", "medusa", "dflash"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4"])
def test_every_family_trains_a_step_on_moe_and_gemma4(arch, head, tmp_path):
    target = tiny_target(arch)
    decodes_exactly(target, train_one_step(tmp_path, target, head))
