"""Near the target's ``max_position_embeddings`` the tree shrinks (no position past the context), then
decoding is plain; output equals plain decoding up to the context limit; a prompt leaving no room is refused."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.drafters import DraftModelDrafter, MedusaDrafter, PromptLookupDrafter
from selfspec.decode.loop import speculative_generate
from selfspec.decode.tree import static_tree, tree_depths
from selfspec.decode.verifier import Verifier
from tests.helpers.archs import tiny_llama
from tests.helpers.decoding import TREES
from tests.helpers.heads import random_heads

CONTEXT = 64


@pytest.fixture(scope="module")
def short_target():
    model = tiny_llama(seed=5)
    model.config.max_position_embeddings = CONTEXT  # Llama's default rotary embedding does not depend on it
    return model


class PositionRecorder(Verifier):
    """Records the largest position id each tree forward uses."""

    def __init__(self, target) -> None:
        super().__init__(target)
        self.max_positions: list[int] = []

    def forward_tree(self, tokens, parents, cache, past_length, layers=None, host=None):
        self.max_positions.append(past_length + int(tree_depths(parents.cpu()).max()))
        return super().forward_tree(tokens, parents, cache, past_length, layers=layers, host=host)


def _plain(model, ids, n):
    return model.generate(ids[None], max_new_tokens=n, do_sample=False, pad_token_id=0)[0, ids.numel() :].tolist()


def _prompt(length: int, seed: int) -> torch.Tensor:
    base = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(seed))
    return base.repeat(length // 12 + 1)[:length]  # repetitive: prompt lookup drafts long chains


def _drafters(target):
    return {
        "prompt_lookup": lambda: PromptLookupDrafter(num_tokens=8),
        "medusa": lambda: MedusaDrafter(random_heads(target), static_tree(TREES[2])),
        "target_as_draft": lambda: DraftModelDrafter(target, num_tokens=6),  # every draft accepted
    }


@pytest.mark.parametrize("name", ["prompt_lookup", "medusa", "target_as_draft"])
@pytest.mark.parametrize("prompt_len", [CONTEXT - 3, CONTEXT - 1, CONTEXT - 20])
def test_decoding_up_to_the_context_limit_equals_plain_decoding(short_target, name, prompt_len):
    for seed in range(2):
        ids = _prompt(prompt_len, seed)
        verifier = PositionRecorder(short_target)
        out = speculative_generate(verifier, _drafters(short_target)[name](), ids, max_new_tokens=500)
        assert out.tokens == _plain(short_target, ids, CONTEXT - prompt_len)
        assert out.stats.finish_reason == "length" and prompt_len + len(out.tokens) == CONTEXT
        assert max(verifier.max_positions, default=0) <= CONTEXT - 2  # the last token is never fed
        if name == "target_as_draft" and prompt_len == CONTEXT - 20:
            # full chains of 6 until the context runs short, then shorter ones
            assert out.stats.accepted_per_step[0] == 7 and out.stats.accepted_per_step[-1] < 7


def test_sampling_near_the_context_limit_completes(short_target):
    from selfspec.decode.sampling import SamplingConfig

    ids = _prompt(CONTEXT - 3, 1)
    for drafter in (PromptLookupDrafter(), MedusaDrafter(random_heads(short_target), static_tree(TREES[2]))):
        out = speculative_generate(
            short_target,
            drafter,
            ids,
            max_new_tokens=50,
            sampling=SamplingConfig(do_sample=True),
            generator=torch.Generator().manual_seed(0),
        )
        assert len(out.tokens) == 3


@pytest.mark.parametrize("prompt_len", [CONTEXT - 3, CONTEXT - 24])
def test_eagle_trees_shrink_at_the_context_limit_and_stay_exact(prompt_len):
    from selfspec.decode.drafters.eagle import EagleDrafter
    from tests.helpers.heads import build_oracle

    target, head = build_oracle()  # a head that nearly reproduces its target: deep accepted paths
    target.config.max_position_embeddings = CONTEXT
    for seed in range(2):
        ids = torch.randint(3, 96, (prompt_len,), generator=torch.Generator().manual_seed(seed))
        verifier = PositionRecorder(target)
        out = speculative_generate(verifier, EagleDrafter(head, target, 5, 4, 16), ids, max_new_tokens=500)
        assert out.tokens == _plain(target, ids, CONTEXT - prompt_len)
        assert prompt_len + len(out.tokens) == CONTEXT and max(verifier.max_positions) <= CONTEXT - 2
        if prompt_len == CONTEXT - 24:
            assert out.stats.mean_accepted_tokens > 1.5  # drafts were accepted on the way to the limit


@pytest.mark.parametrize("prompt_len", [CONTEXT, CONTEXT + 5])
def test_prompt_that_leaves_no_room_is_refused(short_target, prompt_len):
    ids = _prompt(prompt_len, 0)
    with pytest.raises(
        ValueError,
        match=rf"prompt has {prompt_len} tokens, which leaves no room .* context of 64 "
        r"positions \(max_position_embeddings\); shorten the prompt to at most 63",
    ):
        speculative_generate(short_target, PromptLookupDrafter(), ids, max_new_tokens=5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["prompt_lookup", "medusa"])
def test_smollm2_at_a_declared_context_limit_equals_plain_decoding(smollm2, method):
    """The real SmolLM2 weights with their context declared as 512 positions (restored afterwards): a prompt
    of 509 tokens completes with the 3 tokens plain decoding gives."""
    import selfspec
    from tests.helpers.smollm2 import fresh_heads

    model, tok = smollm2
    text = "The capital of France is Paris. The capital of Italy is Rome. " * 60
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:509])
    kwargs = {"heads": fresh_heads(model)} if method == "medusa" else {"prompt_lookup": True}
    spec = selfspec.load(model, tokenizer=tok, tune="off", **kwargs)
    saved = model.config.max_position_embeddings
    model.config.max_position_embeddings = 512
    try:
        out = spec.generate(ids, max_new_tokens=100, eos_token_id=[])
    finally:
        model.config.max_position_embeddings = saved
    ref = model.generate(
        ids[None],
        attention_mask=torch.ones_like(ids)[None],
        max_new_tokens=3,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )[0, 509:].tolist()
    assert out.tokens == ref and out.stats.finish_reason == "length"
