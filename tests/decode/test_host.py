"""decode/host.py: the tree read once per step and handed to every part of the step gives the results the
parts compute on their own; a speculation step reads tensor values on the host twice (tree, argmax)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from selfspec.decode.drafters import DraftTree, MedusaDrafter
from selfspec.decode.host import HostTree, cut_tree, read_tree, to_device
from selfspec.decode.kv import compact_cache
from selfspec.decode.loop import speculative_generate
from selfspec.decode.rejection import verify_tree_sampling
from selfspec.decode.sampling import sample
from selfspec.decode.step import NonFiniteLogitsError
from selfspec.decode.tree import static_tree, tree_depths
from selfspec.decode.verifier import Verifier
from selfspec.decode.verify import VerifyResult, verify_greedy, verify_typical
from tests.helpers.archs import tiny_llama
from tests.helpers.caches import hand_built_cache, positions
from tests.helpers.decoding import TREES, plain_greedy
from tests.helpers.drafters import OracleDrafter
from tests.helpers.heads import random_heads
from tests.helpers.host_reads import counted_reads

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3]


def random_tree(n: int, seed: int, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return torch.randint(0, vocab, (n,), generator=g), torch.tensor(parents)


def test_read_tree_values_depths_and_cut():
    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    host = read_tree(tokens, torch.tensor(PARENTS))
    assert host.tokens == tokens.tolist() and host.parents == PARENTS
    assert host.depths == tree_depths(torch.tensor(PARENTS)).tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    assert host.num_nodes == 8 and host.max_depth == 3 and not host.is_chain
    assert (
        read_tree(tokens[:3], torch.tensor([-1, 0, 1])).is_chain and read_tree(tokens[:1], torch.tensor([-1])).is_chain
    )
    tree = DraftTree(tokens=tokens, parents=torch.tensor(PARENTS))
    for d in range(4):
        cut, cut_host = cut_tree(tree, host, d)
        kept = [i for i, depth in enumerate(host.depths) if depth <= d]
        assert cut.tokens.tolist() == [int(tokens[i]) for i in kept] == cut_host.tokens
        assert cut.parents.tolist() == cut_host.parents and cut_host.depths == tree_depths(cut.parents).tolist()
        assert host.cut(d) == (cut_host, kept)
    assert cut_tree(tree, host, 3) == (tree, host)  # nothing to cut: the same objects
    assert to_device([3, 4], "cpu").tolist() == [3, 4] and to_device([3], "cpu").dtype == torch.long


@pytest.mark.parametrize("seed", range(6))
def test_verifiers_given_the_host_tree_decide_as_without(seed):
    n, v = 12, 50
    tokens, parents = random_tree(n, seed, v)
    host = read_tree(tokens, parents)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    p = logits.softmax(-1)
    tokens[1:] = torch.where(torch.rand(n - 1, generator=g) < 0.6, logits.argmax(-1)[parents[1:]], tokens[1:])
    host = read_tree(tokens, parents)
    q = torch.rand(n, v, generator=g).softmax(-1)

    def same(a, b):
        assert a.accepted_nodes.tolist() == b.accepted_nodes.tolist() == list(a.path) == list(b.path)
        assert a.next_token == b.next_token

    ref = verify_greedy(logits, tokens, parents)
    same(verify_greedy(logits, tokens, parents, host=host), ref)
    same(verify_greedy(logits, tokens, parents, host=host, argmax=logits.argmax(-1).tolist()), ref)
    for qq in (q, None):
        a = verify_tree_sampling(p, tokens, parents, qq, torch.Generator().manual_seed(7))
        same(verify_tree_sampling(p, tokens, parents, qq, torch.Generator().manual_seed(7), host=host), a)
    a = verify_typical(p, tokens, parents, torch.Generator().manual_seed(3))
    same(verify_typical(p, tokens, parents, torch.Generator().manual_seed(3), host=host), a)
    with pytest.raises(ValueError, match="argmax must hold one index per node"):
        verify_greedy(logits, tokens, parents, host=host, argmax=[0])
    bad = HostTree(host.tokens, [-1, 2] + host.parents[2:], host.depths)
    with pytest.raises(ValueError, match=r"parents\[1\] = 2"):
        verify_greedy(logits, tokens, parents, host=bad)


@pytest.mark.parametrize("path", [[0, 2, 4], [0, 1, 2], [0], [0, 1, 3]])
def test_compact_cache_with_the_host_path_equals_without(path):
    a, b = hand_built_cache(), hand_built_cache()
    compact_cache(a, 4, torch.tensor(path))
    compact_cache(b, 4, torch.tensor(path), path)
    assert positions(a) == positions(b)


def test_forward_tree_with_the_host_tree_equals_without():
    target = tiny_llama(seed=2)
    verifier = Verifier(target)
    prompt = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(0))
    for parents in (PARENTS, [-1, 0, 1, 2], [-1]):
        tokens = torch.randint(3, 96, (len(parents),), generator=torch.Generator().manual_seed(1))
        parents_t = torch.tensor(parents)
        outs = []
        for host in (None, read_tree(tokens, parents_t)):
            cache = verifier.new_cache()
            verifier.prefill(prompt, cache)
            outs.append(verifier.forward_tree(tokens, parents_t, cache, prompt.numel(), host=host))
        assert torch.equal(outs[0], outs[1])


def test_a_greedy_tree_step_reads_the_host_twice(tiny_target):
    heads = random_heads(tiny_target)
    ids = torch.randint(3, 96, (8,), generator=torch.Generator().manual_seed(4))
    ref = plain_greedy(tiny_target, ids, 20)
    drafter = MedusaDrafter(heads, static_tree(TREES[2]))
    out = speculative_generate(tiny_target, drafter, ids, max_new_tokens=20)
    assert out.tokens == ref
    drafter = MedusaDrafter(heads, static_tree(TREES[2]))  # built outside the count (it reads its tree)
    sites: Counter = Counter()
    with counted_reads(sites):
        again = speculative_generate(tiny_target, drafter, ids, max_new_tokens=20)
    assert again.tokens == ref
    # the prefill reads its first token (argmax and finite flag together), then each step the tree and the argmax
    assert sum(sites.values()) == 1 + 2 * again.stats.steps, sites


def test_non_finite_logits_at_a_tree_step_still_name_the_step(tiny_target):
    heads = random_heads(tiny_target)
    ids = torch.randint(3, 96, (8,), generator=torch.Generator().manual_seed(4))
    first = plain_greedy(tiny_target, ids, 1)[0]
    target = tiny_llama()
    target.load_state_dict(tiny_target.state_dict())
    target.model.embed_tokens.weight[first] = float("inf")  # the logits after the root (step 1) are NaN
    with pytest.raises(NonFiniteLogitsError, match="at verification step 1: no token can be chosen"):
        speculative_generate(target, MedusaDrafter(heads, static_tree(TREES[2])), ids, max_new_tokens=8)


class LazyUniforms:
    """The uniforms drawn at the first ``accept`` and read on their own (a :class:`RandomSource` that is not a
    ``GeneratorSource``, so the walk reads its probabilities apart): the draws a ``torch.Generator`` makes."""

    def __init__(self, generator: torch.Generator, n: int) -> None:
        self.generator, self.n, self.u = generator, n, None

    def accept(self, node: int, probability: float) -> bool:
        if self.u is None:
            self.u = torch.rand(self.n, generator=self.generator, dtype=torch.float64).tolist()
        return self.u[node] < probability

    def categorical(self, probs: torch.Tensor) -> int:
        return int(sample(probs.unsqueeze(0), self.generator)[0])


@pytest.mark.parametrize("seed", range(8))
def test_sampling_reads_uniforms_with_the_first_try_probabilities_and_decides_the_same(seed):
    n, v = 10, 40
    tokens, parents = random_tree(n, seed, v)
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, v, generator=g) * 2).softmax(-1)
    q = (torch.randn(n, v, generator=g) * 2).softmax(-1)
    host = read_tree(tokens, parents)
    for qq in (q, None):
        for s in range(5):
            a = verify_tree_sampling(p, tokens, parents, qq, torch.Generator().manual_seed(s), host=host)
            b = verify_tree_sampling(p, tokens, parents, qq, LazyUniforms(torch.Generator().manual_seed(s), n))
            assert a.path == b.path and a.next_token == b.next_token
    chain = torch.arange(-1, n - 1)
    sites: Counter = Counter()
    with counted_reads(sites):
        verify_tree_sampling(p, tokens, chain, None, torch.Generator().manual_seed(0), host=read_tree(tokens, chain))
    # the tree (read_tree), the probabilities with the uniforms, the final draw; no sibling on a chain
    assert sum(sites.values()) == 3, sites


def test_typical_reads_acceptability_and_log_p_in_one_copy():
    n, v = 9, 30
    tokens, parents = random_tree(n, 3, v)
    p = (torch.randn(n, v, generator=torch.Generator().manual_seed(3)) * 2).softmax(-1)
    tokens[1:] = p.argmax(-1)[parents[1:]]  # every draft the parent's most likely token: acceptable
    ref = verify_typical(p, tokens, parents, torch.Generator().manual_seed(1))
    host = read_tree(tokens, parents)
    sites: Counter = Counter()
    with counted_reads(sites):
        got = verify_typical(p, tokens, parents, torch.Generator().manual_seed(1), host=host)
    assert got.path == ref.path and got.next_token == ref.next_token and len(got.path) == max(host.depths) + 1
    assert sum(sites.values()) == 2, sites  # acceptability with log p, then the next-token draw


def test_a_result_without_the_host_path_is_read_from_the_device(tiny_target, monkeypatch):
    import selfspec.decode.loop as loop

    ids = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(5))
    ref = plain_greedy(tiny_target, ids, 30)
    orig = loop.verify_step

    def no_path(*args, **kwargs):
        r = orig(*args, **kwargs)
        return VerifyResult(r.accepted_nodes, r.next_token)

    monkeypatch.setattr(loop, "verify_step", no_path)
    out = speculative_generate(tiny_target, OracleDrafter(7, ref, 0, 12), ids, max_new_tokens=30)
    assert out.tokens == ref and out.stats.mean_accepted_tokens > 1.5


def test_full_attention_tree_mask_and_positions_from_the_kept_block_equal_the_host_built_ones(monkeypatch):
    import selfspec.decode.verifier as verifier_module
    from selfspec.decode.masks import attention_layout, tree_attention_masks
    from selfspec.decode.tree import tree_position_ids

    target = tiny_llama(seed=2)
    verifier = Verifier(target)
    seen = []
    orig = verifier_module.call_with_cache

    def record(model, cache, **kwargs):
        seen.append((kwargs.get("attention_mask"), kwargs.get("position_ids")))
        return orig(model, cache, **kwargs)

    monkeypatch.setattr(verifier_module, "call_with_cache", record)
    layout = attention_layout(target.config)
    cache = verifier.new_cache()
    verifier.prefill(torch.randint(3, 96, (5,), generator=torch.Generator().manual_seed(0)), cache)
    past = 5
    for step, seed in enumerate([0, 1, 0, 2, 0]):  # shapes come back: the kept block serves them
        tokens, parents = random_tree(9, seed, 96)
        verifier.forward_tree(tokens, parents, cache, past, host=read_tree(tokens, parents) if step % 2 else None)
        mask, positions = seen[-1]
        assert torch.equal(mask, tree_attention_masks(parents, past, torch.float32, layout))
        assert torch.equal(positions, tree_position_ids(parents, past))
        past += 9
    assert len(verifier._tree_blocks) == 3
