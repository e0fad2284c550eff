"""decode/rejection.py: losslessness of speculative sampling, exactly (enumerated) and statistically."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from selfspec.decode.rejection import (
    GeneratorSource,
    RandomSource,
    accept_draft,
    acceptance_probability,
    residual_distribution,
    verify_chain_sampling,
    verify_tree_sampling,
)
from tests.helpers.lossless import (
    assert_lossless,
    draft,
    enumerate_law,
    lossless_error,
    target,
    tree_case,
    tree_paths,
)

F64 = torch.float64


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ------------------------------------------------------------------------------------------------
# The five scenarios of speculative sampling (Leviathan et al. 2023).


def test_accepted_whenever_p_at_least_q():
    """p(x) >= q(x): kept whatever the uniform, up to the largest float below 1."""
    u = t64([0.0, 0.25, 0.5, 0.9, 0.9999, math.nextafter(1.0, 0.0)])
    for p_x, q_x in [(0.5, 0.5), (0.7, 0.2), (1.0, 1e-9), (0.3, 0.0)]:
        assert accept_draft(t64(p_x), t64(q_x), u).all(), (p_x, q_x)


@pytest.mark.parametrize("p_x, q_x", [(0.3, 0.6), (0.1, 0.7), (1e-6, 0.5), (0.2, 0.25)])
def test_accept_reject_boundary_is_u_equals_ratio(p_x, q_x):
    """P(accept) = p/q = r: every u < r accepts, u = r and above reject."""
    r = t64(p_x) / t64(q_x)
    assert acceptance_probability(t64(p_x), t64(q_x)) == r
    below = t64([0.0, float(r) / 2, math.nextafter(float(r), 0.0)])
    above = t64([float(r), math.nextafter(float(r), 1.0), min(1.0, float(r) * 1.5), 0.9999])
    assert accept_draft(t64(p_x), t64(q_x), below).all()
    assert not accept_draft(t64(p_x), t64(q_x), above).any()


def test_target_zero_never_accepted():
    """A token the target forbids is rejected even for u = 0 (hence the strict <)."""
    assert not accept_draft(t64(0.0), t64(0.4), t64(0.0))
    assert not accept_draft(t64(0.0), t64(0.0), t64(0.0))
    assert acceptance_probability(t64([0.0, 0.2]), t64([0.0, 0.0])).tolist() == [0.0, 1.0]


def test_residual_sums_to_one_and_vanishes_where_q_at_least_p():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(5, 50, generator=g, dtype=F64).pow(3)
    q = torch.rand(5, 50, generator=g, dtype=F64).pow(3)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    r = residual_distribution(p, q)
    assert torch.allclose(r.sum(-1), torch.ones(5, dtype=F64), atol=1e-12)
    assert (r[q >= p] == 0).all()
    expected = (p - q).clamp_min(0)
    assert torch.allclose(r, expected / expected.sum(-1, keepdim=True), atol=1e-15)
    one_hot = torch.zeros(50, dtype=F64)
    one_hot[7] = 1.0  # deterministic candidate: the residual is p without token 7
    r7 = residual_distribution(p[0], one_hot)
    assert r7[7] == 0 and torch.allclose(r7 * (1 - p[0, 7]), torch.cat([p[0, :7], p.new_zeros(1), p[0, 8:]]))


def test_residual_degenerate_falls_back_to_p():
    """p == q (residual mass 0) or rounding noise below eps: the residual is p itself, never NaN."""
    p = t64([0.2, 0.3, 0.5])
    assert torch.equal(residual_distribution(p, p.clone()), p)
    noisy_q = p - t64([1e-17, 0.0, -1e-17])
    assert torch.equal(residual_distribution(p, noisy_q), p)
    p32 = torch.tensor([0.25, 0.75])
    assert torch.equal(residual_distribution(p32, p32 - torch.tensor([1e-8, -1e-8])), p32)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_k_accepted_drafts_yield_k_plus_1_tokens(k):
    """A perfect draft (q = p) is always accepted: one step emits K drafts + 1 bonus token."""
    v = 8
    g = torch.Generator().manual_seed(k)
    p = torch.softmax(torch.randn(k + 1, v, generator=g, dtype=F64), -1)
    p[k] = 0.0
    p[k, 5] = 1.0  # the bonus token is certain
    drafts = torch.multinomial(p[:k], 1, generator=g).squeeze(1)
    for seed in range(20):
        num_accepted, next_token = verify_chain_sampling(p, p[:k].clone(), drafts, torch.Generator().manual_seed(seed))
        assert (num_accepted, next_token) == (k, 5)
    parents = torch.arange(-1, k)
    tokens = torch.cat([torch.tensor([0]), drafts])
    result = verify_tree_sampling(p, tokens, parents, torch.cat([p[:k], p[:1]]), torch.Generator().manual_seed(0))
    assert result.accepted_nodes.tolist() == list(range(k + 1)) and result.num_accepted == k
    assert result.next_token == 5


def test_monte_carlo_50000_draws_match_target():
    """50,000 speculative draws (x ~ q, keep iff accept_draft, else residual ~ norm(max(p-q,0))).

    Bound: for every token, |empirical - p| < 5 sigma with sigma = sqrt(p (1 - p) / n), n = 50,000
    (seeded; a correct sampler fails this with probability < 1e-5 per token). A sampler that skipped
    the residual (drew from p or q after a rejection) misses by > 40 sigma here.
    """
    n = 50_000
    p = t64([0.40, 0.25, 0.15, 0.10, 0.06, 0.04, 0.0])
    q = t64([0.05, 0.05, 0.10, 0.30, 0.30, 0.10, 0.10])  # far from p, and mass where p has none
    g = torch.Generator().manual_seed(1234)
    x = torch.multinomial(q, n, replacement=True, generator=g)
    u = torch.rand(n, generator=g, dtype=F64)
    kept = accept_draft(p[x], q[x], u)
    fallback = torch.multinomial(residual_distribution(p, q), n, replacement=True, generator=g)
    out = torch.where(kept, x, fallback)
    empirical = torch.bincount(out, minlength=7).to(F64) / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((empirical - p).abs() <= 5 * sigma).all(), (empirical, p)
    assert empirical[6] == 0
    # The test can fail: the same draws without the residual correction are far off.
    wrong = torch.bincount(torch.where(kept, x, torch.multinomial(p, n, True, generator=g)), minlength=7) / n
    assert ((wrong - p).abs() > 5 * sigma.clamp_min(1e-3)).any()


def test_monte_carlo_tree_sampling_with_generator():
    """The production GeneratorSource path: 6,000 verifications of a 2-level tree with fresh draws.

    Checks the first emitted token and the first two emitted tokens (when two were emitted, else the
    second completed from p, which keeps the joint law prod p) against the target: every cell within
    5 sigma, sigma = sqrt(P (1 - P) / n), n = 6,000.
    """
    n, v = 6_000, 4
    p_root = t64([0.5, 0.3, 0.2, 0.0])
    p_next = t64([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [1.0, 0, 0, 0]])
    q_root = t64([0.1, 0.1, 0.4, 0.4])
    parents = torch.tensor([-1, 0, 0])
    g = torch.Generator().manual_seed(99)
    counts = torch.zeros(v, v, dtype=F64)
    drafts = torch.multinomial(q_root, 2 * n, replacement=True, generator=g).view(n, 2)
    for i in range(n):
        tokens = torch.cat([torch.tensor([0]), drafts[i]])
        p = torch.stack([p_root, p_next[tokens[1]], p_next[tokens[2]]])
        result = verify_tree_sampling(p, tokens, parents, torch.stack([q_root, q_root, q_root]), g)
        first = int(tokens[result.accepted_nodes[1]]) if result.num_accepted else result.next_token
        second = result.next_token if result.num_accepted else int(torch.multinomial(p_next[first], 1, generator=g))
        counts[first, second] += 1
    joint = p_root[:, None] * p_next
    empirical = counts / n
    sigma = (joint * (1 - joint) / n).sqrt()
    assert ((empirical - joint).abs() <= 5 * sigma + 1e-12).all(), (empirical, joint)


# ------------------------------------------------------------------------------------------------
# Exact losslessness by enumeration (the enumeration itself: tests/helpers/lossless.py).


CHAIN_V, CHAIN_K, CHAIN_PREFIX = 5, 3, (2,)


def _chain_dist(kind: str) -> dict[tuple[int, ...], float]:
    """The exact law of one step of verify_chain_sampling, K = 3, V = 5: every draft chain x ~ q
    enumerated with its probability, every accept/reject and residual/bonus draw by enumerate_law."""
    v, k, prefix0 = CHAIN_V, CHAIN_K, CHAIN_PREFIX
    dist: dict[tuple[int, ...], float] = defaultdict(float)

    def expand(drafts: tuple[int, ...], weight: float) -> None:
        if len(drafts) < k:
            q_next = draft(prefix0 + drafts, v, kind)
            for x, qx in enumerate(q_next.tolist()):
                if qx > 0:
                    expand(drafts + (x,), weight * qx)
            return
        contexts = [prefix0 + drafts[:i] for i in range(k + 1)]
        p = torch.stack([target(c, v) for c in contexts])
        q = torch.stack([draft(c, v, kind) for c in contexts[:k]])
        draft_tokens = torch.tensor(drafts)

        def run(source):
            num_accepted, next_token = verify_chain_sampling(p, q, draft_tokens, source)
            return drafts[:num_accepted] + (next_token,)

        for seq, w in enumerate_law(run).items():
            dist[seq] += weight * w

    expand((), 1.0)
    return dist


@pytest.mark.parametrize("kind", ["far", "zeros", "onehot_bad", "onehot", "mixed"])
def test_exact_chain_sampling_is_lossless(kind):
    """verify_chain_sampling, K = 3, V = 5: the law of the emitted tokens is exactly prod p."""
    assert_lossless(
        _chain_dist(kind), CHAIN_PREFIX, CHAIN_V, CHAIN_K + 1, expect_longest=1 if kind == "onehot_bad" else CHAIN_K + 1
    )


TREE = [-1, 0, 0, 0, 1, 4]  # root: 3 children; node 1: 1 child; node 4: 1 child (depth 3)


TREE_V, TREE_PREFIX = 4, (1,)


def _tree_dist(kind: str) -> dict[tuple[int, ...], float]:
    """The exact law of one step of verify_tree_sampling on TREE, children drawn i.i.d. from q (with
    replacement), V = 4: every assignment of draft tokens enumerated with probability
    prod q(x_i | context of parent), every accept/reject and residual/bonus draw by enumerate_law."""
    v, prefix0 = TREE_V, TREE_PREFIX
    parents = torch.tensor(TREE)
    dist: dict[tuple[int, ...], float] = defaultdict(float)

    def expand(tokens: list[int], weight: float) -> None:
        i = len(tokens)
        if i == len(TREE):
            _, p, q = tree_case(TREE, tokens, prefix0, v, kind)
            tree_tokens = torch.tensor(tokens)

            def run(source):
                result = verify_tree_sampling(p, tree_tokens, parents, q, source)
                return tuple(tokens[j] for j in result.accepted_nodes[1:].tolist()) + (result.next_token,)

            for seq, w in enumerate_law(run).items():
                dist[seq] += weight * w
            return
        path = tree_paths(TREE)[TREE[i]]
        context = prefix0 + tuple(tokens[j] for j in path[1:])
        for x, qx in enumerate(draft(context, v, kind).tolist()):
            if qx > 0:
                expand(tokens + [x], weight * qx)

    expand([prefix0[-1]], 1.0)
    return dist


@pytest.mark.parametrize("kind", ["far", "zeros", "onehot", "mixed"])
def test_exact_tree_sampling_is_lossless(kind):
    """verify_tree_sampling with children drawn i.i.d. from q (with replacement), V = 4, depth 3.

    Every assignment of draft tokens is enumerated with probability prod q(x_i | context of parent);
    the targets differ per node (they depend on the path's tokens)."""
    assert_lossless(_tree_dist(kind), TREE_PREFIX, TREE_V, 4, expect_longest=4)


@pytest.mark.parametrize("pick", ["top", "worst", "duplicates"])
def test_exact_tree_sampling_deterministic_candidates(pick):
    """q=None: children are fixed candidates (top-k style), full tree of branching 3 and depth 3, V = 6.

    "top": the draft's top-3; "worst": the target's 3 least likely tokens (incl. the forbidden one);
    "duplicates": the same candidate twice, then another."""
    v, prefix0 = 6, (3,)
    parents, tokens = [-1], [prefix0[-1]]
    frontier = [(0, ())]
    for _ in range(3):
        next_frontier = []
        for node, suffix in frontier:
            p = target(prefix0 + suffix, v)
            if pick == "top":
                candidates = torch.topk(draft(prefix0 + suffix, v, "far"), 3).indices.tolist()
            elif pick == "worst":
                candidates = torch.topk(-p, 3).indices.tolist()
            else:
                candidates = [int(torch.argsort(p)[-2])] * 2 + [int(torch.argmax(p))]
            for x in candidates:
                parents.append(node)
                tokens.append(x)
                next_frontier.append((len(parents) - 1, suffix + (x,)))
        frontier = next_frontier
    assert len(parents) == 40
    _, p, _ = tree_case(parents, tokens, prefix0, v, None)
    parents_t, tokens_t = torch.tensor(parents), torch.tensor(tokens)

    def run(source):
        result = verify_tree_sampling(p, tokens_t, parents_t, None, source)
        return tuple(tokens[j] for j in result.accepted_nodes[1:].tolist()) + (result.next_token,)

    assert_lossless(enumerate_law(run), prefix0, v, 4, expect_longest=4)


def _bonus_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


def _ratio_without_min(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x)), (p_x > 0).to(p_x.dtype))


def _inverted_ratio(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return torch.where(
        p_x > 0, (q_x / torch.where(p_x > 0, p_x, torch.ones_like(p_x))).clamp(max=1.0), torch.zeros_like(p_x)
    )


MUTANTS = {
    # After a rejection the correction is drawn from p instead of norm(max(p - q, 0)) (and, in a tree,
    # the next sibling is tried against p instead of the residual): the tokens q over-proposes are
    # emitted twice over, once accepted and once again from p.
    "correction_from_p": ("residual_distribution", _bonus_from_p),
    # Keep with "probability" p/q without the min(1, .): where p > q the accept weight exceeds 1 and
    # the reject branch vanishes, so the step's total mass is no longer 1.
    "ratio_without_min": ("acceptance_probability", _ratio_without_min),
    # Keep with min(1, q/p): the test inverted, which favours exactly the tokens the draft over-proposes.
    "inverted_ratio": ("acceptance_probability", _inverted_ratio),
}


@pytest.mark.slow  # over 5 s: the whole suite runs it
@pytest.mark.parametrize("case", ["chain", "tree"])
def test_exact_check_fails_for_a_broken_verifier(monkeypatch, case):
    """Mutation test of the enumeration: the very enumeration of test_exact_chain_sampling_is_lossless /
    test_exact_tree_sampling_is_lossless (adversarial draft "far") passes the exactness check for the
    real verifier, and fails it, by far more than its tolerance, for each verifier of MUTANTS: one step
    of Leviathan et al.'s rejection sampling broken by replacing one of the two functions the rejection
    walk calls (what each mutant breaks is said beside it)."""
    import selfspec.decode.rejection as rejection_module

    enumerate_case = {"chain": _chain_dist, "tree": _tree_dist}[case]
    prefix0, v, length = (CHAIN_PREFIX, CHAIN_V, CHAIN_K + 1) if case == "chain" else (TREE_PREFIX, TREE_V, 4)
    real = enumerate_case("far")
    assert_lossless(real, prefix0, v, length, expect_longest=length)
    assert lossless_error(real, prefix0, v, length) < 1e-9
    for mutant, (name, broken) in MUTANTS.items():
        with monkeypatch.context() as patch:
            patch.setattr(rejection_module, name, broken)
            wrong = enumerate_case("far")
        with pytest.raises(AssertionError):
            assert_lossless(wrong, prefix0, v, length, expect_longest=length)
        assert lossless_error(wrong, prefix0, v, length) > 1e-3, mutant


# ------------------------------------------------------------------------------------------------
# Reproducibility.


def test_same_seed_same_result_and_chain_of_zero():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 20, generator=g), -1)
    q = torch.softmax(torch.randn(5, 20, generator=g), -1)
    tokens, parents = torch.randint(0, 20, (5,), generator=g), torch.tensor([-1, 0, 0, 1, 2])
    runs = [verify_tree_sampling(p, tokens, parents, q, torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(runs[0].accepted_nodes, runs[1].accepted_nodes) and runs[0].next_token == runs[1].next_token
    one_hot = torch.zeros(1, 20)
    one_hot[0, 13] = 1.0
    assert verify_chain_sampling(one_hot, torch.zeros(0, 20), torch.zeros(0, dtype=torch.long)) == (0, 13)
    assert isinstance(GeneratorSource(None, 3, torch.device("cpu")), RandomSource)
