"""train/chat_format.py: a chat-template override and its kwargs bound once, so prompts, regeneration and loss masks
render alike; reasoning kept (in the loss mask) or dropped; a template that does not render refused before any work.
A hand-written thinking template (Qwen3's layout: the last answer's trace inside ``<think> ... </think>``, an empty
span in the generation prompt when thinking is off) over a word-level tokenizer built here."""

from __future__ import annotations

import json

import pytest

from selfspec.train.__main__ import main as train_main
from selfspec.train.chat_format import (
    answer_message,
    apply_reasoning,
    bind_chat_format,
    read_chat_template,
    split_reasoning,
    strip_thinking,
)
from selfspec.train.chat_tokens import tokenize_conversation
from selfspec.train.config import load_config
from selfspec.train.data import load_conversations
from selfspec.train.features import self_distill
from tests.helpers.archs import tiny_target
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

THINKING = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|assistant|> {% if loop.last and m.reasoning_content %}<think> {{ m.reasoning_content }} </think> {% endif %}"
    "{{ m['content'] }} <|end|> "
    "{%- else -%}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|> "
    "{%- if enable_thinking is defined and enable_thinking is false %} <think> </think> {% endif -%}"
    "{%- endif -%}"
)


def thinking_tokenizer():
    """Word-level over 80 words ``w0 .. w79``, the tiny tokenizer's specials and ``<think>``, ``</think>`` (ordinary
    tokens: decoding keeps them), with the target's template replaced by :data:`THINKING`."""
    tok = tiny_tokenizer([f"w{i}" for i in range(80)])
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING
    return tok


def masked(tok, messages) -> str:
    ex = tokenize_conversation(tok, messages, 64)
    return tok.decode(ex["input_ids"][ex["loss_mask"]])


TURN = [
    {"role": "user", "content": "w1 w2"},
    {"role": "assistant", "content": "w3 w4", "reasoning_content": "w5 w6"},
]


@pytest.mark.parametrize("thinking", [None, False])
def test_a_kept_trace_is_in_the_loss_mask_and_a_dropped_one_is_not(tmp_path, thinking):
    tok = thinking_tokenizer()
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    bind_chat_format(tok, None, kwargs)
    assert masked(tok, TURN) == "<think> w5 w6 </think> w3 w4"
    inline = [TURN[0], {"role": "assistant", "content": "<think> w5 w6 </think> w3 w4"}]  # rendered as written
    assert masked(tok, inline) == "<think> w5 w6 </think> w3 w4"
    dropped = apply_reasoning([{"id": "a", "messages": TURN}, {"id": "b", "messages": inline}], "drop")
    assert [m["messages"][1] for m in dropped] == [{"role": "assistant", "content": "w3 w4"}] * 2
    assert masked(tok, dropped[0]["messages"]) == "w3 w4"
    # an earlier turn's trace is not rendered by this template: its mask is the answer alone
    two = [*TURN, {"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8", "reasoning_content": "w9"}]
    assert masked(tok, two) == "w3 w4 <think> w9 </think> w8"
    assert apply_reasoning([{"id": "a", "messages": TURN}], "keep")[0]["messages"] == TURN


def test_kwargs_render_prompts_regeneration_and_masks_alike(tmp_path):
    """enable_thinking: false bound once: the generation prompt ends with the empty span, and self-distillation's
    answers are the greedy answers to that prompt (the same template the masks render with)."""
    tok = thinking_tokenizer()
    bind_chat_format(tok, None, {"enable_thinking": False})
    prompt = tok.apply_chat_template(TURN[:1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|assistant|> <think> </think> ")
    # a caller's own value does not override the run's
    assert tok.apply_chat_template(TURN[:1], add_generation_prompt=True, tokenize=False, enable_thinking=True) == prompt
    target = tiny_target("llama")
    target.generation_config.eos_token_id = 6
    target.generation_config.suppress_tokens = [0, 1, 2, 3, 4, 5]
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"w{i} w{i + 1}"}]} for i in range(4)]
    out = self_distill(target, tok, convs, tmp_path / "d.jsonl", 5, 2, disable_progress=True)
    for rec in out:
        text = tok.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ref = target.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        assert rec["messages"][1]["content"] == tok.decode(ref[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_regenerated_traces_kept_as_the_template_lays_them_out_or_dropped():
    tok = thinking_tokenizer()
    answer = "<think> w5 w6 </think> w3 w4"
    assert answer_message(tok, answer, "keep") == {
        "role": "assistant",
        "content": "w3 w4",
        "reasoning_content": "w5 w6",
    }
    assert answer_message(tok, answer, "drop") == {"role": "assistant", "content": "w3 w4"}
    assert answer_message(tok, "w3 w4", "keep") == {"role": "assistant", "content": "w3 w4"}
    plain = tiny_tokenizer()  # a template that does not render reasoning_content: the answer stays as written
    assert answer_message(plain, answer, "keep") == {"role": "assistant", "content": answer}
    assert strip_thinking("<think> w5 w6 </think> w3 <think> w1") == "w3"  # cut while thinking: dropped from there
    assert split_reasoning({"content": "<think> </think> w3"}) == ("", "<think> </think> w3")  # empty: as written


def test_a_template_file_replaces_the_targets_and_bad_ones_are_refused(tmp_path):
    tok = tiny_tokenizer([f"w{i}" for i in range(80)])
    tok.add_tokens(["<think>", "</think>"])
    good = tmp_path / "thinking.jinja"
    good.write_text(THINKING)
    bind_chat_format(tok, str(good), None)
    assert tok.chat_template == THINKING
    assert masked(tok, TURN) == "<think> w5 w6 </think> w3 w4"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match="is not a Jinja template"):
        read_chat_template(broken)
    failing = tmp_path / "failing.jinja"
    failing.write_text("{{ raise_exception('this template renders nothing') }}")
    with pytest.raises(ValueError, match="does not render a user / assistant exchange.*renders nothing"):
        bind_chat_format(tiny_tokenizer(), str(failing), None)
    with pytest.raises(FileNotFoundError, match="no such chat_template file"):
        bind_chat_format(tiny_tokenizer(), str(tmp_path / "none.jinja"), None)
    # the command refuses a missing or unparsable template before loading anything
    for path in (tmp_path / "none.jinja", broken):
        with pytest.raises((SystemExit, ValueError)):  # the command's usage error
            train_main([f"chat_template={path}", f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="not an identifier"):
        load_config(None, ["chat_template_kwargs={'not a name': 1}"])
    with pytest.raises(ValueError, match="reasoning must be one of"):
        load_config(None, ["reasoning=hide"])


def test_the_data_keeps_an_answers_reasoning_content(tmp_path):
    path = tmp_path / "r.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "w1"},
                {"role": "assistant", "content": "w2", "reasoning_content": "w3"},
            ]
        },
        {"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2", "reasoning": "w4"}]},
        {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    convs = load_conversations(str(path))
    assert [c["messages"][1].get("reasoning_content") for c in convs] == ["w3", "w4", None]
    assert convs[2]["messages"][1] == {"role": "assistant", "content": "w2"}  # no trace: the message as before
