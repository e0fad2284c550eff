"""``init_heads``: a run of every family that trains starts from saved heads (every tensor), takes their shape, is
evaluated before its first step so selection can keep the start, leaves the input heads untouched, and refuses
heads of another family or another target before any training."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from selfspec.heads import load_heads
from selfspec.heads.io import HeadFormatError
from selfspec.train.config import TrainConfig
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer
from tests.helpers.training import tiny_run_config

pytestmark = pytest.mark.usefixtures("one_thread")

SECTIONS = {
    "eagle3": {"eagle3": {"batch_tokens": 96, "ttt_steps": 2}},
    "dspark": {"block": {"block_size": 4, "anchors": 4, "batch_tokens": 96, "markov_rank": 4}},
    "medusa": {"medusa": {"num_heads": 2, "batch_positions": 64}},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir with its tokenizer, data file)."""
    root = tmp_path_factory.mktemp("warm")
    tiny_llama(vocab_size=96, hidden_size=32).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(24)))
    return root / "target", data


def config(setup, head: str, out, **over) -> TrainConfig:
    return tiny_run_config(*setup, head, out, **{**SECTIONS[head], **over})


def run(cfg: TrainConfig):
    from selfspec.train.__main__ import run as train_run

    return train_run(cfg)


def digest(directory) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file())).hexdigest()


@pytest.mark.parametrize("head", sorted(SECTIONS))
def test_warm_start_takes_the_heads_and_their_shape(setup, tmp_path, head):
    from selfspec.train.recipes import warm_started

    # the cold run's head shape differs from the warm run's config defaults below (draft vocabulary 48, not 64)
    cold = run(config(setup, head, tmp_path / "cold", draft_vocab_size=48))
    before = digest(cold)
    cfg = warm_started(config(setup, head, tmp_path / "warm", lr=1e-9, epochs=1, init_heads=str(cold)))
    assert cfg.draft_vocab_size == 48  # the shape comes from the heads, not from the config
    warm = run(cfg)
    assert digest(cold) == before  # the input heads are only read
    summary = json.loads((warm.parent / "train_summary.json").read_text())
    first = summary["history"][0]
    assert first["step"] == 0 and summary["initial"]["step"] == 0
    cold_summary = json.loads((cold.parent / "train_summary.json").read_text())
    # the start is the cold run's selected head: the same held-out estimate on the same split
    assert summary["initial"]["chain_tau"] == pytest.approx(cold_summary["selected"]["chain_tau"], abs=1e-4)
    assert summary["selected"]["chain_tau"] >= summary["initial"]["chain_tau"]
    # lr 1e-9: every tensor of the trained head is the start's to within a step of that size
    a, b = load_heads(cold).state_dict(), load_heads(warm).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_warm_start_refuses_another_family_or_target(setup, tmp_path):
    from selfspec.train.recipes import warm_started

    heads = run(config(setup, "eagle3", tmp_path / "e3", epochs=1))
    with pytest.raises(ValueError, match="holds eagle3 heads but this run trains head=dspark: set head=eagle3"):
        warm_started(config(setup, "dspark", tmp_path / "x", init_heads=str(heads)))
    other = tmp_path / "other"
    tiny_llama(vocab_size=96, hidden_size=32, seed=1).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    with pytest.raises(HeadFormatError, match="^init_heads: "):
        run(config(setup, "eagle3", tmp_path / "y", init_heads=str(heads), target=str(other)))
    assert not (tmp_path / "y" / "heads").exists()
    with pytest.raises(HeadFormatError):
        warm_started(config(setup, "eagle3", tmp_path / "z", init_heads=str(tmp_path / "missing")))
