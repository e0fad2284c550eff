"""Medusa-2 (train/medusa2.py): heads and a LoRA adapter trained jointly on a tiny random Llama through the real
loop; the adapter starts as the base (KL 0), is saved beside the heads and merged at load; greedy speculative
output equals the adapted model's own ``generate``; a killed run resumes to the same heads and adapter; bad
options stop before any compute."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import selfspec
from selfspec.heads.io import HeadFormatError
from selfspec.train.config import TrainConfig, load_config
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base dir with its tokenizer, data file)."""
    root = tmp_path_factory.mktemp("medusa2")
    base_dir = root / "base"
    tiny_llama(vocab_size=96, hidden_size=32).save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)
    data = root / "chats.jsonl"
    with data.open("w") as fh:
        for conv in conversations(24):
            fh.write(json.dumps(conv) + "\n")
    return base_dir, data


def config(setup, out, **overrides) -> TrainConfig:
    base_dir, data = setup
    medusa = {"joint": True, "num_heads": 2, "batch_tokens": 96, "lora_rank": 4, "lora_alpha": 8}
    medusa.update(overrides.pop("medusa", {}))
    options = dict(
        head="medusa",
        target=str(base_dir),
        data=str(data),
        self_distill=False,
        max_length=32,
        draft_vocab_size=64,
        lr=1e-2,
        warmup_steps=1,
        epochs=4,
        eval_every=4,
        save_every=4,
        eval_fraction=0.2,
        calibrate_prompts=0,
        medusa=medusa,
        output_dir=str(out),
    )
    options.update(overrides)
    return TrainConfig(**options)


def train(setup, out, **overrides):
    from selfspec.train.__main__ import run

    return run(config(setup, out, **overrides))


@pytest.fixture(scope="module")
def joint_heads(setup, tmp_path_factory):
    return train(setup, tmp_path_factory.mktemp("run") / "joint")


def plain_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(
        input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=n, do_sample=False
    )
    return out[0, ids.numel() :].tolist()


def test_the_adapter_starts_as_the_base():
    """LoRA's B starts at zero: at step 0 the adapted and the base distributions are equal (KL 0), and the joint
    module's state holds only the adapter and the heads."""
    from selfspec.train.medusa2 import Medusa2Recipe, collate_sequences

    target, tok = tiny_llama(), tiny_tokenizer()
    from selfspec.train.feature_store import training_examples

    cfg = config((None, None), "unused", target="tiny", data="unused")
    examples = training_examples(cfg, target, tok, conversations(6))
    recipe = Medusa2Recipe(cfg, target, examples, examples[:2], "sig")
    b = collate_sequences(recipe.train_examples, [0, 1, 2], 2)
    log_q, log_p, head_logits = recipe.joint(b["input_ids"], b["attention_mask"], b["kl_at"], b["heads_at"])
    assert log_q.shape == log_p.shape == (int(b["kl_at"].sum()), 96) and log_q.shape[0] > 0
    torch.testing.assert_close(log_q, log_p, rtol=0, atol=1e-6)
    assert head_logits.shape == (2, int(b["heads_at"].sum()), 64)
    names = list(recipe.joint.state_dict())
    assert all(n.startswith(("lora.", "heads.")) for n in names) and any(n.startswith("lora.") for n in names)
    # the caller's target is left bare and frozen
    assert not any("lora" in n for n, _ in target.named_parameters())


def test_joint_training_saves_heads_with_their_adapter(setup, joint_heads):
    summary = json.loads((joint_heads.parent / "train_summary.json").read_text())
    assert summary["joint"] is True and summary["adapter"] == "adapter"
    assert 0.0 <= summary["heldout_kl_to_base"] < 0.5 and 0.0 <= summary["base_top1_agreement"] <= 1.0
    assert [h["step"] for h in summary["history"]] == list(range(4, summary["step"] + 1, 4))
    adapter = load_file(str(joint_heads / "adapter" / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and max(float(v.abs().max()) for v in lora_b) > 1e-4  # the adapter trained away from B = 0
    config = json.loads((joint_heads / "config.json").read_text())
    assert "+" in config["target_fingerprint"]  # base + adapter


def test_greedy_output_equals_the_adapted_models_generate(setup, joint_heads):
    from peft import AutoPeftModelForCausalLM

    base_dir, _ = setup
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(joint_heads / "adapter")).eval()  # unmerged
    for nodes in (3, 8):
        spec = selfspec.load(base_dir, joint_heads, tune="off", tree_nodes=nodes)  # adapter/ found and merged
        for i in (1, 5, 7):
            ids = spec.encode([{"role": "user", "content": f"tell me about the {['sea', 'moon', 'river'][i % 3]}"}])
            ref = plain_greedy(spec.target, ids, 16)
            assert spec.generate(ids, max_new_tokens=16, eos_token_id=[]).tokens == ref
            assert plain_greedy(peft_model, ids, 16) == ref  # merged and unmerged adapter agree on this path


def test_heads_are_refused_on_the_bare_base(setup, joint_heads):
    from selfspec.api import make_drafter
    from selfspec.target import load_target

    bare, _ = load_target(setup[0])
    with pytest.raises(HeadFormatError, match="with that adapter"):
        make_drafter(bare, joint_heads, tune="off")


def test_killed_joint_run_resumes_to_the_same_heads_and_adapter(setup, joint_heads, tmp_path, monkeypatch):
    import selfspec.train.loop as loop

    real_save = loop.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(setup, tmp_path / "killed")
    assert json.loads((tmp_path / "killed" / "checkpoint" / "trainer_state.json").read_text())["step"] == 4
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    resumed = train(setup, tmp_path / "killed")
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(str(joint_heads / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys() and a
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_bad_joint_options_stop_before_compute(setup, tmp_path):
    from selfspec.train.__main__ import main

    with pytest.raises(ValueError, match="trains its own LoRA adapter"):
        load_config(None, ["medusa.joint=true", "target_adapter=/some/adapter"])
    with pytest.raises(ValueError, match="lora_rank"):
        load_config(None, ["medusa.joint=true", "medusa.lora_rank=0"])
    with pytest.raises(ValueError, match="medusa.lora_modules"):  # refused before any output (selfspec: exit 2)
        main(["medusa.joint=true", "medusa.lora_modules=q_proj", f"output_dir={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="medusa.lora_modules"):
        train(setup, tmp_path / "wrong-modules", medusa={"lora_modules": ["no_such_proj"]})


def test_shipped_config_loads():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "medusa2-smollm2.yaml")
    assert cfg.head == "medusa" and cfg.medusa.joint and cfg.medusa.lora_rank == 8 and cfg.medusa.kl_weight == 1.0
    medusa1 = load_config(Path(__file__).resolve().parents[2] / "configs" / "medusa-smollm2.yaml")
    assert (cfg.data, cfg.distill_conversations, cfg.max_train_minutes) == (
        medusa1.data,
        medusa1.distill_conversations,
        medusa1.max_train_minutes,
    )


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_joint_heads_decode_exactly_on_other_families(family, tmp_path):
    """Medusa-2 on Gemma-3 (sliding-window and global layers) and Qwen3: the adapted target's greedy output."""
    from tests.helpers.archs import tiny_target

    base_dir = tmp_path / "base"
    tiny_target(family).save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(24)))
    heads = train((base_dir, data), tmp_path / "run", epochs=2, medusa={"lora_modules": ["q_proj", "v_proj"]})
    assert (heads / "adapter" / "adapter_config.json").is_file()
    spec = selfspec.load(base_dir, heads, tune="off", tree_nodes=4)
    for topic in ("sea", "winter"):
        ids = spec.encode([{"role": "user", "content": f"tell me about the {topic}"}])
        assert spec.generate(ids, max_new_tokens=16, eos_token_id=[]).tokens == plain_greedy(spec.target, ids, 16)


def test_joint_training_warm_starts_from_medusa1_heads(setup, tmp_path):
    """Medusa-2's two stages: Medusa-1 heads on the frozen base, then joint training from them. The joint run's
    heads start as the Medusa-1 heads (every tensor), and heads of another shape or target are refused with the
    option to change."""
    from selfspec.heads.medusa import MedusaHeads
    from selfspec.target import load_target
    from selfspec.train.data import load_conversations, split_conversations
    from selfspec.train.feature_store import training_examples
    from selfspec.train.medusa2 import Medusa2Recipe

    medusa1 = train(setup, tmp_path / "m1", medusa={"joint": False})
    target, tok = load_target(setup[0])
    cfg = config(setup, tmp_path / "m2", init_heads=str(medusa1))
    train_convs, eval_convs = split_conversations(load_conversations(str(setup[1])), eval_fraction=0.2, seed=0)
    ex, held = (training_examples(cfg, target, tok, c) for c in (train_convs, eval_convs))
    recipe = Medusa2Recipe(cfg, target, ex, held, "sig")
    warm = MedusaHeads.from_pretrained(medusa1).state_dict()
    start = recipe.heads.state_dict()
    assert warm.keys() == start.keys()
    for k in warm:
        assert torch.equal(warm[k], start[k]), k
    cold = Medusa2Recipe(config(setup, tmp_path / "m3"), target, ex, held, "sig").heads.state_dict()
    assert any(not torch.equal(cold[k], warm[k]) for k in warm)  # without init_heads: another start
    heads = train(setup, tmp_path / "m2", init_heads=str(medusa1))
    assert json.loads((heads.parent / "train_summary.json").read_text())["joint"] is True

    three = train(setup, tmp_path / "m1-3", medusa={"joint": False, "num_heads": 3})
    with pytest.raises(ValueError, match="init_heads: the heads' shape differs"):
        Medusa2Recipe(config(setup, tmp_path / "x", init_heads=str(three)), target, ex, held, "sig")
    # through the entry point the heads' shape is taken (warm_config): three heads train from three heads
    assert (
        json.loads((train(setup, tmp_path / "m2-3", init_heads=str(three)) / "config.json").read_text())["num_heads"]
        == 3
    )
    other = tiny_llama(vocab_size=96, hidden_size=32, seed=1)
    with pytest.raises(HeadFormatError, match="init_heads: .*another target|init_heads: .*fingerprint"):
        Medusa2Recipe(config(setup, tmp_path / "y", init_heads=str(medusa1)), other, ex, held, "sig")
    with pytest.raises(ValueError, match="is now the top-level init_heads"):
        load_config(None, ["medusa.init_heads=/some/heads"])
    # the record of a run written before the move holds it unset, and still loads
    record = tmp_path / "train_config.json"
    record.write_text(json.dumps({"medusa": {"num_heads": 3, "init_heads": None}}))
    assert load_config(record).medusa.num_heads == 3 and load_config(record).init_heads is None
