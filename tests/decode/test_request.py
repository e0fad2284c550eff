"""The call's settings and inputs (``decode/request.py``, checked once per call): wrong inputs get an error that says
what is wrong, and change nothing: a later good call gives the same output as before."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.decode.drafters import DraftModelDrafter, PromptLookupDrafter
from selfspec.decode.loop import speculative_generate, speculative_generate_batch
from selfspec.decode.request import GenerationRequest
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.step import NonFiniteLogitsError
from tests.helpers.archs import tiny_llama
from tests.helpers.decoding import TREES
from tests.helpers.heads import random_heads
from tests.helpers.tokenizers import byte_level_tokenizer

PROMPT = [5, 17, 23, 42, 8, 61]


@pytest.fixture(scope="module")
def model(tiny_target):
    return selfspec.load(tiny_target, prompt_lookup=True, tune="off")


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "the prompt is empty"),
        (torch.tensor([], dtype=torch.long), {}, "the prompt is empty"),
        (torch.arange(3, 600) % 90 + 3, {}, r"597 tokens, which leaves no room .* context of 512 positions"),
        (PROMPT, dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
        (PROMPT, dict(max_new_tokens=-3), r"max_new_tokens must be an int >= 1, got -3"),
        (PROMPT, dict(max_new_tokens=2.5), r"max_new_tokens must be an int >= 1, got 2.5"),
        (PROMPT, dict(min_new_tokens=-1), r"min_new_tokens must be an int >= 0"),
        (PROMPT, dict(do_sample=True, temperature=0.0), r"temperature must be > 0, got 0.0; .*do_sample=False"),
        (PROMPT, dict(do_sample=True, temperature=-0.5), r"temperature must be > 0, got -0.5"),
        (PROMPT, dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (PROMPT, dict(do_sample=True, top_p=1.2), r"top_p must be in \(0, 1\], got 1.2"),
        (PROMPT, dict(do_sample=True, top_k=-1), r"top_k must be an int >= 0, got -1"),
        (PROMPT, dict(do_sample=True, min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1"),
        (PROMPT, dict(do_sample=True, min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
        (torch.tensor([[PROMPT, PROMPT]]), {}, r"input ids of shape \(1, 2, 6\): pass \[T\], \[1, T\], \[B, T\]"),
        ([PROMPT, PROMPT], dict(streamer=lambda ids: None), "a batch streams through one streamer per prompt"),
        ([PROMPT, PROMPT], dict(batch_tree="big"), "batch_tree must be 'auto' or 'fixed'"),
        (PROMPT, dict(streamer=42), "streamer must be a transformers BaseStreamer"),
    ],
)
def test_wrong_input_is_refused_with_a_message_and_changes_nothing(model, prompt, kwargs, message):
    before = model.generate(PROMPT, max_new_tokens=12).tokens
    with pytest.raises(ValueError, match=message):
        model.generate(prompt, **{"max_new_tokens": 5, **kwargs})
    assert model.generate(PROMPT, max_new_tokens=12).tokens == before


def test_empty_text_prompt_is_refused_and_stream_raises_the_generation_error():
    tok = byte_level_tokenizer()
    model = selfspec.load(tiny_llama(vocab_size=len(tok)), tokenizer=tok, prompt_lookup=True, tune="off")
    with pytest.raises(ValueError, match="the prompt is empty"):
        model.generate("", max_new_tokens=3)
    with pytest.raises(ValueError, match="the prompt is empty"):
        list(model.stream("", max_new_tokens=3))
    model.target.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="logits hold NaN at the prefill"):
        list(model.stream("hello", max_new_tokens=3))


def test_unknown_generation_setting_is_a_value_error_that_lists_the_valid_names(tiny_target):
    """A misspelt keyword of speculative_generate (a GenerationRequest field) names the valid fields, and a
    sampling option passed on its own is pointed to SamplingConfig; nothing is decoded. The valid names still
    pass, eos_token_id as generate's name for eos_ids."""
    ids = torch.tensor(PROMPT)
    with pytest.raises(ValueError, match=r"unknown generation settings \['max_tokens'\]: rename or drop them") as err:
        speculative_generate(tiny_target, PromptLookupDrafter(), ids, max_tokens=5)
    for name in ("max_new_tokens", "min_new_tokens", "sampling", "eos_ids", "eos_token_id", "acceptance"):
        assert repr(name) in str(err.value)
    assert "SamplingConfig" not in str(err.value)
    with pytest.raises(ValueError, match=r"sampling options \(do_sample, temperature\) go in sampling=SamplingConfig"):
        speculative_generate_batch(tiny_target, PromptLookupDrafter(), [ids], temperature=0.7, do_sample=True)
    request = GenerationRequest.from_settings({"max_new_tokens": 3, "eos_token_id": 2, "sampling": None})
    assert (request.max_new_tokens, request.eos_ids, request.sampling) == (3, (2,), SamplingConfig())


def test_token_ids_given_as_0d_tensors_are_one_prompt(model):
    assert (
        model.generate([torch.tensor(t) for t in PROMPT], max_new_tokens=4).tokens
        == model.generate(PROMPT, max_new_tokens=4).tokens
    )


def test_heads_of_another_dtype_are_cast_to_the_target_at_load(tiny_target):
    heads = random_heads(tiny_target).double()
    model = selfspec.load(tiny_target, heads=heads, tree=TREES[2], tune="off")
    assert next(model.drafter.heads.parameters()).dtype == torch.float32
    ids = torch.tensor(PROMPT)
    ref = tiny_target.generate(ids[None], max_new_tokens=15, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    assert model.generate(ids, max_new_tokens=15).tokens == ref


def test_draft_model_on_another_device_is_refused(tiny_target):
    with torch.device("meta"):
        draft = tiny_llama(seed=3)
    with pytest.raises(ValueError, match="the draft model is on meta, the target on cpu"):
        speculative_generate(tiny_target, DraftModelDrafter(draft), torch.tensor(PROMPT), max_new_tokens=4)
