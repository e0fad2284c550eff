"""Files as users save them: a UTF-8 byte-order mark (what Windows editors write) is no content. Prompt files in
every layout, conversation files, the bench's MT-bench prompts, YAML configs, JSON files, chat templates: each reads
the same with and without the mark, and a JSONL file (one marked line included) is never taken for plain text."""

from __future__ import annotations

import json

import pytest

from selfspec.base.files import read_json
from selfspec.prompts import load_jsonl_prompts
from selfspec.train.chat_format import read_chat_template
from selfspec.train.config import load_config
from selfspec.train.data import load_conversations, load_prompt_file

BOM = "\ufeff"
TOPICS = ["the sea", "winter", "a cat"]
CHATS = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": f"on {t}"}]} for t in TOPICS]


def write(path, text: str, bom: bool):
    path.write_bytes((BOM + text if bom else text).encode("utf-8"))
    return path


PROMPT_FILES = {
    "mt-bench": "".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(TOPICS)),
    "openai-jsonl": "".join(json.dumps(c) + "\n" for c in CHATS),
    "sharegpt-array": json.dumps([{"conversations": [{"from": "human", "value": t}]} for t in TOPICS]),
    "text": "\n".join(TOPICS) + "\n",
}


@pytest.mark.parametrize("layout", sorted(PROMPT_FILES))
def test_prompt_files_read_the_same_with_a_byte_order_mark(tmp_path, layout):
    plain = load_prompt_file(write(tmp_path / "plain", PROMPT_FILES[layout], bom=False))
    marked = load_prompt_file(write(tmp_path / "marked", PROMPT_FILES[layout], bom=True))
    assert marked == plain
    assert [p["messages"] for p in marked] == [[{"role": "user", "content": t}] for t in TOPICS]


def test_a_jsonl_file_is_never_read_as_plain_text(tmp_path):
    """Two JSONL files joined, each with its mark: the second mark starts a line in the middle."""
    text = PROMPT_FILES["openai-jsonl"]
    joined = write(tmp_path / "joined.jsonl", text + BOM + text, bom=True)
    prompts = load_prompt_file(joined)
    assert [p["messages"][0]["content"] for p in prompts] == TOPICS + TOPICS
    assert not any("{" in p["messages"][0]["content"] for p in prompts)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_conversation_files_read_the_same_with_a_byte_order_mark(tmp_path, suffix):
    text = "".join(json.dumps(c) + "\n" for c in CHATS) if suffix == ".jsonl" else json.dumps(CHATS)
    plain = load_conversations(write(tmp_path / f"plain{suffix}", text, bom=False))
    marked = load_conversations(write(tmp_path / f"marked{suffix}", text, bom=True))
    assert marked == plain and [c["messages"][0]["content"] for c in marked] == TOPICS


def test_bench_prompts_configs_json_and_templates_read_the_same_with_a_byte_order_mark(tmp_path):
    mt = PROMPT_FILES["mt-bench"]
    plain, marked = (load_jsonl_prompts(write(tmp_path / f"q{b}.jsonl", mt, bom=b)) for b in (False, True))
    assert [p.turns for p in marked] == [p.turns for p in plain] == [(t,) for t in TOPICS]
    yaml_text = "head: eagle3\nlr: 0.002\nmax_length: 64\n"
    configs = [load_config(write(tmp_path / f"c{b}.yaml", yaml_text, bom=b)) for b in (False, True)]
    assert configs[0] == configs[1] and configs[1].lr == 0.002 and configs[1].max_length == 64
    record = {"format": "x", "values": [1, 2]}
    assert read_json(write(tmp_path / "r.json", json.dumps(record), bom=True)) == record
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert read_chat_template(write(tmp_path / "t.jinja", template, bom=True)) == template
