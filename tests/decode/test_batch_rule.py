"""The batch tree rule (``decode/tuning/batch_rule.py``): the tree it sizes by batch size from a verification cost
profile and an acceptance profile, the online rule that learns acceptance during a call, and the batch cost profile
measured, cached and refused when corrupt."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.decode.loop import TreeCap
from selfspec.decode.tuning.batch_rule import (
    BatchCostProfile,
    BatchTreeRule,
    get_batch_cost_profile,
    measure_batch_cost_profile,
)
from selfspec.decode.tuning.calibration import AcceptanceProfile
from tests.helpers.archs import tiny_target


def fake_cost(per_token_ms: float, fixed_ms: float) -> BatchCostProfile:
    """Verify cost = fixed + per_token * B * N: weight reading (fixed) vs real work (per token)."""
    bs, ns = (1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32)
    ms = tuple(tuple(fixed_ms + per_token_ms * b * n for n in ns) for b in bs)
    key = {"target_fingerprint": "x", "device": "cpu", "dtype": "float32", "threads": 2, "torch": "2"}
    return BatchCostProfile(key, 128, bs, ns, ms)


def flat_acceptance(depth_max: int = 4, n_max: int = 12) -> AcceptanceProfile:
    """tau grows with depth: each level is accepted with probability 0.6."""
    tau = tuple(
        tuple(1 + sum(0.6**k for k in range(1, min(d, n) + 1)) for n in range(1, n_max + 1))
        for d in range(1, depth_max + 1)
    )
    zeros = tuple(tuple(0 for _ in range(n_max)) for _ in range(depth_max))
    return AcceptanceProfile(top_k=4, tau=tau, inexact_steps=zeros, steps=100, prompts=4, max_new_tokens=64)


def test_rule_shrinks_the_tree_and_turns_speculation_off_as_the_batch_grows():
    """Fixed 20 ms (weights) + 0.5 ms per token: at batch 1 a tree is nearly free, at batch 16 every
    node costs real work. The EAGLE rule keeps a tree at batch 1, a smaller one at 4, none at 16."""
    rule = BatchTreeRule(fake_cost(0.5, 20.0), flat_acceptance(), {d: 1.0 * d for d in range(1, 5)})
    one, four, sixteen = rule(1), rule(4), rule(16)
    assert one.depth >= 2 and one.expected_speedup > 1.3
    assert (four.total_tokens or 0) < one.total_tokens
    assert sixteen.depth == 0  # plain decoding
    table = rule.table((1, 4, 16))
    assert [row["depth"] for row in table] == [one.depth, four.depth, 0]


def test_online_rule_learns_acceptance_and_turns_off_when_drafts_fail():
    rule = BatchTreeRule(fake_cost(0.5, 20.0), max_depth=5)
    assert rule(4) == TreeCap(depth=5)  # nothing measured: the drafter's own tree
    chain = torch.arange(6)  # a chain of 5 drafts
    for _ in range(20):
        rule.observe(chain, accepted_depth=5, draft_s=0.0001)
    assert rule(1).depth == 5 and rule(1).expected_speedup > 3
    bad = BatchTreeRule(fake_cost(0.5, 20.0), max_depth=5)
    for _ in range(20):
        bad.observe(chain, accepted_depth=0, draft_s=0.0001)
    assert bad(1).depth == 0 and bad(16).depth == 0


def test_batch_cost_profile_is_measured_cached_and_refused_when_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    t = tiny_target("llama")
    p = measure_batch_cost_profile(t, batch_sizes=(1, 4), node_counts=(1, 4), context_length=16, repeats=1)
    assert p.batch_sizes == (1, 4) and len(p.verify_ms) == 2 and all(len(r) == 2 for r in p.verify_ms)
    assert BatchCostProfile.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="batch cost profile: not a version-1"):
        BatchCostProfile.from_dict({"format": "x"})
    with pytest.raises(ValueError, match="one finite positive ms"):
        BatchCostProfile(p.key, 16, (1, 4), (1, 4), ((1.0, float("nan")), (1.0, 2.0)))
    assert 0 < p.step_ms(2, 2) and p.per_row_profile(4).verify_ms[0] == pytest.approx(p.verify_ms[1][0] / 4)
    monkeypatch.setattr("selfspec.decode.tuning.batch_rule.measure_batch_cost_profile", lambda target, verifier=None: p)
    first = get_batch_cost_profile(t)
    path = next(tmp_path.rglob("batch-verify-*.json"))
    path.write_text("{broken")
    assert get_batch_cost_profile(t) == first  # unreadable cache: measured again (the stub), rewritten
    assert BatchCostProfile.from_dict(json.loads(path.read_text())) == p
