"""train/dflash.py: the DFlash / DSpark recipes on the shared loop (features, anchors, loss, evaluation, save), the
saved heads reload and decode exactly; the block mask; the losses against hand-computed values."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.train.dflash import block_mask, sample_anchors
from tests.helpers.archs import tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_block_mask_sees_the_context_before_its_anchor_and_its_own_block():
    valid = torch.tensor([[True] * 5 + [False]])
    m = block_mask(torch.tensor([[2, 4]]), valid, 2, torch.float32)[0, 0] == 0  # [4, 6 + 4]
    expect = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
            [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expect)


def test_anchors_open_blocks_whose_first_draft_is_an_answer_token():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    got = sample_anchors(mask, 8, 10, 3, torch.Generator().manual_seed(0))
    assert got.tolist() == [2, 3, 4, 6]  # x_{a+1} is an answer token, a >= 1, a + 1 < T
    assert sample_anchors(mask, 8, 2, 3, torch.Generator().manual_seed(0)).numel() == 2


def test_losses_on_hand_built_distributions():
    """The ``dspark`` mix is 0.1 CE + 0.9 L1; with q = p it is 0.1 * (-log p[greedy]), and the KL is 0."""
    from selfspec.train.config import BlockOptions
    from selfspec.train.dflash import block_step_loss

    # One block, one scored draft: head logits equal to the target's give q = p exactly.
    D, S = 4, 3
    lm_rows = torch.eye(S, D) * 2.0
    f = torch.tensor([1.0, 0.0, 0.0, 0.0])
    p = torch.softmax(f @ lm_rows.T, -1)

    class Head:
        class config:
            max_drafts, hidden_size, head_type = 1, D, "dflash"

        logit_softcap = None
        draft_ids = torch.arange(S)
        confidence_head = None

        @staticmethod
        def draft_logits(z):
            return z @ lm_rows.T

        @staticmethod
        def markov(prev):
            return None

    batch = {
        "states": torch.cat([torch.zeros(1, 3, D), f.expand(1, 3, D)], dim=-1),
        "tokens": torch.tensor([[0, 1, 2]]),
        "valid": torch.ones(1, 3, dtype=torch.bool),
        "loss_mask": torch.tensor([[False, False, True]]),
        "anchors": torch.tensor([[1]]),
    }
    model = lambda *a: f.view(1, 1, 1, D).requires_grad_()  # noqa: E731
    ce = float(-p.log()[0])
    for kind, want in (("kl", 0.0), ("tv", 0.0), ("nla", 0.0), ("lk_hybrid", 0.0), ("ce", ce), ("dspark", 0.1 * ce)):
        for weights in ("decay", "confidence"):  # one draft: weight 1 either way
            loss, _, scored = block_step_loss(model, Head, batch, lm_rows, BlockOptions(loss=kind, weights=weights))
            assert scored == 1 and float(loss.detach()) == pytest.approx(want, abs=1e-6), (kind, weights)


def test_position_weights_decay_and_draft_confidence():
    """``decay``: exp(-k / decay); ``confidence``: the head's own chance that its earlier drafts equal the target's
    greedy tokens, an unscored draft counting as 1 and weighing 0 itself."""
    from selfspec.train.config import BlockOptions
    from selfspec.train.dflash import position_weights

    q = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.8, 0.1], [0.25, 0.25, 0.5], [0.6, 0.2, 0.2]])  # [P = 4, S = 3]
    log_q = q.log().requires_grad_()
    greedy = torch.tensor([0, 1, 2, 0])
    scored = torch.tensor([True, True, False, True])
    decay = position_weights(log_q, greedy, scored, BlockOptions(decay=2.0))
    assert torch.allclose(decay, torch.tensor([1.0, 0.60653066, 0.0, 0.22313016]), atol=1e-6)  # exp(-k / 2)
    conf = position_weights(log_q, greedy, scored, BlockOptions(weights="confidence"))
    assert torch.allclose(conf, torch.tensor([1.0, 0.5, 0.0, 0.5 * 0.8]), atol=1e-6)  # draft 2 unscored: x 1
    assert not conf.requires_grad
    with pytest.raises(ValueError, match="block.weights"):
        BlockOptions(weights="dpace")


@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_recipe_trains_saves_reloads_and_decodes_exactly(tmp_path, head_type):
    from accelerate import Accelerator

    from selfspec.api import make_drafter
    from selfspec.decode.drafters import BlockDrafter
    from selfspec.decode.loop import speculative_generate
    from selfspec.train.config import TrainConfig
    from selfspec.train.dflash import train_block
    from selfspec.train.inputs import RunInputs

    target = tiny_target("phi3")
    cfg = TrainConfig(
        head=head_type, max_length=48, self_distill=False, max_steps=3, eval_every=2, save_every=2,
        calibrate_prompts=0, draft_vocab_size=64, lr=1e-3, max_conversations=20, output_dir=str(tmp_path),
        block={"block_size": 4, "anchors": 8, "batch_tokens": 96, "num_layers": 2},
    )  # fmt: skip
    convs = conversations(20)
    heads = train_block(RunInputs(cfg, Accelerator(cpu=True), target, tiny_tokenizer(), convs[:14], convs[14:]))
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["step"] == 3 and summary["heldout"]["positions"] > 0
    assert len(summary["heldout"]["chain"]) == (4 if head_type == "dspark" else 3)
    drafter = make_drafter(target, heads, tune="off")
    assert isinstance(drafter, BlockDrafter) and drafter.head.config.heldout_chain == tuple(summary["heldout"]["chain"])
    # sibling acceptance for widths 2 .. 4: one share per chain depth, growing with the width; a sibling only
    # counts where the chain's own draft was refused, so chain and sibling shares add to at most 1
    chain, siblings = summary["heldout"]["chain"], summary["heldout"]["siblings"]
    assert len(siblings) == 3 and all(len(row) == len(chain) for row in siblings)
    assert all(a <= b for lo, hi in zip(siblings, siblings[1:], strict=False) for a, b in zip(lo, hi, strict=True))
    assert all(c + s <= 1.0 for c, s in zip(chain, siblings[-1], strict=True))
    assert drafter.head.config.heldout_siblings == tuple(tuple(row) for row in siblings)
    ids = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(1))
    ref = target.generate(ids[None], do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0)
    assert speculative_generate(target, drafter, ids, max_new_tokens=20).tokens == ref[0, 10:].tolist()
