"""``SpeculativeModel.generate`` called as a ``transformers`` user calls ``generate``: the settings a call leaves unset
come from the target's generation config as ``target.generate`` takes them (the processed distribution equals the one
transformers' own processors build), ``input_ids`` / ``attention_mask`` batches padded on either side,
``generation_config=``, ``max_length=``, ``return_dict_in_generate`` and a ``ValueError`` for ids outside the
vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList

import selfspec
import selfspec.api as api
from selfspec.decode.sampling import build_logits_processor
from tests.helpers.archs import tiny_llama
from tests.helpers.decoding import V, prompts, reference


@pytest.fixture
def sampling_target():
    """A tiny target whose generation config sets temperature and top_p and leaves top_k unset (generate: 50)."""
    target = tiny_llama(seed=3)
    target.generation_config.temperature = 0.7
    target.generation_config.top_p = 0.9
    return target


def request_of(model, monkeypatch, **kwargs):
    """The :class:`~selfspec.decode.request.GenerationRequest` ``model.generate(**kwargs)`` hands the decode loop."""
    seen = {}

    def loop(verifier, drafters, ids, request, **_):
        seen["request"] = request
        return [api.GenerationOutput(tokens=[1], stats=None) for _ in ids]

    monkeypatch.setattr(api, "decode_rows", loop)
    model.generate(**kwargs)
    return seen["request"]


CALLS = [
    dict(do_sample=True),
    dict(do_sample=True, temperature=1.3),
    dict(do_sample=True, top_k=0, repetition_penalty=1.2),
    dict(generation_config=GenerationConfig(do_sample=True, top_k=5, min_p=0.05)),
    dict(generation_config=GenerationConfig(do_sample=True, top_p=0.5), temperature=0.4),
    dict(),  # greedy: the target's config does not ask for sampling
]


@pytest.mark.parametrize("call", CALLS, ids=[str(sorted(c)) + str(i) for i, c in enumerate(CALLS)])
def test_the_same_call_processes_logits_as_transformers_generate(call, sampling_target, monkeypatch):
    target = sampling_target
    model = selfspec.load(target, prompt_lookup=True, tune="off")
    ids = torch.tensor([[5, 17, 23, 42, 8, 17, 23]])
    ours = build_logits_processor(request_of(model, monkeypatch, input_ids=ids, max_new_tokens=4, **call).sampling)
    # transformers' own resolution of the same call and the processors generate builds from it
    kwargs = {k: v for k, v in call.items() if k != "generation_config"}
    config, _ = target._prepare_generation_config(call.get("generation_config"), **kwargs)
    theirs = target._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=ids.shape[1],
        encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device="cpu",
        model_kwargs={},
    )
    logits = target(ids).logits[:, -1].float()
    scores = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3
    for raw in (logits, scores):
        context = ids.expand(raw.shape[0], -1)
        assert torch.equal(ours(context, raw.clone()), theirs(context, raw.clone()))
    assert config.do_sample is bool(call.get("do_sample") or call.get("generation_config"))


def test_top_k_defaults_to_generates_50_and_the_rest_to_the_targets_config(sampling_target, monkeypatch):
    model = selfspec.load(sampling_target, prompt_lookup=True, tune="off")
    sampling = request_of(model, monkeypatch, prompt=[5, 17, 23], do_sample=True).sampling
    assert (sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p) == (True, 0.7, 50, 0.9)
    config = GenerationConfig(do_sample=True, top_k=3, temperature=0.5)
    sampling = request_of(model, monkeypatch, prompt=[5, 17, 23], generation_config=config, top_p=0.8).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.5, 3, 0.8)


def test_the_targets_generation_config_reaches_decoding(monkeypatch):
    """End to end: a target whose config samples with top_k 1 decodes as greedy under ``do_sample=True`` (with top-k
    off, as before, these seeds sample other tokens)."""
    target = tiny_llama(seed=5)
    model = selfspec.load(target, prompt_lookup=True, tune="off")
    ids = prompts(1, length=6, seed=2)[0]
    greedy = reference(target, ids, 12)
    target.generation_config.top_k = 1
    assert [model.generate(ids, 12, do_sample=True, seed=s).tokens for s in range(3)] == [greedy] * 3
    assert any(model.generate(ids, 12, do_sample=True, top_k=0, seed=s).tokens != greedy for s in range(3))


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_input_ids_batch_decodes_each_prompt_as_alone(side, tiny_target):
    model = selfspec.load(tiny_target, prompt_lookup=True, tune="off")
    rows = [prompts(1, length=n, seed=n)[0] for n in (5, 8, 3)]
    width = max(r.numel() for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        span = slice(width - row.numel(), width) if side == "left" else slice(0, row.numel())
        input_ids[i, span], mask[i, span] = row, 1
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True)
    wanted = [reference(tiny_target, row, 6) for row in rows]
    assert [o.tokens for o in out.outputs] == wanted
    assert out.sequences.dtype == torch.long and out.prompt_length == width
    assert torch.equal(out.sequences, torch.cat([input_ids, torch.tensor(wanted)], dim=1))
    # max_length counts the padded prompt, as in generate
    short = model.generate(input_ids=input_ids, attention_mask=mask, max_length=width + 2)
    assert [o.tokens for o in short] == [w[:2] for w in wanted]


def test_generation_config_lengths_and_a_single_row(tiny_target):
    model = selfspec.load(tiny_target, prompt_lookup=True, tune="off")
    ids = prompts(1, length=7, seed=4)[0]
    wanted = reference(tiny_target, ids, 5)
    assert model.generate(input_ids=ids[None], generation_config=GenerationConfig(max_new_tokens=5)).tokens == wanted
    assert model.generate(ids, max_length=10).tokens == wanted[:3]
    out = model.generate(ids.tolist(), 5, return_dict_in_generate=True)
    assert torch.equal(out.sequences, torch.cat([ids, torch.tensor(wanted)])[None]) and out.prompt_length == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=[5, V, 7]), rf"prompt 0 holds token id {V}, outside the target's vocabulary \[0, {V}\)"),
        (dict(prompt=[[5, 6], [7, -1]]), rf"prompt 1 holds token id -1, outside the target's vocabulary \[0, {V}\)"),
        (dict(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 0, 1]])), "one run of prompt"),
        (dict(prompt=[5, 6], input_ids=torch.tensor([[5, 6]])), "one of the two"),
        (dict(prompt="hi", attention_mask=torch.tensor([1, 1])), "attention_mask goes with a tensor of ids"),
        (dict(prompt=[5, 6, 7], max_length=3), r"max_length=3 leaves no room after the prompt's 3 tokens"),
    ],
)
def test_wrong_inputs_raise_value_error(kwargs, message, tiny_target):
    model = selfspec.load(tiny_target, prompt_lookup=True, tune="off")
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs)
