"""The served history: continuations from earlier outputs, bounded in tokens with the least-used evicted, and a hybrid
that drafts from it decodes exactly like ``generate`` while it grows, request after request."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.decode.drafters.served_history import ServedHistory
from selfspec.decode.loop import speculative_generate
from tests.helpers.archs import tiny_target
from tests.helpers.decoding import V
from tests.helpers.drafters import eagle_hybrid


def test_lookup_follows_the_outputs_and_counts_their_use():
    history = ServedHistory(max_tokens=100)
    assert history.lookup([1, 2], 4) == ([], 0)
    history.add([1, 2, 3, 4, 5])
    history.add(torch.tensor([7, 1, 2, 3, 9]))
    assert history.lookup([0, 1, 2, 3], 3) == ([4, 5], 3)  # tie at the first token: the smallest id, then its path
    assert history.lookup([8, 7, 1], 2) == ([2, 3], 2)
    assert (history.num_outputs, history.num_tokens) == (2, 10)


def test_memory_is_bounded_and_the_least_used_output_goes_first():
    history = ServedHistory(max_tokens=12)
    history.add([1, 2, 3, 4])  # A
    history.add([5, 6, 7, 8])  # B
    assert history.lookup([5, 6], 2) == ([7, 8], 2)  # B used once
    history.add([9, 10, 11, 12, 13])  # 13 > 12: A (unused, oldest) goes
    assert history.evicted == 1 and history.lookup([1, 2], 2) == ([], 0)
    assert history.lookup([5, 6], 2) == ([7, 8], 2)
    for i in range(1000):  # a long stream stays within the bound
        history.add([20 + i % 50, 21 + i % 50, 22])
        assert history.num_tokens <= 12
    history.add(list(range(30)))  # an output longer than the bound keeps its tail
    assert history.num_tokens == 12 and history.lookup([20, 21], 3) == ([22, 23, 24], 2)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        ServedHistory(max_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        ServedHistory(min_ngram=4, max_ngram=2)
    history = ServedHistory()
    with pytest.raises(ValueError, match=">= 0"):
        history.add([3, -1])
    history.add([3, V + 5])
    with pytest.raises(ValueError, match="served by another target"):
        history.check_vocab(V)


def test_a_growing_history_drafts_exactly_and_repeated_work_is_accepted_from_it():
    """A hybrid whose second source is the history, fed each output: every request equals ``generate``'s greedy
    output, and a request served before is drafted from its earlier output (more tokens per step)."""
    t = tiny_target("llama")
    drafter = eagle_hybrid(t)
    history = ServedHistory()
    drafter.suffix_index = history  # the source the model feeds
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, V, (6,), generator=g) for _ in range(3)]
    taus = []
    for ids in [*prompts, prompts[0]]:
        want = t.generate(ids[None], do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0)[0, 6:]
        out = speculative_generate(t, drafter, ids, max_new_tokens=24, eos_token_id=[])
        assert out.tokens == want.tolist()
        history.add(out.tokens)
        taus.append(out.stats.mean_accepted_tokens)
    assert history.num_outputs == 4
    assert taus[3] > taus[0]  # the repeat finds its earlier output


def test_load_with_history_feeds_every_served_output(tmp_path):
    """``selfspec.load(..., hybrid=True, history=True)``: the model adds each output (of a batch too) to its history;
    without ``hybrid`` the option is refused."""
    from tests.helpers.heads import random_heads

    t = tiny_target("llama")
    heads = random_heads(t)
    model = selfspec.load(t, heads, hybrid=True, history=True, tune="off")
    assert isinstance(model.history, ServedHistory)
    out = model.generate(torch.tensor([5, 6, 7, 8]), max_new_tokens=8, eos_token_id=[])
    assert model.history.num_tokens == len(out.tokens) == 8
    model.generate([torch.tensor([5, 6, 7]), torch.tensor([9, 9])], max_new_tokens=4, eos_token_id=[])
    assert model.history.num_outputs == 3
    with pytest.raises(ValueError, match="pass hybrid=True"):
        selfspec.load(t, heads, history=True, tune="off")
