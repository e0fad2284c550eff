"""train/online_features.py: features computed online give every family that trains online (EAGLE, EAGLE-3, DFlash,
DSpark) the head the store gives, Medusa refuses them, and ``auto`` picks the cheaper source for the run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from selfspec.train.config import TrainConfig, load_config
from selfspec.train.eagle_data import PairStore, collate
from selfspec.train.feature_store import store_path, target_features
from selfspec.train.inputs import RunInputs
from selfspec.train.online_features import feature_source, feature_stores, is_online
from tests.helpers.archs import tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = (0, 1, 2)


def config(tmp_path, features: str, **kw) -> TrainConfig:
    base = dict(
        head="eagle3",
        target="tiny",
        self_distill=False,
        max_length=32,
        draft_vocab_size=64,
        lr=3e-3,
        warmup_steps=1,
        max_steps=6,
        max_train_minutes=None,
        eval_every=3,
        save_every=1000,
        seed=0,
        calibrate_prompts=0,
        output_dir=str(tmp_path),
        feature_batch_tokens=0,  # one forward per sequence, as online: bit-equal (batching: test_batched_features)
        features=features,
        eagle3={"batch_tokens": 64, "ttt_steps": 2, "target_layers": LAYERS},
        eagle={"batch_tokens": 64},
        block={"block_size": 4, "anchors": 4, "batch_tokens": 64, "num_layers": 1, "target_layer_ids": (0, 1)},
    )
    base.update(kw)
    return TrainConfig(**base)


def test_online_sequences_equal_stored_ones(tmp_path):
    """Every sequence's online features are the stored ones, bit for bit, on Gemma-3 (sliding-window layers)."""
    from accelerate import Accelerator

    target, tok, convs = tiny_target("gemma3"), tiny_tokenizer(), conversations(8)
    cfg = config(tmp_path, "online")
    stored, held, sig = target_features(
        RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:6], convs[6:]), LAYERS
    )
    online, online_held, sig2, source = feature_stores(
        RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:6], convs[6:]), LAYERS, 64
    )
    assert source == "online" and sig2 == sig and is_online(online) and not is_online(stored)
    assert online.width == stored.width == 4 * 32
    assert torch.equal(online.lengths, stored.lengths) and torch.equal(online_held.lengths, held.lengths)
    for i in range(len(stored)):
        a, b = stored.sequence(i), online.sequence(i)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), i
    assert online.rows.computed_tokens == int(stored.lengths.sum())
    rows = [[0, 1], [2]]
    as_pairs, online = (PairStore(s.tokens, s.rows, s.loss_mask, s.lengths, s.starts) for s in (stored, online))
    for key, value in collate(as_pairs, rows).items():
        assert torch.equal(value, collate(online, rows)[key]), key
    assert online.scored_positions() == as_pairs.scored_positions() > 0


@pytest.mark.parametrize("head", ["eagle3", "eagle", "dflash", "dspark"])
def test_online_run_trains_the_head_the_store_trains(tmp_path, head):
    """The same run (6 steps, held-out evaluation twice) with ``features`` ``store`` and ``online``: equal heads
    and held-out figures, for every family that trains online; the online run writes no store and reports the
    tokens it forwarded."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from selfspec.train.recipes import recipe_for

    target, tok, convs = tiny_target("llama"), tiny_tokenizer(), conversations(20)
    heads, summaries = {}, {}
    for source in ("store", "online"):
        out = tmp_path / source
        cfg = config(out, source, head=head)
        heads_dir = recipe_for(cfg).train(RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:14], convs[14:]))
        heads[source] = load_file(str(heads_dir / "model.safetensors"))
        summaries[source] = json.loads((out / "train_summary.json").read_text())
    assert (store_path(tmp_path / "store") / "manifest.json").is_file() and not store_path(tmp_path / "online").exists()
    assert heads["store"].keys() == heads["online"].keys()
    for name, value in heads["store"].items():
        assert torch.allclose(value, heads["online"][name], atol=1e-6, rtol=0), name
    s, o = summaries["store"], summaries["online"]
    assert s["feature_source"] == "store" and o["feature_source"] == "online"
    assert s["heldout"] == o["heldout"] and o["heldout"]["positions"] > 0
    if head == "eagle3":
        # forwarded: the held-out split at 3 evaluations (steps 3, 6, the final one) and the 6 steps' rows (under
        # two epochs of the training split)
        stored, held, _ = target_features(RunInputs(config(tmp_path / "store", "store"), Accelerator(cpu=True),
                                                    target, tok, convs[:14], convs[14:]), LAYERS)  # fmt: skip
        train_total, held_total = int(stored.lengths.sum()), int(held.lengths.sum())
        assert 3 * held_total < o["online_feature_tokens"] <= 3 * held_total + 2 * train_total


def test_medusa_refuses_online_features(tmp_path):
    from accelerate import Accelerator

    from selfspec.train.medusa import train_medusa

    target, tok, convs = tiny_target("llama"), tiny_tokenizer(), conversations(6)
    cfg = config(tmp_path, "online", head="medusa")
    with pytest.raises(ValueError, match="features: store"):
        train_medusa(RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:4], convs[4:]))


def test_auto_picks_the_cheaper_source(tmp_path):
    cfg = config(tmp_path, "auto", max_steps=100, eval_every=50)  # 100 steps x 64 tokens = 6,400 tokens read
    gib = 2**30
    room = dict(memory=64 * gib, disk=500 * gib)
    # data larger than the run reads: online (7,900 forwarded vs 100,000 + 500 once)
    assert feature_source(cfg, 64, 100_000, 500, 128, 4, cached=False, **room)[0] == "online"
    # data the run reads many times over: the store
    assert feature_source(cfg, 64, 1_000, 500, 128, 4, cached=False, **room)[0] == "store"
    # a cache with the run's signature is free
    assert feature_source(cfg, 64, 100_000, 500, 128, 4, cached=True, **room)[0] == "store"
    # a store over the free disk: online, whatever the reads; a store larger than memory streams from disk
    many = config(tmp_path, "auto", max_steps=None, epochs=20, max_train_minutes=12)
    source, reason = feature_source(many, 64, 10**6, 0, 4 * 576, 4, cached=False, memory=64 * gib, disk=4 * gib)
    assert source == "online" and "free disk" in reason and "GiB" in reason
    source, reason = feature_source(many, 64, 10**6, 0, 4 * 576, 4, cached=False, memory=4 * gib, disk=500 * gib)
    assert source == "store" and "4.0 GiB of memory" in reason
    # an explicit choice is kept
    forced = config(tmp_path, "online")
    assert feature_source(forced, 64, 1_000, 500, 128, 4, cached=True)[0] == "online"


def test_features_option_is_validated():
    assert TrainConfig().features == "auto"
    assert load_config(None, ["features=online"]).features == "online"
    with pytest.raises(ValueError, match="features"):
        load_config(None, ["features=disk"])
    with pytest.raises(ValueError, match="eagle3.features.*features is now the top-level features"):
        load_config(None, ["eagle3.features=online"])
    with pytest.raises(ValueError, match="features"):
        dataclasses.replace(TrainConfig(), features="ram")
