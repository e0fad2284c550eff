"""Tests for selfspec.prompts: prompt encoding (ids, strings, chat messages), stop ids, and the benchmark prompt
sets (MT-bench JSONL; the held-out ShareGPT split from a head's training record, or the training defaults)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from selfspec import prompts as P
from selfspec.prompts import BenchPrompt, encode_messages, encode_prompt, load_prompts, resolve_eos
from tests.helpers.conversations import CONVS, QUESTIONS
from tests.helpers.tokenizers import CharTokenizer
from tests.helpers.training import write_record


class TextTokenizer(CharTokenizer):
    """CharTokenizer that also tokenizes plain text the way ``tokenizer(text, add_special_tokens=...)`` does."""

    def __init__(self, eos_token_id: int | None = 2) -> None:
        self.eos_token_id = eos_token_id
        self.calls: list[dict] = []

    def __call__(self, text, add_special_tokens=True):
        self.calls.append({"text": text, "add_special_tokens": add_special_tokens})
        return {"input_ids": ([1] if add_special_tokens else []) + self.encode_text(text)}


def target_with_eos(eos):
    return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))


# --------------------------------------------------------------------------------------------------
# Encoding


def test_encode_prompt_token_ids():
    for prompt in ([5, 6, 7], (5, 6, 7), torch.tensor([5, 6, 7]), torch.tensor([[5, 6, 7]], dtype=torch.int32)):
        ids = encode_prompt(None, prompt)
        assert ids.dtype == torch.long and ids.shape == (3,) and ids.tolist() == [5, 6, 7]


def test_encode_prompt_string_adds_no_special_tokens():
    tok = TextTokenizer()
    ids = encode_prompt(tok, "hi!")
    assert ids.tolist() == tok.encode_text("hi!") and ids.dtype == torch.long
    assert tok.calls == [{"text": "hi!", "add_special_tokens": False}]


def test_encode_prompt_chat_messages_use_the_template_with_generation_prompt():
    tok = CharTokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert expected[-len("<assistant>") :] == tok.encode_text("<assistant>")
    assert encode_prompt(tok, messages).tolist() == expected
    assert encode_messages(tok, messages).tolist() == expected
    assert encode_messages(tok, tuple(messages)).dtype == torch.long


def test_encode_prompt_errors():
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(None, [])
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(None, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="need a tokenizer"):
        encode_prompt(None, "hello")
    with pytest.raises(ValueError, match="need a tokenizer"):
        encode_prompt(None, [{"role": "user", "content": "hello"}])


# --------------------------------------------------------------------------------------------------
# Stop ids


def test_resolve_eos_from_generation_config_one_or_several():
    assert resolve_eos(target_with_eos(7), None) == [7]
    assert resolve_eos(target_with_eos([7, 9, 7]), TextTokenizer(eos_token_id=2)) == [7, 9]  # config wins, no repeats
    assert resolve_eos(target_with_eos((2, 3)), None) == [2, 3]


def test_resolve_eos_falls_back_to_the_tokenizer_then_to_none():
    assert resolve_eos(target_with_eos(None), TextTokenizer(eos_token_id=2)) == [2]
    assert resolve_eos(target_with_eos(None), TextTokenizer(eos_token_id=None)) == []
    assert resolve_eos(target_with_eos(None), None) == []
    assert resolve_eos(SimpleNamespace(), None) == []  # a model without a generation config


def test_resolve_eos_extra_ids_come_after_without_repeats():
    assert resolve_eos(target_with_eos([7, 9]), None, extra=11) == [7, 9, 11]
    assert resolve_eos(target_with_eos([7, 9]), None, extra=[9, 12, 12]) == [7, 9, 12]
    assert resolve_eos(target_with_eos(None), TextTokenizer(eos_token_id=2), extra=(2, 5)) == [2, 5]
    assert resolve_eos(target_with_eos(None), None, extra=[4]) == [4]
    assert [type(i) for i in resolve_eos(target_with_eos(3), None, extra=[torch.tensor(4)])] == [int, int]


def test_resolve_eos_on_a_real_generation_config():
    from tests.helpers.archs import tiny_llama

    target = tiny_llama()
    assert resolve_eos(target, CharTokenizer()) == [2]  # the tiny config names no EOS: the tokenizer's
    target.generation_config.eos_token_id = [2, 5]
    assert resolve_eos(target, CharTokenizer(), extra=6) == [2, 5, 6]


# --------------------------------------------------------------------------------------------------
# Prompt files


def test_load_prompts_jsonl_and_errors(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n\n" + json.dumps({"question_id": 2, "turns": ["hi"]}) + "\n")
    prompts = load_prompts(str(path))
    assert prompts[0] == BenchPrompt("81", "writing", ("Write a poem about tea.", "Now make it rhyme."))
    assert prompts[1].category == "default"
    assert len(load_prompts(str(path), num_prompts=1)) == 1
    assert load_prompts(str(path), max_turns=1)[0].turns == ("Write a poem about tea.",)
    path.write_text('{"question_id": 1, "category": "x"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:1 needs 'turns'"):
        load_prompts(str(path))


def test_load_prompts_per_category(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"t{i}"]} for i, c in enumerate("aabba")]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [p.question_id for p in load_prompts(str(path), per_category=1)] == ["0", "2"]
    assert [p.question_id for p in load_prompts(str(path), per_category=2, num_prompts=3)] == ["0", "1", "2"]


# --------------------------------------------------------------------------------------------------
# The held-out ShareGPT split


@pytest.fixture
def fake_data(monkeypatch):
    """``load_conversations`` replaced by CONVS; returns the calls it got."""
    from selfspec.train import data

    calls = []

    def fake_load(source, max_conversations=None):
        calls.append((source, max_conversations))
        return CONVS[:max_conversations] if max_conversations is not None else CONVS

    monkeypatch.setattr(data, "load_conversations", fake_load)
    return calls


def test_sharegpt_heldout_without_a_record_uses_the_training_defaults(fake_data, tmp_path, caplog):
    from selfspec.train import data
    from selfspec.train.config import TrainConfig

    heads = tmp_path / "old-heads"
    heads.mkdir()
    with caplog.at_level(logging.WARNING, logger="selfspec.prompts"):
        prompts = load_prompts(P.SHAREGPT_HELDOUT, head_dirs=[heads])
    cfg = TrainConfig()
    assert fake_data == [(cfg.data, cfg.max_conversations)] and cfg.data == "sharegpt"
    _, heldout = data.split_conversations(CONVS, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    assert [p.question_id for p in prompts] == [c["id"] for c in heldout] and prompts
    assert prompts[0].preamble == ({"role": "system", "content": "be brief"},)
    assert prompts[0].turns == (heldout[0]["messages"][1]["content"],)
    assert prompts[0].category == "sharegpt"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no training_record.json" in warnings[0].getMessage()
    assert str(heads) in warnings[0].getMessage() and "TrainConfig" in warnings[0].getMessage()
    # no heads at all: the same split, announced without a warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="selfspec.prompts"):
        assert load_prompts(P.SHAREGPT_HELDOUT) == prompts
    assert caplog.records and all(r.levelno < logging.WARNING for r in caplog.records)


def test_sharegpt_heldout_reads_the_heads_training_record(fake_data, tmp_path, caplog):
    from selfspec.train import data
    from selfspec.train.config import TrainConfig

    ids = ["c4", "c17", "c99", "c140"]  # split order = data order
    heads = write_record(tmp_path / "eagle" / "heads", ids)
    with caplog.at_level(logging.WARNING, logger="selfspec.prompts"):
        prompts = load_prompts(P.SHAREGPT_HELDOUT, head_dirs=[heads])
    assert not caplog.records
    assert fake_data == [("my-chats.jsonl", 150)]  # the record's data, not TrainConfig's
    assert [p.question_id for p in prompts] == ids
    assert prompts[1] == BenchPrompt("c17", "sharegpt", ("q17",), ({"role": "system", "content": "be brief"},))
    cfg = TrainConfig()
    _, default_heldout = data.split_conversations(CONVS, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    assert [c["id"] for c in default_heldout] != ids
    assert P.heldout_prompts(heads) == prompts
    assert [p.question_id for p in load_prompts(P.SHAREGPT_HELDOUT, num_prompts=2, head_dirs=[heads])] == ids[:2]


def test_several_heads_measure_only_prompts_every_record_holds_out(fake_data, tmp_path):
    first = write_record(tmp_path / "a", ["c4", "c17", "c99"])
    second = write_record(tmp_path / "b", ["c17", "c99", "c120"])
    no_record = tmp_path / "c"
    no_record.mkdir()
    prompts = load_prompts(P.SHAREGPT_HELDOUT, head_dirs=[first, second, no_record])
    assert [p.question_id for p in prompts] == ["c17", "c99"]
    assert len(fake_data) == 1  # the data is read once


def test_training_record_errors(fake_data, tmp_path):
    heads = write_record(tmp_path / "lost", ["c4", "c170"])  # c170 is beyond the record's 150 conversations
    with pytest.raises(ValueError, match=r"1 of the 2 held-out conversations .* data changed since training"):
        P.heldout_prompts(heads)
    heads = write_record(tmp_path / "v2", ["c4"], version=2)
    with pytest.raises(ValueError, match="version 2"):
        P.heldout_prompts(heads)
    heads = write_record(tmp_path / "other", ["c4"], format="something-else")
    with pytest.raises(ValueError, match="not a training record"):
        P.heldout_prompts(heads)
    heads = write_record(tmp_path / "partial", ["c4"])
    record = json.loads((heads / "training_record.json").read_text())
    del record["seed"], record["heldout_ids"]
    (heads / "training_record.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"lacks \['seed', 'heldout_ids'\]"):
        P.heldout_prompts(heads)
    (heads / "training_record.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        P.heldout_prompts(heads)
    assert fake_data == [("my-chats.jsonl", 150)]  # only the first, well-formed record got to the data
