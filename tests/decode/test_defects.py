"""Four decoding defects, each pinned by the input that showed it.

1. ``min_new_tokens`` under sampling: EOS is banned *before* the warpers, as ``generate`` orders its
   processors (``MinNewTokensLengthLogitsProcessor`` ahead of temperature / top-k / top-p / min-p).
2. A draft model whose vocabulary differs from the target's is refused at load (never an out-of-range id),
   unless both use one tokenizer and only the embeddings are padded: ``draft_shared_vocab`` maps ids exactly.
3. A draft model with absolute positions and a shorter context than the target's (GPT-2, small
   ``n_positions``) drafts only inside its context; output stays exact.
4. A ``[2, T]`` prompt is decoded as a batch of two rows (a ``[B, T, ...]`` one is refused), never flattened.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

import selfspec
from selfspec.decode.drafters import DraftModelDrafter, DraftTree, PromptLookupDrafter
from selfspec.decode.host import read_tree
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.step import target_distributions
from tests.helpers.archs import tiny_llama

V = 96

WARPERS = [
    dict(top_k=2),
    dict(top_p=0.6),
    dict(min_p=0.3),
    dict(temperature=0.5),
    dict(temperature=1.7, top_k=3, top_p=0.9, min_p=0.05),
]


def _hf_processors(model, prompt_len: int, min_new_tokens: int, eos: list[int], warpers: dict):
    """The processor list ``generate`` itself builds for these settings (transformers' own code)."""
    warpers = {"top_k": 0, **warpers}
    config = GenerationConfig(do_sample=True, min_new_tokens=min_new_tokens, eos_token_id=eos, **warpers)
    model._prepare_special_tokens(config, device="cpu")
    return model._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_len, logits_processor=None)


@pytest.mark.parametrize("warpers", WARPERS)
def test_min_new_tokens_bans_eos_before_the_warpers_hand_built(tiny_target, warpers):
    # A chain root -> 1 -> 2 -> 3 after a 5-token prompt with 1 token already generated: rows at depth d
    # have generated 1 + d tokens, so with min_new_tokens = 3 rows 0-1 ban EOS and rows 2-3 do not.
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, V, (5,), generator=g)
    context = torch.cat([prompt, torch.tensor([7])])  # decided tokens, ending with the root
    tree = DraftTree(tokens=torch.tensor([7, 11, 12, 13]), parents=torch.tensor([-1, 0, 1, 2]))
    logits = torch.randn(4, V, generator=g) * 3.0
    eos = [5, 9]
    logits[:, 5] = logits.max() + 2.0  # EOS is the most likely token everywhere: top-k / top-p keep it first
    logits[:, 9] = logits.max() + 1.0
    sampling = SamplingConfig(do_sample=True, **warpers)
    got = target_distributions(logits, context, read_tree(tree.tokens, tree.parents), sampling, None, 1, 3, eos)
    hf = _hf_processors(tiny_target, prompt.numel(), 3, eos, warpers)
    for d in range(4):
        node_ctx = torch.cat([context, tree.tokens[1 : d + 1]])[None]
        want = hf(node_ctx, logits[d : d + 1].clone())
        assert torch.equal(got[d : d + 1], want), (warpers, d)
    assert torch.isinf(got[:2, eos]).all() and torch.isfinite(got[2:, 9]).all()  # 9, the favourite, survives


def _first_token_counts(draw, n: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for s in range(n):
        t = draw(s)
        counts[t] = counts.get(t, 0) + 1
    return counts


@pytest.mark.slow  # over 5 s: the whole suite runs it
def test_min_new_tokens_first_token_distribution_matches_generate(tiny_target):
    """Seeded, statistical: 400 draws each from ``generate`` and from the speculative loop; for each token
    of the exact distribution, ``|freq - p| <= 4.5 sqrt(p (1 - p) / n)`` (a false failure about 1e-5)."""
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(0))
    logits = tiny_target(ids[None]).logits[0, -1]
    eos = int(logits.argmax())  # EOS is the favourite: banning it first changes what top-k 2 keeps
    hf = _hf_processors(tiny_target, ids.numel(), 2, [eos], dict(top_k=2))
    p = torch.softmax(hf(ids[None], logits[None].clone()), -1)[0]
    support = p.nonzero().flatten().tolist()
    assert len(support) == 2 and eos not in support and min(p[support]) > 0.3  # the test has power

    def hf_draw(s: int) -> int:
        torch.manual_seed(s)
        out = tiny_target.generate(
            ids[None], max_new_tokens=1, do_sample=True, top_k=2, min_new_tokens=2, eos_token_id=eos, pad_token_id=0
        )
        return int(out[0, -1])

    def ours(s: int) -> int:
        out = speculative_generate(
            tiny_target,
            PromptLookupDrafter(),
            ids,
            max_new_tokens=2,
            min_new_tokens=2,
            eos_token_id=eos,
            sampling=SamplingConfig(do_sample=True, top_k=2),
            generator=torch.Generator().manual_seed(s),
        )
        return out.tokens[0]

    n = 400
    for counts in (_first_token_counts(hf_draw, n), _first_token_counts(ours, n)):
        assert set(counts) <= set(support)
        for t in support:
            pt = float(p[t])
            assert abs(counts.get(t, 0) / n - pt) <= 4.5 * math.sqrt(pt * (1 - pt) / n), (counts, p[support])


def test_draft_model_with_another_vocabulary_is_refused_at_load(tiny_target):
    small = tiny_llama(vocab_size=64, seed=3)
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(64 .*\) differs from the target's \(96"):
        selfspec.load(tiny_target, draft_model=small, tune="off")
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(tiny_target, DraftModelDrafter(small), torch.arange(3, 9), max_new_tokens=4)
    large = tiny_llama(vocab_size=128, seed=3)
    with pytest.raises(ValueError, match=r"\(128 .*\) differs from the target's \(96"):
        selfspec.load(tiny_target, draft_model=large, tune="off")


def _tiny_gpt2(n_positions: int) -> GPT2LMHeadModel:
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=V, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=None
    )
    return GPT2LMHeadModel(config).eval().requires_grad_(False)


@pytest.mark.parametrize("do_sample", [False, True])
def test_draft_model_with_a_short_absolute_context_drafts_inside_it(tiny_target, do_sample):
    draft = _tiny_gpt2(n_positions=24)
    ids = torch.randint(3, V, (14,), generator=torch.Generator().manual_seed(4))
    sampling = SamplingConfig(do_sample=do_sample)
    out = speculative_generate(
        tiny_target,
        DraftModelDrafter(draft, num_tokens=4),
        ids,
        max_new_tokens=30,
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(out.tokens) == 30
    if not do_sample:
        ref = tiny_target.generate(ids[None], max_new_tokens=30, do_sample=False, pad_token_id=0)[0, 14:].tolist()
        assert out.tokens == ref
    # once the context passes the draft's 24 positions, steps are plain decoding (one token each)
    assert out.stats.accepted_per_step[-5:] == [1] * 5


def test_short_context_draft_proposes_its_own_greedy_continuation(tiny_target):
    """The GPT-2 draft's cache (cropped by position each step) is right: each chain is what the draft model
    itself continues the context with, shorter as its context runs out, none past it."""
    draft = _tiny_gpt2(n_positions=24)
    drafter = DraftModelDrafter(draft, num_tokens=4)
    chains: list[tuple[int, list[int]]] = []
    propose = drafter.propose

    def recording(context, sampling, generator, limit):
        tree = propose(context, sampling, generator, limit)
        chains.append((context.numel(), tree.tokens[1:].tolist()))
        alone = context.clone()  # the draft model's greedy continuation, each token from a full forward
        for _ in range(tree.tokens.numel() - 1):
            alone = torch.cat([alone, draft(alone[None]).logits[0, -1].argmax()[None]])
        assert tree.tokens[1:].tolist() == alone[context.numel() :].tolist()
        return tree

    drafter.propose = recording
    ids = torch.randint(3, V, (14,), generator=torch.Generator().manual_seed(4))
    speculative_generate(tiny_target, drafter, ids, max_new_tokens=16)
    for length, chain in chains:
        assert len(chain) == max(0, min(4, 24 - length + 1))


def test_draft_model_drafts_no_more_than_the_tokens_still_allowed(tiny_target):
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(6))
    drafter = DraftModelDrafter(tiny_target, num_tokens=7)
    seen: list[int] = []
    out = speculative_generate(
        tiny_target,
        drafter,
        ids,
        max_new_tokens=5,
        step_callback=lambda row, tree, result: seen.append(tree.tokens.numel()),
    )
    # after the first token 4 may still come: root + 3 drafts, all accepted, plus the bonus token
    assert len(out.tokens) == 5 and seen == [4]
    seen.clear()
    loop = torch.arange(3, 15).repeat(3)  # prompt lookup matches and would propose 8 tokens
    speculative_generate(
        tiny_target,
        PromptLookupDrafter(num_tokens=8),
        loop,
        max_new_tokens=3,
        step_callback=lambda row, tree, result: seen.append(tree.tokens.numel()),
    )
    assert seen and max(seen) <= 2  # after the first token 2 may come: root + at most 1 draft


def test_batch_shaped_prompt_is_decoded_as_a_batch_never_flattened(tiny_target):
    model = selfspec.load(tiny_target, prompt_lookup=True, tune="off")
    prompt = torch.arange(3, 13).reshape(2, 5)
    rows = model.generate(prompt, max_new_tokens=3)
    assert [r.tokens for r in rows] == [model.generate(p, max_new_tokens=3).tokens for p in prompt]
    lists = model.generate([[3, 4, 5], [6, 7, 8, 9]], max_new_tokens=3)
    assert [r.tokens for r in lists] == [model.generate(p, max_new_tokens=3).tokens for p in ([3, 4, 5], [6, 7, 8, 9])]
    with pytest.raises(ValueError, match=r"input ids of shape \(2, 2, 3\)"):
        model.generate(torch.arange(3, 15).reshape(2, 2, 3), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"one prompt is \[T\] or \[1, T\]; decode a batch as a list of prompts"):
        speculative_generate(tiny_target, PromptLookupDrafter(), prompt, max_new_tokens=3)
    # one row as [1, T] is a single prompt
    assert (
        model.generate(prompt.reshape(-1)[None, :5], max_new_tokens=3).tokens
        == model.generate(prompt.reshape(-1)[:5], max_new_tokens=3).tokens
    )


@pytest.mark.parametrize("draft_vocab, shared", [(128, 96), (80, 80)])
def test_padded_draft_vocabulary_maps_ids_exactly_when_the_shared_size_is_given(tiny_target, draft_vocab, shared):
    draft = tiny_llama(vocab_size=draft_vocab, seed=3)
    with pytest.raises(ValueError, match=r"pass draft_shared_vocab=len\(tokenizer\), at most"):
        selfspec.load(tiny_target, draft_model=draft, tune="off")
    with pytest.raises(ValueError, match=r"at most 80 \(got 90\)"):
        selfspec.load(tiny_target, draft_model=tiny_llama(vocab_size=80, seed=3), draft_shared_vocab=90, tune="off")
    model = selfspec.load(tiny_target, draft_model=draft, draft_shared_vocab=shared, tune="off")
    drafts: list[int] = []
    for seed in range(3):
        ids = torch.randint(3, 60, (9,), generator=torch.Generator().manual_seed(seed))
        ref = tiny_target.generate(ids[None], max_new_tokens=25, do_sample=False, pad_token_id=0)[0, 9:].tolist()
        out = speculative_generate(
            model.verifier,
            model.drafter,
            ids,
            max_new_tokens=25,
            step_callback=lambda row, tree, result: drafts.extend(tree.tokens[1:].tolist()),
        )
        assert out.tokens == ref  # with target ids >= 80 in the context the 80-id draft stops drafting
        sampled = speculative_generate(
            model.verifier,
            model.drafter,
            ids,
            max_new_tokens=25,
            sampling=SamplingConfig(do_sample=True, top_k=20),
            generator=torch.Generator().manual_seed(seed),
            step_callback=lambda row, tree, result: drafts.extend(tree.tokens[1:].tolist()),
        )
        assert len(sampled.tokens) == 25
    assert drafts and max(drafts) < shared
