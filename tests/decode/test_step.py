"""Logits that leave no token to choose (``decode/step.py``): NaN at the prefill or at a later verification step
stops the call with an error that names the step, while logits that rule out only some tokens decode as
``generate`` does."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.decode.drafters import Drafter, DrafterInfo, DraftTree, PromptLookupDrafter
from selfspec.decode.loop import speculative_generate
from selfspec.decode.step import NonFiniteLogitsError
from tests.helpers.archs import tiny_llama

PROMPT = [5, 17, 23, 42, 8, 61]


class RootOnly(Drafter):
    """Proposes nothing: every step is one plain decoding step (step k feeds output token k - 1)."""

    def info(self):
        return DrafterInfo(name="root_only", max_depth=0)

    def propose(self, context, sampling, generator, limit):
        return DraftTree(tokens=context[-1:], parents=torch.tensor([-1]))


def test_nan_in_the_lm_head_stops_at_the_prefill():
    target = tiny_llama(seed=7)
    target.lm_head.weight[3, 5] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=r"logits hold NaN at the prefill \(step 0\)"):
        speculative_generate(target, PromptLookupDrafter(), torch.tensor(PROMPT), max_new_tokens=5)
    model = selfspec.load(target, prompt_lookup=True, tune="off")
    with pytest.raises(RuntimeError, match="NaN at the prefill"):
        model.generate(PROMPT, max_new_tokens=5)


def test_logits_ruling_out_some_tokens_pass_but_not_all():
    target = tiny_llama(seed=7)
    target.lm_head.bias = torch.nn.Parameter(torch.zeros(96), requires_grad=False)
    target.lm_head.bias[10:20] = float("-inf")  # tokens the model rules out: generate samples around them
    ids = torch.tensor(PROMPT)
    ref = target.generate(ids[None], max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    assert speculative_generate(target, PromptLookupDrafter(), ids, max_new_tokens=8).tokens == ref
    target.lm_head.bias[:] = float("-inf")
    with pytest.raises(NonFiniteLogitsError, match=r"-inf for every token at the prefill"):
        speculative_generate(target, PromptLookupDrafter(), torch.tensor(PROMPT), max_new_tokens=8)


def test_nan_reached_later_names_the_step():
    target = tiny_llama(seed=7)
    ref = speculative_generate(target, RootOnly(), torch.tensor(PROMPT), max_new_tokens=6).tokens
    bad = next(i for i in range(1, 6) if ref[i] not in PROMPT + ref[:i])
    target.model.embed_tokens.weight[ref[bad]] = float("inf")  # the token's embedding: logits after it are NaN
    with pytest.raises(NonFiniteLogitsError, match=rf"at verification step {bad + 1}: no token can be chosen"):
        speculative_generate(target, RootOnly(), torch.tensor(PROMPT), max_new_tokens=6)
