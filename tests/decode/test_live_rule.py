"""Trees that follow live acceptance (``decode/tuning/batch_rule.py: BatchTreeRule``): the tree shrinks as the
acceptance the traffic gives falls below the head's offline profile, drafting is switched off for a bounded back-off
when no tree pays and probed again, and outputs stay the target's own (greedy exact against ``generate`` at batch 1
and in batches, sampling by a seeded chi-square). Costs are fixed profiles: nothing is calibrated here."""

from __future__ import annotations

import functools

import pytest
import torch

import selfspec
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.loop import speculative_generate_batch
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tuning.batch_rule import BACKOFF_MAX, BACKOFF_MIN, BatchCostProfile, BatchTreeRule
from selfspec.decode.tuning.calibration import AcceptanceProfile
from selfspec.decode.tuning.costs import CostProfile
from selfspec.heads.eagle import EagleConfig, EagleHead
from tests.helpers.archs import tiny_target
from tests.helpers.drafters import TargetTopKDrafter
from tests.helpers.sampling import processed_probs
from tests.helpers.stats import chi2_critical, pooled_chi2

V = 96
KEY = {"target_fingerprint": "x", "device": "cpu", "dtype": "float32", "threads": 1, "torch": "2"}


def single(per_node: float) -> CostProfile:
    """Batch-1 verification: 10 ms plus ``per_node`` plain steps per extra node."""
    sizes = (1, 2, 4, 8, 16, 32, 64)
    ms = tuple(10 * (1 + per_node * (n - 1)) for n in sizes)
    return CostProfile(**KEY, context_length=128, node_counts=sizes, verify_ms=ms)


def batch_cost(per_token_ms: float = 0.5, fixed_ms: float = 20.0) -> BatchCostProfile:
    bs, ns = (1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32)
    return BatchCostProfile(KEY, 128, bs, ns, tuple(tuple(fixed_ms + per_token_ms * b * n for n in ns) for b in bs))


def acceptance(rate: float = 0.7, depth_max: int = 4, n_max: int = 12) -> AcceptanceProfile:
    tau = tuple(
        tuple(1 + sum(rate**k for k in range(1, min(d, n) + 1)) for n in range(1, n_max + 1))
        for d in range(1, depth_max + 1)
    )
    zeros = tuple(tuple(0 for _ in range(n_max)) for _ in range(depth_max))
    return AcceptanceProfile(top_k=4, tau=tau, inexact_steps=zeros, steps=100, prompts=4, max_new_tokens=64)


def eagle_rule(per_node: float = 0.03) -> BatchTreeRule:
    return BatchTreeRule(None, acceptance(), {d: 0.5 * d for d in range(1, 5)}, single=single(per_node))


def drive(rule: BatchTreeRule, steps: int, accepted: float, batch: int = 1) -> list[int]:
    """``steps`` steps at ``batch``, each drafting the cap's tree (a chain of its depth, the other draft tokens at
    depth 1) and accepting ``accepted`` of its depth; returns each step's depth."""
    depths = []
    for _ in range(steps):
        cap = rule(batch)
        d = cap.depth if cap.depth is not None else 4
        extra = max(0, (cap.total_tokens or d) - d) if d else 0
        depths.append(d)
        for _ in range(batch):
            rule.observe(torch.tensor([*range(d + 1), *[1] * extra]), int(accepted * d), 0.001)
    return depths


def test_profile_is_the_prior_and_live_acceptance_shrinks_the_tree():
    rule = eagle_rule()
    first = rule(1)
    assert rule.scale() == 1.0 and first == rule.prior_cap(1) and first.depth >= 3  # the offline choice
    drive(rule, 40, accepted=0.25)  # the traffic accepts about half of what the profile expects (1 of ~1.8)
    assert 0.2 < rule.scale() < 0.9
    smaller = rule.cap_at(1)
    assert 0 < (smaller.total_tokens or 0) <= (first.total_tokens or 0) and smaller.depth <= first.depth
    assert smaller.expected_speedup < first.expected_speedup
    drive(rule, 60, accepted=1.0)  # and back: the estimate decays towards what the traffic gives now
    assert rule.scale() > 0.9 and rule.cap_at(1).depth >= smaller.depth


def test_drafting_is_switched_off_with_a_bounded_back_off_and_probed_again():
    rule = eagle_rule(per_node=0.08)  # dearer nodes: a head accepting nothing cannot pay for any tree
    depths = drive(rule, 400, accepted=0.0)
    assert depths[0] > 0  # the first step drafts the offline choice
    off_runs, run = [], 0
    for d in depths[1:]:
        if d == 0:
            run += 1
        elif run:
            off_runs.append(run)
            run = 0
    # pauses of 4, 8, 16, ... steps between single probes, never longer than BACKOFF_MAX
    assert off_runs[0] >= BACKOFF_MIN - 1 and max(off_runs) == BACKOFF_MAX
    assert all(b >= a for a, b in zip(off_runs, off_runs[1:], strict=False))
    first_off = depths.index(0)
    probes = sum(1 for d in depths[first_off:] if d > 0)
    assert probes <= len(off_runs) + 1 and probes / len(depths) < 0.05  # a small, bounded cost
    assert rule.drafting_off or rule.cap_at(1).depth == 0
    # the traffic changes: probes that pay turn drafting back on
    drive(rule, 2 * BACKOFF_MAX + 2, accepted=1.0)
    assert sum(1 for d in drive(rule, 20, accepted=1.0) if d > 0) == 20


def test_no_probes_where_not_even_the_prior_pays():
    rule = BatchTreeRule(batch_cost(2.0), acceptance(), {d: 0.5 * d for d in range(1, 5)}, single=single(0.03))
    assert rule.prior_cap(16).depth == 0 and rule.prior_cap(1).depth > 0
    assert drive(rule, 50, accepted=1.0, batch=16) == [0] * 50 and not rule.drafting_off


def test_per_depth_rule_for_drafters_without_a_profile():
    rule = BatchTreeRule(None, max_depth=5, single=single(0.03))
    assert rule(1).depth == 5  # nothing observed: the drafter's own tree
    drive(rule, 30, accepted=1.0)
    assert rule(1).depth == 5
    depths = drive(rule, 400, accepted=0.0)  # about 1 / (1 - LIVE_DECAY) drafted steps to forget the good ones
    assert depths[-BACKOFF_MAX:].count(0) >= 0.9 * BACKOFF_MAX  # switched off, probing once per pause
    with pytest.raises(ValueError, match="cost by batch size"):
        rule.cap_at(4)
    assert rule.with_batch_cost(batch_cost()).cap_at(4).depth is not None
    with pytest.raises(ValueError, match="needs a cost profile"):
        BatchTreeRule(None, max_depth=5)


# ------------------------------------------------------------------ decoding: outputs unchanged


@functools.cache
def target():
    return tiny_target("llama")


def random_eagle(t) -> EagleDrafter:
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(hidden_size=t.config.hidden_size, vocab_size=V), t.config, target=t).eval()
    return EagleDrafter(head, t, depth=4, top_k=4, total_tokens=12)


PROMPTS = [torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 8)]


def plain(t, ids, n):
    out = t.generate(ids[None], max_new_tokens=n, do_sample=False, pad_token_id=0, top_k=None)
    return out[0, ids.numel() :].tolist()


def test_greedy_exact_at_batch_1_and_in_batches_while_drafting_switches_off():
    """A random head accepts almost nothing: the rule switches it off and probes; every row is still generate's."""
    t = target()
    rule = BatchTreeRule(batch_cost(), acceptance(0.8), {d: 0.5 * d for d in range(1, 5)}, single=single(0.08))
    drive(rule, 30, accepted=0.0)  # earlier traffic accepted nothing: the first requests start switched off
    ref = [plain(t, p, 24) for p in PROMPTS]
    outs = [speculative_generate_batch(t, random_eagle(t), [p], max_new_tokens=24, tree_rule=rule)[0] for p in PROMPTS]
    assert [o.tokens for o in outs] == ref
    off = sum(o.stats.drafting_off_steps for o in outs)
    assert off > 0 and all(o.stats.plain_steps >= o.stats.drafting_off_steps for o in outs)
    assert all(o.stats.drafting_off_s >= 0 for o in outs)
    assert sum(o.stats.steps - o.stats.plain_steps for o in outs) > 0  # probes drafted
    rows = speculative_generate_batch(t, random_eagle(t), PROMPTS, max_new_tokens=24, tree_rule=rule)
    assert [r.tokens for r in rows] == ref
    assert sum(r.stats.drafting_off_steps for r in rows) > 0


def test_public_generate_uses_the_live_rule_at_batch_1_across_requests():
    t = target()
    auto = selfspec.load(t, prompt_lookup=True)
    fixed = selfspec.load(t, prompt_lookup=True, tune="off")
    for p in PROMPTS:
        assert auto.generate(p, max_new_tokens=24).tokens == fixed.generate(p, max_new_tokens=24).tokens
    rule = auto.batch_tree_rule(batch=False)
    assert rule is auto.batch_tree_rule(batch=False) and rule.single is not None  # one rule, kept across requests
    assert auto.generate(p, max_new_tokens=8, batch_tree="fixed").stats.drafting_off_steps == 0


def test_sampling_keeps_the_distribution_while_drafting_switches_off_and_on():
    """Seeded Pearson chi-square of the first two sampled tokens against the target's exact distribution (temperature
    0.7, top-k 6), N = 300 requests through one rule that switches a good drafter off on dear nodes and probes it."""
    t = target()
    sampling = SamplingConfig(do_sample=True, temperature=0.7, top_k=6)
    ids = PROMPTS[1]
    p1 = processed_probs(t, ids)
    expected = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(t, torch.cat([ids, torch.tensor([x1])]))
        for x2 in p2.nonzero().flatten().tolist():
            expected[(x1, x2)] = float(p1[x1] * p2[x2])
    rule = BatchTreeRule(None, max_depth=2, single=single(0.6))
    gen = torch.Generator().manual_seed(4321)
    counts: dict = {}
    off = drafted = 0
    for _ in range(300):
        (out,) = speculative_generate_batch(
            t, TargetTopKDrafter(t), [ids], max_new_tokens=3, sampling=sampling, generator=gen, tree_rule=rule
        )
        key = (out.tokens[0], out.tokens[1])
        assert key in expected
        counts[key] = counts.get(key, 0) + 1
        off += out.stats.drafting_off_steps
        drafted += out.stats.steps - out.stats.plain_steps
    chi2, dof = pooled_chi2(counts, expected, 300)
    assert dof >= 2 and chi2 < chi2_critical(dof), (chi2, dof)
    assert off > 0 and drafted > 0
