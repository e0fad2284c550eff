"""decode/sampling.py: processed logits must be the very bits plain `generate` samples from."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from selfspec.decode.sampling import (
    SamplingConfig,
    build_logits_processor,
    greedy,
    probs_from_logits,
    process_logits,
    sample,
)

V = 64

CONFIGS = [
    dict(do_sample=False),
    dict(do_sample=False, repetition_penalty=1.3),
    dict(do_sample=True),
    dict(do_sample=True, temperature=0.7),
    dict(do_sample=True, temperature=1.3, top_k=7),
    dict(do_sample=True, top_p=0.8),
    dict(do_sample=True, min_p=0.1),
    dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    dict(do_sample=True, temperature=2.0, top_k=3, repetition_penalty=0.8),
]


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharpen the logits so top-k/top-p/min-p really cut
        model.lm_head.weight.mul_(40.0)
    return model


def _generation_config(**kwargs) -> GenerationConfig:
    # GenerationConfig defaults top_k to 50; SamplingConfig to 0 (off). Make the two agree.
    kwargs.setdefault("top_k", 0)
    return GenerationConfig(**kwargs)


def _hf_processors(model, kwargs, user=None) -> LogitsProcessorList:
    return model._get_logits_processor(
        generation_config=_generation_config(**kwargs),
        input_ids_seq_length=5,
        logits_processor=LogitsProcessorList(user or []),
    )


def _random_inputs(seed: int, n: int = 6, t: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 4.0
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1.0  # an exact tie
    contexts = torch.randint(0, V, (n, t), generator=g)
    return logits, contexts


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_bit_identical_to_get_logits_processor(tiny_model, kwargs):
    """Same bits as the list GenerationMixin._get_logits_processor builds for the same settings."""
    logits, contexts = _random_inputs(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _hf_processors(tiny_model, kwargs)(contexts, logits.clone())
    ours = process_logits(logits, contexts, SamplingConfig(**kwargs))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, expected)
    if kwargs["do_sample"] and (kwargs.get("top_k") or kwargs.get("top_p", 1) < 1 or kwargs.get("min_p")):
        assert torch.isinf(ours).any(), "the warpers should have removed tokens"


def test_order_matches_generate(tiny_model):
    """The processor classes and their order, and the user's processor placement/replacement."""
    kwargs = dict(do_sample=True, temperature=0.5, top_k=10, top_p=0.9, min_p=0.1, repetition_penalty=1.1)
    bad = NoBadWordsLogitsProcessor([[4]])
    ours = build_logits_processor(SamplingConfig(**kwargs), [bad])
    hf = _hf_processors(tiny_model, kwargs, [bad])
    assert [type(x) for x in ours] == [type(x) for x in hf]
    assert ours[1] is bad
    custom_penalty = RepetitionPenaltyLogitsProcessor(2.0)  # same class as a built-in: takes its place
    ours = build_logits_processor(SamplingConfig(**kwargs), [custom_penalty])
    hf = _hf_processors(tiny_model, kwargs, [custom_penalty])
    assert ours[0] is custom_penalty and hf[0] is custom_penalty
    assert [type(x) for x in ours] == [type(x) for x in hf]


@pytest.mark.parametrize(
    "generation_config",
    [
        _generation_config(**CONFIGS[1]),
        _generation_config(**CONFIGS[7]),
        _generation_config(**CONFIGS[8]),
        GenerationConfig(do_sample=True, temperature=0.9),  # top_k unset: generate falls back to 50
    ],
)
def test_matches_generate_scores(tiny_model, generation_config):
    """Replays a real `generate` run: process_logits(raw logits of step t, sequence so far) == its scores[t]."""
    prompt = torch.tensor([[1, 7, 7, 12, 30]])
    torch.manual_seed(3)
    out = tiny_model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        generation_config=generation_config,
        max_new_tokens=8,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    config = SamplingConfig.from_generation_config(generation_config)
    for t, (raw, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        context = out.sequences[:, : prompt.shape[1] + t]
        assert torch.equal(process_logits(raw, context, config), scores), f"step {t}"
        if not config.do_sample:
            assert int(greedy(scores)[0]) == int(out.sequences[0, prompt.shape[1] + t])


def test_rows_are_independent():
    """Processing tree nodes together (one call per depth) equals processing each alone, bit for bit."""
    logits, contexts = _random_inputs(2, n=8)
    config = SamplingConfig(**CONFIGS[7])
    together = process_logits(logits, contexts, config)
    alone = torch.cat([process_logits(logits[i : i + 1], contexts[i : i + 1], config) for i in range(8)])
    assert torch.equal(together, alone)


def test_banned_tokens_get_probability_zero():
    logits, contexts = _random_inputs(3, n=2, t=4)
    contexts[0, -1], contexts[1, -1] = 2, 3
    user = [
        NoBadWordsLogitsProcessor([[11], [13]]),
        SequenceBiasLogitsProcessor([[[2, 9], -math.inf]]),  # bans 9 only right after 2
    ]
    for config in (SamplingConfig(), SamplingConfig(do_sample=True, temperature=0.7, top_p=0.95)):
        probs = probs_from_logits(process_logits(logits, contexts, config, user))
        assert probs[:, 11].eq(0).all() and probs[:, 13].eq(0).all()
        assert probs[0, 9] == 0
        assert torch.allclose(probs.sum(-1), torch.ones(2))
        if not config.do_sample:  # no warper: the bias is context dependent, row 1 does not end with 2
            assert probs[1, 9] > 0
    logits[:, 11] = 1e4  # even the argmax is banned
    assert (greedy(process_logits(logits, contexts, SamplingConfig(), user)) != 11).all()


def test_input_untouched_and_float32_out():
    logits, contexts = _random_inputs(4)
    half = logits.to(torch.bfloat16)
    before = half.clone()
    out = process_logits(half, contexts, SamplingConfig(do_sample=True, temperature=0.5, repetition_penalty=1.5))
    assert out.dtype == torch.float32 and torch.equal(half, before)
    warped = SamplingConfig(do_sample=True, temperature=0.5, top_k=9, top_p=0.9, min_p=0.1)
    assert torch.equal(process_logits(logits, None, warped), process_logits(logits, contexts, warped))
    plain = process_logits(logits, None, SamplingConfig())  # nothing needs the context
    assert torch.equal(plain, logits) and plain.data_ptr() != logits.data_ptr()


def test_process_logits_errors():
    logits, contexts = _random_inputs(5)
    with pytest.raises(ValueError, match="contexts"):
        process_logits(logits, None, SamplingConfig(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="contexts"):
        process_logits(logits, None, SamplingConfig(), [NoBadWordsLogitsProcessor([[3]])])
    with pytest.raises(ValueError, match=r"contexts must be .*\[N, T\]"):
        process_logits(logits, contexts[:2], SamplingConfig(repetition_penalty=1.2))
    with pytest.raises(ValueError, match=r"logits must be .*\[N, V\]"):
        process_logits(logits[0], contexts, SamplingConfig())
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sample(torch.ones(V))


def test_probs_and_sample():
    processed = torch.tensor([[0.0, -math.inf, math.log(3.0)], [-math.inf, -math.inf, 5.0]])
    probs = probs_from_logits(processed)
    assert torch.allclose(probs, torch.tensor([[0.25, 0.0, 0.75], [0.0, 0.0, 1.0]]))
    assert probs[0, 1] == 0
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    drawn = sample(probs, g1)
    assert drawn.dtype == torch.long and drawn.shape == (2,)
    assert torch.equal(drawn, torch.multinomial(probs, 1, generator=g2).squeeze(1))
    assert int(drawn[1]) == 2 and int(drawn[0]) != 1
    assert torch.equal(greedy(torch.tensor([[1.0, 3.0, 3.0, 0.0]])), torch.tensor([1]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=0.0), "do_sample=False"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=math.nan), "finite"),
        (dict(top_k=-1), "pass 0 to turn top-k off"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "pass 1.0"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), "pass 0.0"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "pass 1.0 for no penalty"),
        (dict(do_sample="yes"), "pass True or False"),
        (dict(temperature="hot"), "temperature"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_config_coerces_ints_and_is_frozen():
    config = SamplingConfig(do_sample=True, temperature=2, repetition_penalty=1)
    assert config.temperature == 2.0 and isinstance(config.temperature, float)
    assert isinstance(build_logits_processor(config)[0], TemperatureLogitsWarper)
    with pytest.raises(AttributeError):
        config.top_k = 3  # type: ignore[misc]


def test_from_generation_config():
    config = SamplingConfig.from_generation_config(GenerationConfig(do_sample=True, temperature=0.7))
    assert config == SamplingConfig(do_sample=True, temperature=0.7, top_k=50)  # generate's default top-k
    assert SamplingConfig.from_generation_config(GenerationConfig()) == SamplingConfig(top_k=50)
    explicit = GenerationConfig(do_sample=True, top_k=0, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    assert SamplingConfig.from_generation_config(explicit) == SamplingConfig(
        do_sample=True, top_p=0.9, min_p=0.05, repetition_penalty=1.2
    )
    with pytest.raises(ValueError, match="bad_words_ids"):
        SamplingConfig.from_generation_config(GenerationConfig(bad_words_ids=[[3]]))
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        SamplingConfig.from_generation_config(GenerationConfig(no_repeat_ngram_size=2))
