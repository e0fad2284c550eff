"""The decode loop reproduces plain ``generate`` exactly (fp32, tiny random Llama), stops exactly,
and applies every processor at every verified position."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, NoBadWordsLogitsProcessor

from selfspec.decode.drafters import DraftModelDrafter, MedusaDrafter, PromptLookupDrafter
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import static_tree
from tests.helpers.archs import tiny_llama
from tests.helpers.decoding import TREES, plain_greedy
from tests.helpers.drafters import OracleDrafter
from tests.helpers.heads import random_heads

V = 96


@pytest.mark.parametrize("tree_paths", TREES)
def test_medusa_greedy_equals_target(tiny_target, tree_paths):
    heads = random_heads(tiny_target, draft_vocab=64 if len(tree_paths) > 3 else None)
    for seed in range(6):
        ids = torch.randint(3, V, (5 + 3 * seed,), generator=torch.Generator().manual_seed(seed))
        ref = plain_greedy(tiny_target, ids, 30)
        out = speculative_generate(tiny_target, MedusaDrafter(heads, static_tree(tree_paths)), ids, max_new_tokens=30)
        assert out.tokens == ref
        assert out.stats.new_tokens == 30 and out.stats.finish_reason == "length"


@pytest.mark.parametrize("nodes", [2, 6, 16])
def test_oracle_trees_accept_long_paths_and_stay_exact(tiny_target, nodes):
    total_steps = total_tokens = 0
    for seed in range(8):
        ids = torch.randint(3, V, (7,), generator=torch.Generator().manual_seed(100 + seed))
        ref = plain_greedy(tiny_target, ids, 40)
        out = speculative_generate(tiny_target, OracleDrafter(7, ref, seed, nodes), ids, max_new_tokens=40)
        assert out.tokens == ref
        total_steps += out.stats.steps
        total_tokens += out.stats.new_tokens - 1
    tau = total_tokens / total_steps
    assert tau > 1.5  # drafts really were accepted, so compaction of accepted paths was exercised


def test_prompt_lookup_and_draft_model_greedy_equal_target(tiny_target):
    draft = tiny_llama(seed=3)
    for seed in range(4):
        ids = torch.randint(3, V, (9,), generator=torch.Generator().manual_seed(seed))
        ids = torch.cat([ids, ids])  # repetition for prompt lookup to find
        ref = plain_greedy(tiny_target, ids, 25)
        for drafter in (
            PromptLookupDrafter(num_tokens=5),
            DraftModelDrafter(draft, num_tokens=3),
            DraftModelDrafter(tiny_target, num_tokens=4),
        ):
            out = speculative_generate(tiny_target, drafter, ids, max_new_tokens=25)
            assert out.tokens == ref, drafter.name
    # the target drafting for itself is always right: every step yields num_tokens + 1 tokens
    out = speculative_generate(tiny_target, DraftModelDrafter(tiny_target, num_tokens=4), ids, max_new_tokens=25)
    assert out.stats.accepted_per_step[:-1] == [5] * (len(out.stats.accepted_per_step) - 1)


def test_eos_inside_accepted_block_stops_right_there(tiny_target):
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(5))
    ref = plain_greedy(tiny_target, ids, 20)
    # declare a token at position k > 1 an EOS (inside an accepted block)
    k = next(i for i in range(2, 6) if ref[i] not in ref[:i])
    eos = ref[k]
    out = speculative_generate(
        tiny_target, DraftModelDrafter(tiny_target, num_tokens=6), ids, max_new_tokens=20, eos_token_id=[999, eos]
    )
    assert out.stats.steps == 1  # the whole block was accepted in one step ...
    assert out.tokens == ref[: k + 1]  # ... yet output ends at the EOS
    assert out.stats.finish_reason == "stop"
    assert out.tokens == plain_greedy(tiny_target, ids, 20, eos_token_id=eos)


def test_max_new_tokens_exact_when_block_overshoots(tiny_target):
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(6))
    ref = plain_greedy(tiny_target, ids, 5)
    out = speculative_generate(tiny_target, DraftModelDrafter(tiny_target, num_tokens=7), ids, max_new_tokens=5)
    assert out.tokens == ref and len(out.tokens) == 5 and out.stats.finish_reason == "length"


def test_min_new_tokens_counts_tokens_not_steps(tiny_target):
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(5))
    ref = plain_greedy(tiny_target, ids, 20)
    eos = ref[2]
    expected = plain_greedy(tiny_target, ids, 20, eos_token_id=eos, min_new_tokens=8)
    out = speculative_generate(
        tiny_target,
        DraftModelDrafter(tiny_target, num_tokens=6),
        ids,
        max_new_tokens=20,
        eos_token_id=eos,
        min_new_tokens=8,
    )
    assert out.tokens == expected
    assert len(out.tokens) >= 8


def test_repetition_penalty_greedy_equals_plain(tiny_target):
    heads = random_heads(tiny_target)
    for seed in range(3):
        ids = torch.randint(3, V, (8,), generator=torch.Generator().manual_seed(seed))
        ref = plain_greedy(tiny_target, ids, 25, repetition_penalty=1.3)
        for drafter in (MedusaDrafter(heads, static_tree(TREES[2])), DraftModelDrafter(tiny_target, num_tokens=4)):
            out = speculative_generate(
                tiny_target, drafter, ids, max_new_tokens=25, sampling=SamplingConfig(repetition_penalty=1.3)
            )
            assert out.tokens == ref


def test_banned_token_never_appears_under_sampling(tiny_target):
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(1))
    free = speculative_generate(
        tiny_target,
        DraftModelDrafter(tiny_target, 4),
        ids,
        max_new_tokens=40,
        sampling=SamplingConfig(do_sample=True),
        generator=torch.Generator().manual_seed(0),
    )
    banned = max(set(free.tokens), key=free.tokens.count)  # the token it likes most
    proc = LogitsProcessorList([NoBadWordsLogitsProcessor([[banned]], eos_token_id=None)])
    for seed in range(5):
        for drafter in (
            DraftModelDrafter(tiny_target, 4),
            MedusaDrafter(random_heads(tiny_target), static_tree(TREES[2])),
        ):
            out = speculative_generate(
                tiny_target,
                drafter,
                ids,
                max_new_tokens=40,
                logits_processor=proc,
                sampling=SamplingConfig(do_sample=True),
                generator=torch.Generator().manual_seed(seed),
            )
            assert banned not in out.tokens


def test_same_seed_same_output(tiny_target):
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(2))
    sampling = SamplingConfig(do_sample=True, temperature=0.7, top_p=0.9)
    runs = [
        speculative_generate(
            tiny_target,
            DraftModelDrafter(tiny_llama(seed=4), 3),
            ids,
            max_new_tokens=30,
            sampling=sampling,
            generator=torch.Generator().manual_seed(s),
        ).tokens
        for s in (11, 11, 12)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_string_ends_output(tiny_target):
    class CharTokenizer:  # token t decodes to chr(65 + t % 26)
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(65 + int(t) % 26) for t in ids)

    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(5))
    ref = plain_greedy(tiny_target, ids, 20)
    text = CharTokenizer().decode(ref)
    stop = text[4:6]
    first = text.find(stop)
    out = speculative_generate(
        tiny_target,
        DraftModelDrafter(tiny_target, 6),
        ids,
        max_new_tokens=20,
        stop_strings=[stop],
        tokenizer=CharTokenizer(),
    )
    assert out.tokens == ref[: first + len(stop)]
    assert out.stats.finish_reason == "stop"


def test_typical_acceptance_is_flagged_lossy(tiny_target):
    ids = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(5))
    out = speculative_generate(
        tiny_target,
        MedusaDrafter(random_heads(tiny_target), static_tree(TREES[2])),
        ids,
        max_new_tokens=10,
        acceptance="typical",
        sampling=SamplingConfig(do_sample=True),
        generator=torch.Generator().manual_seed(0),
    )
    assert out.stats.lossy is True and len(out.tokens) == 10
    with pytest.raises(ValueError, match="acceptance"):
        speculative_generate(tiny_target, PromptLookupDrafter(), ids, acceptance="fast")
