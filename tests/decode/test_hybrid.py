"""The hybrid drafter: a head's tree merged with prompt-lookup chains, exact under greedy and sampling."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.decode.drafters import DraftTree, MedusaDrafter
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.drafters.hybrid import HybridDrafter, merge_chain, new_nodes
from selfspec.decode.drafters.ngram import lookup_chain
from selfspec.decode.loop import speculative_generate, speculative_generate_batch
from selfspec.decode.rejection import verify_tree_sampling
from selfspec.decode.tree import static_tree
from selfspec.heads.eagle import EagleConfig, EagleHead
from tests.helpers.archs import tiny_target
from tests.helpers.drafters import NO_LIMIT, Rigged, TargetTopKDrafter, cost, eagle_hybrid
from tests.helpers.heads import random_heads
from tests.helpers.lossless import assert_lossless, enumerate_law, tree_case
from tests.helpers.sampling import SAMPLING, processed_probs
from tests.helpers.stats import chi2_critical, pooled_chi2

V = 96


def test_merge_shares_the_nodes_the_tree_has_and_appends_the_rest():
    # root 0 -> a(1) -> c(3); root -> b(2)
    tree = DraftTree(tokens=torch.tensor([9, 11, 12, 13]), parents=torch.tensor([-1, 0, 0, 1]))
    merged, path = merge_chain(tree, [11, 13, 14, 15])
    assert merged.tokens.tolist() == [9, 11, 12, 13, 14, 15]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert path == [1, 3, 4, 5]
    merged, path = merge_chain(tree, [11, 20])  # diverges under a: a new sibling of c
    assert merged.parents.tolist() == [-1, 0, 0, 1, 1] and merged.tokens.tolist()[-1] == 20 and path == [1, 4]
    assert new_nodes(tree, [11, 13, 14, 15]) == [0, 0, 0, 1, 2]
    assert new_nodes(tree, [30, 11]) == [0, 1, 2]  # after leaving the tree every token is new
    with pytest.raises(ValueError, match="only deterministic trees"):
        merge_chain(DraftTree(tree.tokens, tree.parents, q=torch.ones(4, V) / V), [1])


def test_no_two_siblings_hold_one_token_after_merging():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = [0] + [int(torch.randint(1, 5, (1,), generator=g)) for _ in range(1, n)]
        seen, keep = set(), []
        for i, (p, t) in enumerate(zip(parents, tokens, strict=True)):
            if (p, t) not in seen:
                seen.add((p, t))
                keep.append(i)
        if keep != list(range(n)):
            continue  # only trees without duplicate siblings are drafts
        chain = torch.randint(1, 5, (6,), generator=g).tolist()
        merged, path = merge_chain(DraftTree(torch.tensor(tokens), torch.tensor(parents)), chain)
        pairs = list(zip(merged.parents.tolist(), merged.tokens.tolist(), strict=True))
        assert len(pairs) == len(set(pairs))
        assert [merged.tokens[i].item() for i in path] == chain
        assert all(merged.parents[i] < i for i in range(1, len(pairs)))


def test_lookup_chain_finds_the_latest_longest_match():
    ctx = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 2, 3]
    chain, n = lookup_chain(ctx, 3, 1, 4)
    assert n == 2 and chain == [7, 8, 2, 3]  # "2 3" last matched at index 6-7 (latest first)
    # a repetition: the latest match of "5 5 5" is followed by one token, an earlier one by four
    assert lookup_chain([9, 5, 5, 5, 5, 5, 5, 5], 3, 1, 4) == ([5, 5, 5, 5], 3)
    assert lookup_chain([1, 2, 3], 3, 1, 4) == ([], 0)


def test_exact_sampling_through_a_tree_from_two_sources_with_duplicates():
    """Enumerated: a head tree (top-2 under the root, top-2 under its first child) merged with an n-gram
    chain that repeats the head's first child and its child (shared, not duplicated) and then leaves the
    tree; every accept / reject / residual / bonus draw enumerated, V = 6: the emitted law is exactly
    prod p over every 4-token sequence."""
    from tests.helpers.lossless import target

    v, prefix0 = 6, (3,)
    p0 = target(prefix0, v)
    a, b = torch.topk(p0, 2).indices.tolist()
    pa = target(prefix0 + (a,), v)
    c, d = torch.topk(pa, 2).indices.tolist()
    head = DraftTree(tokens=torch.tensor([3, a, b, c, d]), parents=torch.tensor([-1, 0, 0, 1, 1]))
    e = int(torch.argsort(target(prefix0 + (a, c), v))[-2])  # the chain's own third token
    merged, path = merge_chain(head, [a, c, e])
    assert merged.tokens.numel() == 6 and path == [1, 3, 5]  # a and c shared, e new
    tokens, parents = merged.tokens.tolist(), merged.parents.tolist()
    _, p, _ = tree_case(parents, tokens, prefix0, v, None)

    def run(source):
        result = verify_tree_sampling(p, merged.tokens, merged.parents, None, source)
        return tuple(tokens[j] for j in result.accepted_nodes[1:].tolist()) + (result.next_token,)

    assert_lossless(enumerate_law(run), prefix0, v, 4, expect_longest=4)


def repetitive(length: int, seed: int) -> torch.Tensor:
    part = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(seed))
    return part.repeat(length // 6 + 1)[:length]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_equals_generate(arch, kind):
    t = tiny_target(arch)
    for seed, length in ((0, 14), (1, 25)):
        ids = repetitive(length, seed)
        ref = t.generate(ids[None], max_new_tokens=24, do_sample=False, pad_token_id=0, top_k=None)[0, length:]
        if kind == "eagle":
            drafter = eagle_hybrid(t)
        else:
            medusa = MedusaDrafter(random_heads(t), static_tree([(0,), (1,), (0, 0)]))
            drafter = HybridDrafter(medusa, cost().verify_cost_ms)
        out = speculative_generate(t, drafter, ids, max_new_tokens=24)
        assert out.tokens == ref.tolist()
        assert drafter.acceptance.chain_drafted  # n-gram chains were drafted beside the head's tree


def test_batch_rows_equal_their_own_hybrid_output():
    t = tiny_target("llama")
    prompts = [repetitive(n, s) for s, n in enumerate((14, 9, 25))]
    alone = [speculative_generate(t, eagle_hybrid(t), p, max_new_tokens=16).tokens for p in prompts]
    rows = speculative_generate_batch(t, eagle_hybrid(t), prompts, max_new_tokens=16)
    assert [r.tokens for r in rows] == alone


def test_split_follows_measured_acceptance_and_cost():
    """With a head that is never accepted and chains that always are, the split moves to the chain and
    drops the head's tree; with the opposite record, the head's tree alone (no chain node)."""
    h = HybridDrafter(Rigged(), cost(0.05).verify_cost_ms)
    h.begin(torch.tensor([5]), torch.zeros(1, 4))
    for _ in range(30):
        h.acceptance.record_head(0)
        h.acceptance.record_chain(3, 8, 8)
    ctx = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])  # "5 6 7" matches: chain [8, 9, 5, 6, 7]
    h.propose(ctx, None, None, NO_LIMIT)  # the first step drafts with the head: its tree's size is not known before
    calls = h._head_calls
    tree = h.propose(ctx, None, None, NO_LIMIT)
    assert h.split[-1] == (1, 5) and tree.tokens.tolist() == [7, 8, 9, 5, 6, 7]
    assert h._head_calls == calls  # the head was not asked to draft at all
    h2 = HybridDrafter(Rigged(), cost(0.05).verify_cost_ms)
    h2.begin(torch.tensor([5]), torch.zeros(1, 4))
    for _ in range(30):
        h2.acceptance.record_head(2)
        h2.acceptance.record_chain(3, 8, 0)
    h2.propose(ctx, None, None, NO_LIMIT)
    assert h2.split[-1] == (5, 0)  # the head's tree alone


@pytest.mark.slow  # over 5 s: the whole suite runs it
def test_sampling_keeps_the_target_distribution():
    """Seeded chi-square (as tests/decode/test_architectures.py): first two sampled tokens of a hybrid of
    the target's own top-k tree and prompt lookup, on a repetitive prompt, N = 300, alpha = 0.001."""
    t = tiny_target("llama")
    ids = repetitive(12, 3)
    p1 = processed_probs(t, ids)
    expected = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(t, torch.cat([ids, torch.tensor([x1])]))
        for x2 in p2.nonzero().flatten().tolist():
            expected[(x1, x2)] = float(p1[x1] * p2[x2])
    gen = torch.Generator().manual_seed(99)
    counts, chains, n = {}, 0, 300
    for _ in range(n):
        drafter = HybridDrafter(TargetTopKDrafter(t), cost(0.0).verify_cost_ms)
        out = speculative_generate(t, drafter, ids, max_new_tokens=3, sampling=SAMPLING, generator=gen)
        key = (out.tokens[0], out.tokens[1])
        assert key in expected
        counts[key] = counts.get(key, 0) + 1
        chains += sum(c for _, c in drafter.split)
    chi2, dof = pooled_chi2(counts, expected, n)
    assert dof >= 2 and chi2 < chi2_critical(dof), chi2
    assert chains > 0


def test_public_load_builds_a_hybrid_and_refuses_one_without_heads(tmp_path):
    t = tiny_target("llama")
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(hidden_size=t.config.hidden_size, vocab_size=V), t.config, target=t).eval()
    model = selfspec.load(t, head, hybrid=True, tune="off", depth=3, top_k=2, total_tokens=5)
    assert isinstance(model.drafter, HybridDrafter) and isinstance(model.drafter.head, EagleDrafter)
    ids = repetitive(14, 0)
    ref = t.generate(ids[None], max_new_tokens=12, do_sample=False, pad_token_id=0, top_k=None)[0, 14:]
    assert model.generate(ids, max_new_tokens=12).tokens == ref.tolist()
    with pytest.raises(ValueError, match="hybrid=True merges a head's tree with prompt lookup: pass heads"):
        selfspec.load(t, prompt_lookup=True, hybrid=True, tune="off")
