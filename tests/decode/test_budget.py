"""decode/tuning/budget.py, costs.py, calibration.py: the budget choice on hand-made profiles, acceptance calibration
checked against real smaller-budget runs, cost/acceptance profile files and caching, and make_drafter's "auto"
budget."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from selfspec.api import make_drafter, make_verifier, plan_drafter
from selfspec.base import files
from selfspec.base.files import read_json, write_json
from selfspec.decode.drafters import Drafter
from selfspec.decode.drafters.block import BlockDrafter
from selfspec.decode.drafters.eagle import DEFAULT_DEPTH, DEFAULT_TOTAL_TOKENS, EagleDrafter
from selfspec.decode.kv import crop_cache, new_cache
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tuning import budget, calibration, costs, draft_costs
from selfspec.decode.tuning.calibration import AcceptanceProfile
from selfspec.decode.tuning.costs import CostProfile
from selfspec.decode.tuning.timing import Timings
from selfspec.decode.verifier import Verifier
from selfspec.decode.verify import verify_greedy
from selfspec.heads import load_heads
from selfspec.heads.config import HeadFormatError
from tests.helpers.archs import tiny_target
from tests.helpers.decoding import prompts, reference
from tests.helpers.drafters import NO_LIMIT
from tests.helpers.heads import SecondBestHead, block_head, make_eagle3, random_head

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Profiles go to a per-test cache, never to ~/.cache."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))


def cost(node_counts, verify_ms, **key) -> CostProfile:
    fields = dict(target_fingerprint="f" * 16, device="cpu test", dtype="float32", threads=1, torch=torch.__version__)
    fields.update(key)
    return CostProfile(**fields, context_length=128, node_counts=tuple(node_counts), verify_ms=tuple(verify_ms))


def acceptance(tau, top_k=2) -> AcceptanceProfile:
    tau = tuple(tuple(float(x) for x in row) for row in tau)
    return AcceptanceProfile(
        top_k=top_k,
        tau=tau,
        inexact_steps=tuple(tuple(0 for _ in r) for r in tau),
        steps=10,
        prompts=2,
        max_new_tokens=16,
    )


def choose_eagle(cost_profile, profile, draft_ms_by_depth, depth=None, total_tokens=None) -> budget.TreeSize:
    """The one chooser over the EAGLE budgets of ``profile``."""
    return budget.choose_tree(cost_profile, budget.eagle_trees(profile, draft_ms_by_depth, depth, total_tokens))


def choose_medusa(cost_profile, accuracy, max_nodes=32, draft_ms=0.0) -> budget.TreeSize:
    """The one chooser over Medusa's greedy trees."""
    return budget.choose_tree(cost_profile, budget.medusa_trees(accuracy, max_nodes, draft_ms))


# top_k 2: depth 1 creates 2 candidates, depth 2 six, depth 3 ten; the table stops at N = 6.
TAU = [
    [1.5, 1.6, 1.6, 1.6, 1.6, 1.6],
    [1.5, 1.9, 2.0, 2.1, 2.1, 2.2],
    [1.5, 1.9, 2.3, 2.4, 2.5, 2.6],
]
FLAT_DRAFT = {1: 0.0, 2: 0.0, 3: 0.0}


# ------------------------------------------------------------------------------------------------ choice


def test_interpolation_exact_at_and_between_measured_points():
    c = cost([1, 2, 4, 8], [10.0, 12.0, 16.0, 24.0])
    assert [c.verify_cost_ms(n) for n in (1, 2, 4, 8)] == [10.0, 12.0, 16.0, 24.0]
    assert c.verify_cost_ms(3) == 14.0 and c.verify_cost_ms(6) == 20.0 and c.verify_cost_ms(1.5) == 11.0
    assert c.verify_cost_ms(12) == 32.0  # beyond: the last segment's slope (2 ms a node)
    assert c.verify_cost_ms(0.5) == 10.0
    # medians that dip are followed (CPU costs are not monotone in the tree size)
    dip = cost([1, 3, 4, 6], [10.0, 14.0, 12.0, 16.0])
    assert [dip.verify_cost_ms(n) for n in (1, 2, 3, 4, 5)] == [10.0, 12.0, 14.0, 12.0, 14.0]


def test_flat_cost_picks_the_biggest_budget():
    b = choose_eagle(cost([1, 8], [10.0, 10.0]), acceptance(TAU), FLAT_DRAFT)
    assert (b.shape.depth, b.shape.tokens) == (3, 6)
    assert b.expected_tau == 2.6 and b.expected_cycle_ms == 10.0 and b.expected_speedup == pytest.approx(2.6)
    # every listed budget: N never above what the depth creates (2 at depth 1), nor the table's 6
    assert sorted((o.shape.depth, o.shape.tokens) for o in b.table) == (
        [(1, 1), (1, 2)] + [(2, n) for n in range(1, 7)] + [(3, n) for n in range(1, 7)]
    )


def test_steep_cost_picks_a_small_budget():
    # verify_ms(n) = 10 n: the (1, 1) tree (2 nodes, 20 ms) gives 1.5 / 20 = 0.075 tokens/ms; (2, 2) gives
    # 1.9 / 30 = 0.063, (3, 3) 2.3 / 40 = 0.058; and plain decoding 1 / 10 = 0.1 beats them all.
    b = choose_eagle(cost([1, 8], [10.0, 80.0]), acceptance(TAU), FLAT_DRAFT)
    assert (b.shape.depth, b.shape.tokens) == (1, 1)
    assert b.expected_cycle_ms == 20.0 and b.expected_speedup == pytest.approx(0.75)
    assert b.plain_step_ms == 10.0


def test_draft_cost_and_overrides_shift_the_choice():
    flat = cost([1, 8], [10.0, 10.0])
    # depth 3 costs 10 ms more to draft: 2.6 / 20 < 2.2 / 10, depth 2 wins
    b = choose_eagle(flat, acceptance(TAU), {1: 0.0, 2: 0.0, 3: 10.0})
    assert (b.shape.depth, b.shape.tokens) == (2, 6)
    b = choose_eagle(flat, acceptance(TAU), FLAT_DRAFT, depth=1)
    assert (b.shape.depth, b.shape.tokens) == (1, 2)
    b = choose_eagle(flat, acceptance(TAU), FLAT_DRAFT, total_tokens=3)
    assert (b.shape.depth, b.shape.tokens) == (3, 3)
    # N = 40 keeps every candidate of depths 1 and 2 (2 and 6, within the table); depth 3's 10 are not measured
    b = choose_eagle(flat, acceptance(TAU), FLAT_DRAFT, total_tokens=40)
    assert (b.shape.depth, b.shape.tokens, b.expected_tau, b.expected_cycle_ms) == (2, 40, 2.2, 10.0)
    assert {o.shape.depth for o in b.table} == {1, 2}
    # ties go to the smaller tree
    b = choose_eagle(cost([1, 8], [10.0, 10.0]), acceptance([[1.5, 1.5, 1.5, 1.5]], top_k=4), {1: 0.0})
    assert (b.shape.depth, b.shape.tokens) == (1, 1)
    with pytest.raises(ValueError, match="outside"):
        choose_eagle(flat, acceptance(TAU), FLAT_DRAFT, depth=4)
    with pytest.raises(ValueError, match="draft cost"):
        choose_eagle(flat, acceptance(TAU), {1: 0.0})


def test_table_text_marks_the_choice():
    b = choose_eagle(cost([1, 8], [10.0, 10.0]), acceptance(TAU), FLAT_DRAFT)
    text = budget.tree_table_text(b, columns=(1, 2, 4))
    assert "2.60*" in text and "2.60x*" in text and "6" in text.splitlines()[1]


# ------------------------------------------------------------------------------------------------ calibration


def first_step_tokens(target, head, ids, depth, top_k, total) -> int:
    """Tokens of the first verification step with a real drafter of that budget."""
    out = speculative_generate(target, EagleDrafter(head, target, depth, top_k, total), ids, max_new_tokens=2)
    assert out.stats.steps == 1
    return out.stats.accepted_per_step[0]


def test_calibration_predicts_smaller_budgets_exactly(oracle):
    """One step per prompt (max_new_tokens=2: prefill gives the first token): the table's tau[d][N] from
    one big-budget run equals the mean tokens of real runs with each smaller budget on the same contexts."""
    t, head = oracle
    ids = prompts(8, seed=11)
    top_k, depth_max, n_max = 3, 4, 14
    profile = calibration.calibrate_acceptance(
        t, EagleDrafter(head, t, 2, top_k, 5), ids, max_new_tokens=2, total_tokens_max=n_max, depth_max=depth_max
    )
    assert (profile.steps, profile.prompts, profile.depth_max, profile.total_tokens_max) == (8, 8, depth_max, n_max)
    assert profile.tau[-1][-1] > 2.0  # the oracle's drafts are accepted: the table is not all ones
    checked_inexact = 0
    for d in range(1, depth_max + 1):
        for n in range(1, min(n_max, calibration.num_candidates(top_k, d)) + 1):
            real = [first_step_tokens(t, head, x, d, top_k, n) for x in ids]
            if profile.inexact_steps[d - 1][n - 1] == 0:
                assert profile.tau_at(d, n) == pytest.approx(sum(real) / len(real), abs=1e-12), (d, n)
            else:
                checked_inexact += 1
                assert profile.tau_at(d, n) <= sum(real) / len(real) + 1e-12
    assert profile.inexact_steps[depth_max - 1] == (0,) * n_max  # the deepest row never keeps a dropped node


@pytest.mark.parametrize(
    "second_best, n_max, n_prompts, dropped_hits",
    [
        (False, 8, 1, False),
        (True, 8, 1, False),  # the right token is never the first branch: acceptance depends on the ranks
        (False, 4, 4, True),  # a small big budget: some smaller-depth budget keeps a node the big tree dropped
    ],
)
def test_step_acceptance_equals_real_verification_step_by_step(oracle, second_best, n_max, n_prompts, dropped_hits):
    """Multi-step: at every step of a big-budget greedy run, a fresh drafter of each smaller budget begun on
    the same context drafts a tree whose greedy verification accepts what step_acceptance predicted."""
    t, head = oracle
    if second_best:
        base = head
        head = SecondBestHead(base.config, t.config, target=t).eval()
        head.load_state_dict(base.state_dict())
    top_k, depth_max = 2, 4
    big = EagleDrafter(head, t, depth_max, top_k, n_max)
    steps = []

    class Recorder(Drafter):
        def info(self):
            return big.info()

        def begin(self, prompt_ids, hidden):
            big.begin(prompt_ids, hidden)

        def propose(self, context, sampling, generator, limit):
            self.context = context.clone()
            return big.propose(context, sampling, generator, limit)

        def accept(self, accepted):
            big.accept(accepted)

    rec = Recorder()

    def on_step(row, tree, result):
        predicted, inexact = calibration.step_acceptance(
            big.last_candidates, result.accepted_nodes, result.next_token, depth_max, n_max
        )
        steps.append((rec.context, predicted, inexact, result.num_accepted))

    for ids in prompts(n_prompts, seed=12):
        first = len(steps)
        out = speculative_generate(t, rec, ids, max_new_tokens=24, step_callback=on_step)
        assert out.tokens == reference(t, ids, 24)
        # the callback sees every step
        assert [s[3] for s in steps[first:]] == [a - 1 for a in out.stats.accepted_per_step]
    assert sum(s[3] for s in steps) >= len(steps)  # drafts are accepted: > 1 token a step on average
    # whether some budget accepts more than the big tree did (it keeps the next right token the big tree dropped)
    assert any(bool((s[1] > s[3]).any()) for s in steps) == dropped_hits
    for context, predicted, inexact, big_accepted in steps:
        assert int(predicted[depth_max - 1, n_max - 1]) == big_accepted
        cache = new_cache(t)
        verifier = Verifier(t)
        hidden = verifier.prefill(context[:-1], cache)
        for d in range(1, depth_max + 1):
            for n in range(1, min(n_max, calibration.num_candidates(top_k, d)) + 1):
                drafter = EagleDrafter(head, t, d, top_k, n)
                drafter.begin(context[:-1], hidden)
                tree = drafter.propose(context, SamplingConfig(), None, NO_LIMIT)
                logits = verifier.lm_logits(
                    verifier.forward_tree(tree.tokens, tree.parents, cache, context.numel() - 1)
                )
                crop_cache(cache, context.numel() - 1)
                real = verify_greedy(logits, tree.tokens, tree.parents).num_accepted
                if inexact[d - 1, n - 1]:
                    assert real >= int(predicted[d - 1, n - 1])
                else:
                    assert real == int(predicted[d - 1, n - 1]), (d, n)


def test_step_acceptance_hand_built():
    """Candidates (creation order) with cumulative scores; children never score above their parent.

        0 (tok 10, -0.1) -> 2 (tok 12, -0.2) -> 4 (tok 14, -0.3) -> 5 (tok 15, -0.4)
        1 (tok 11, -0.5) -> 3 (tok 13, -0.6)

    The big budget (depth 4, N 4) keeps 0, 2, 4, 5 (tree nodes 1..4).
    """
    cand = {
        "tokens": torch.tensor([10, 11, 12, 13, 14, 15]),
        "parents": torch.tensor([-1, -1, 0, 1, 2, 4]),
        "scores": torch.tensor([-0.1, -0.5, -0.2, -0.6, -0.3, -0.4]),
        "kept": torch.tensor([0, 2, 4, 5]),
    }
    # the target continues 10 12 14 15: every budget accepts its part of the path
    acc, inexact = calibration.step_acceptance(cand, torch.tensor([0, 1, 2, 3, 4]), 99, 4, 4)
    assert acc.tolist() == [[1, 1, 1, 1], [1, 2, 2, 2], [1, 2, 3, 3], [1, 2, 3, 4]] and not inexact.any()
    # 10 12 then 16, which no candidate has
    acc, inexact = calibration.step_acceptance(cand, torch.tensor([0, 1, 2]), 16, 4, 4)
    assert acc.tolist() == [[1, 1, 1, 1], [1, 2, 2, 2], [1, 2, 2, 2], [1, 2, 2, 2]] and not inexact.any()
    # the target wants 11 first: the big tree dropped candidate 1, budgets that keep it accept it. Ranks of 1:
    # among depth <= 1: 1 (kept from N = 2); depth <= 2: 2 (N >= 3), and its child 3 ranks 3, so at N = 4 the
    # target's choice after 11 is unknown: a lower bound; depth <= 3: rank 3 (N = 4), child beyond N; depth 4: 4.
    acc, inexact = calibration.step_acceptance(cand, torch.tensor([0]), 11, 4, 4)
    assert acc.tolist() == [[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert inexact.nonzero().tolist() == [[1, 3]]


def test_calibration_restores_the_drafter_and_refuses_empty_runs(oracle):
    t, head = oracle
    drafter = EagleDrafter(head, t, 2, 2, 3)
    calibration.calibrate_acceptance(t, drafter, prompts(1), max_new_tokens=4, total_tokens_max=6, depth_max=3)
    assert (drafter.depth, drafter.total_tokens) == (2, 3)
    with pytest.raises(ValueError, match="no verification step"):
        calibration.calibrate_acceptance(t, drafter, prompts(1), max_new_tokens=1)
    with pytest.raises(ValueError, match="at least one prompt"):
        calibration.calibrate_acceptance(t, drafter, [])


# ------------------------------------------------------------------------------------------------ files


def test_cost_profile_json_round_trip(tmp_path):
    c = cost([1, 2, 4], [10.0, 11.5, 13.25])
    path = write_json(tmp_path / "p.json", c.to_dict())
    assert CostProfile.from_dict(read_json(path)) == c
    data = json.loads(path.read_text())
    for broken in (
        {**data, "verify_ms": [1.0, 2.0]},
        {**data, "node_counts": [2, 1, 4]},
        {**data, "extra": 1},
        {**data, "threads": "1"},
        {**data, "version": 99},
        [1, 2],
    ):
        with pytest.raises(ValueError):
            CostProfile.from_dict(broken)


def test_cost_profile_kernel_plan_and_validation(tmp_path):
    c = cost(
        [1, 2, 4, 8, 16],
        [9.0, 11.0, 12.0, 15.0, 20.0],
        kernels=("packed", "weight_first", "packed", "linear", "weight_first"),
        kernel_ms={
            "linear": (10.0, 13.0, 14.0, 15.0, 21.0),
            "weight_first": (None, 11.0, 13.0, 16.0, 20.0),
            "packed": (9.0, 12.0, 12.0, 17.0, None),
        },
    )
    # each size follows the largest measured size at or below it; weight-first stops at 32 rows
    plan = c.kernel_plan()
    assert plan == {
        1: "packed",
        2: "weight_first",
        3: "weight_first",
        4: "packed",
        5: "packed",
        6: "packed",
        7: "packed",
        **{n: "weight_first" for n in range(16, 33)},
    }
    assert c.plain_step_ms == 10.0  # one token with plain linear, not the packed 9.0
    assert c.verify_ms_linear == (10.0, 13.0, 14.0, 15.0, 21.0)
    assert cost([1, 2], [1.0, 2.0]).kernel_plan() == {}
    assert cost([1, 2], [1.0, 2.0]).verify_ms_linear == (1.0, 2.0)  # no curves given: the curve is plain linear
    assert cost([2, 4], [3.0, 4.0]).plain_step_ms == 3.0  # 1 node not measured: the smallest size
    assert CostProfile.from_dict(read_json(write_json(tmp_path / "w.json", c.to_dict()))) == c
    with pytest.raises(ValueError, match="was not measured"):
        cost([1, 2], [1.0, 2.0], kernels=("linear", "packed"))
    with pytest.raises(ValueError, match="kernels must name"):
        cost([1, 2], [1.0, 2.0], kernels=("linear", "turbo"), kernel_ms={"turbo": (1.0, 1.0)})
    with pytest.raises(ValueError, match="kernel_ms"):
        cost([1, 2, 4], [1.0, 2.0, 3.0], kernel_ms={"linear": (1.0, 2.0)})
    with pytest.raises(ValueError, match="measured at every node count"):
        cost([1, 2], [1.0, 2.0], kernel_ms={"linear": (1.0, None)})
    old = {**c.to_dict(), "version": 2, "verify_ms_linear": [1.0] * 5, "weight_first": [2]}
    del old["kernels"], old["kernel_ms"]
    with pytest.raises(ValueError, match="version-4"):
        CostProfile.from_dict(old)  # a version-2 cache file is measured again by get_cost_profile
    with pytest.raises(ValueError, match="kernel_ms"):
        CostProfile.from_dict({**c.to_dict(), "kernel_ms": [1.0]})


def test_measure_cost_profile_keeps_the_fastest_kernel_per_size(oracle, monkeypatch):
    """Every kernel is measured where it applies (weight-first at 2..32 nodes), the fastest kept per size,
    the installed kernels restored; the timings here are made up so the choice is known."""
    t, _ = oracle
    packed = costs.available_kernels(t) == ("linear", "weight_first", "packed")
    fake = {
        (1, "linear"): 10.0,
        (2, "linear"): 13.0,
        (2, "weight_first"): 11.0,
        (4, "linear"): 14.0,
        (4, "weight_first"): 16.0,
        (40, "linear"): 30.0,
    }
    if packed:
        fake |= {(1, "packed"): 10.5, (2, "packed"): 12.0, (4, "packed"): 13.5, (40, "packed"): 29.0}
    seen = []

    def medians(fns, repeats, device, rule=None, desc=None):
        seen.append(set(fns))
        for fn in fns.values():
            fn()  # each runs a real verification, with its kernel installed
        return Timings({k: fake[k] for k in fns}, {k: 0.0 for k in fns}, 1, 0.1, False)

    monkeypatch.setattr(costs, "measure_timings", medians)
    before = {name: dict(m.__dict__) for name, m in t.named_modules()}
    p = costs.measure_cost_profile(t, node_counts=(1, 2, 4, 40), context_length=8)
    assert seen[-1] == set(fake)
    if packed:
        assert p.kernels == ("linear", "weight_first", "packed", "packed")
        assert p.verify_ms == (10.0, 11.0, 13.5, 29.0)
        assert p.kernel_ms["packed"] == (10.5, 12.0, 13.5, 29.0)
    else:
        assert p.kernels == ("linear", "weight_first", "linear", "linear")
    assert p.kernel_ms["linear"] == (10.0, 13.0, 14.0, 30.0)
    assert p.kernel_ms["weight_first"] == (None, 11.0, 16.0, None)
    # the target is untouched: no attribute, no packed copy, no forward of its own
    assert {name: dict(m.__dict__) for name, m in t.named_modules()}.keys() == before.keys()
    assert all(m.__dict__.keys() == before[name].keys() for name, m in t.named_modules())
    p = costs.measure_cost_profile(t, node_counts=(1, 2, 4, 40), context_length=8, kernels=("linear",))
    assert seen[-1] == {(1, "linear"), (2, "linear"), (4, "linear"), (40, "linear")}
    assert p.kernels == ("linear",) * 4 and set(p.kernel_ms) == {"linear"}
    with pytest.raises(ValueError, match="unknown kernel"):
        costs.measure_cost_profile(t, node_counts=(1, 2), context_length=8, kernels=("fast",))


def test_cost_profile_is_cached_and_remeasured_on_mismatch_or_corruption(oracle, monkeypatch, caplog):
    t, _ = oracle
    sizes = (1, 2, 3, 5)
    first = costs.get_cost_profile(t, node_counts=sizes, context_length=16)
    path = costs.cost_profile_path(t)
    assert path.is_file() and path.parent == files.profiles_dir() and first.node_counts == sizes
    assert first.key == costs.cost_key(t) and all(v > 0 for v in first.verify_ms)
    measured = []
    real_measure = costs.measure_cost_profile

    def counting(*args, **kwargs):
        measured.append(1)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(costs, "measure_cost_profile", counting)
    assert costs.get_cost_profile(t, node_counts=sizes, context_length=16) == first and not measured
    # a cached file measured elsewhere (here: another torch version) is never used
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "torch": "0.0.1"}))
    with caplog.at_level(logging.WARNING, logger="selfspec.decode.tuning.costs"):
        again = costs.get_cost_profile(t, node_counts=sizes, context_length=16)
    assert len(measured) == 1 and again.torch == torch.__version__ and "measuring it again" in caplog.text
    caplog.clear()
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="selfspec.decode.tuning.costs"):
        costs.get_cost_profile(t, node_counts=sizes, context_length=16)
    assert len(measured) == 2 and "unreadable" in caplog.text
    assert CostProfile.from_dict(read_json(path)).key == costs.cost_key(t)  # rewritten
    # another thread count is another machine setting: its own file
    torch.set_num_threads(2)
    try:
        assert costs.cost_profile_path(t) != path
    finally:
        torch.set_num_threads(1)
    # refresh measures even with a good file
    costs.get_cost_profile(t, refresh=True, node_counts=sizes, context_length=16)
    assert len(measured) == 3


def test_draft_cost_measured_per_depth_and_cached(oracle):
    t, head = oracle
    drafter = EagleDrafter(head, t, 3, 2, 5)
    ms = draft_costs.get_draft_cost(drafter, t, [1, 2, 3])
    assert set(ms) == {1, 2, 3} and all(v > 0 for v in ms.values()) and drafter.depth == 3
    assert draft_costs.draft_cost_path(drafter, t).is_file()
    assert draft_costs.get_draft_cost(drafter, t, [2]) == {2: ms[2]}
    draft_costs.draft_cost_path(drafter, t).write_text("[]")
    assert set(draft_costs.get_draft_cost(drafter, t, [1])) == {1}  # corrupt: re-measured, no crash


def test_block_draft_cost_measured_at_the_block_and_cached_per_head_shape(monkeypatch):
    """A block drafter's step (one position fed, the whole block run) is timed at the lengths asked, cached per
    head shape (type, block, layers), and read back without measuring; a length beyond the block is refused."""
    t = tiny_target("qwen2")
    dspark = BlockDrafter(block_head(t, "dspark", 4), t)
    ms = draft_costs.get_draft_cost(dspark, t, [1, dspark.length])
    assert set(ms) == {1, dspark.length} and all(v > 0 for v in ms.values())
    path = draft_costs.draft_cost_path(dspark, t)
    assert path.is_file() and path.name.startswith("draft-dspark-")
    with pytest.raises(ValueError, match="at most"):
        draft_costs.measure_draft_cost(dspark, t, [dspark.length + 1])
    monkeypatch.setattr(draft_costs, "measure_draft_cost", lambda *a, **k: pytest.fail("measured again"))
    assert draft_costs.get_draft_cost(dspark, t, [dspark.length]) == {dspark.length: ms[dspark.length]}
    others = {
        draft_costs.draft_cost_path(BlockDrafter(block_head(t, kind, b), t), t)
        for kind, b in [("dflash", 4), ("dspark", 6)]
    }
    assert path not in others and len(others) == 2


def test_draft_cost_file_tells_eagle31_from_eagle3():
    """EAGLE-3.1's norms are extra work a draft step pays: its cost is cached apart from an EAGLE-3 head's."""
    t = tiny_target("llama")
    paths = {
        flags: draft_costs.draft_cost_path(EagleDrafter(make_eagle3(t, **dict.fromkeys(flags, True)), t, 2, 2, 3), t)
        for flags in [(), ("fc_norm", "norm_output"), ("fc_norm",)]
    }
    assert len(set(paths.values())) == 3
    assert paths[("fc_norm", "norm_output")].name.endswith("-v40-fc_norm-norm_output.json")


@pytest.fixture
def head_dir(oracle, tmp_path):
    t, head = oracle
    d = head.save_pretrained(tmp_path / "heads")
    profile = calibration.calibrate_acceptance(
        t, EagleDrafter(head, t, 1, 2, 1), prompts(3, seed=13), max_new_tokens=8, total_tokens_max=10, depth_max=4
    )
    calibration.save_acceptance_profile(profile, d)
    return d


def test_acceptance_profile_round_trip_and_heads_still_load(oracle, head_dir):
    t, head = oracle
    profile = calibration.load_acceptance_profile(head_dir, target=t)
    assert profile is not None and profile.head_digest == calibration.head_files_digest(head_dir)
    assert profile.head_type == "eagle"  # an EAGLE-1 head (tests/decode/test_eagle_eagle3.py: "eagle3")
    assert AcceptanceProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    loaded = load_heads(head_dir, target=t)  # the extra file does not disturb the head loader
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values(), strict=True))
    assert calibration.load_acceptance_profile(head_dir.parent) is None  # no file: no profile


def test_bad_acceptance_profile_raises_head_format_error(head_dir):
    path = head_dir / calibration.ACCEPTANCE_PROFILE_NAME
    good = json.loads(path.read_text())
    shrunk = {**good, "tau": good["tau"][:-1]}
    decreasing = {**good, "tau": [row[::-1] if i == 3 else row for i, row in enumerate(good["tau"])]}
    for broken in (
        "{truncated",
        json.dumps({**good, "surprise": 1}),
        json.dumps({**good, "head_type": "medusa"}),
        json.dumps(shrunk),
        json.dumps(decreasing),
        json.dumps({**good, "steps": 0}),
        json.dumps({**good, "tau": [[0.5] * 10] * 4}),
    ):
        path.write_text(broken)
        with pytest.raises(HeadFormatError, match="selfspec tune-tree"):
            calibration.load_acceptance_profile(head_dir)


def test_profile_of_other_weights_is_ignored(oracle, head_dir, caplog):
    t, head = oracle
    head.save_pretrained(head_dir)  # same weights: same digest
    assert calibration.load_acceptance_profile(head_dir) is not None
    random_head(t).save_pretrained(head_dir)  # "retrained"
    with caplog.at_level(logging.WARNING, logger="selfspec.decode.tuning.costs"):
        assert calibration.load_acceptance_profile(head_dir) is None
    assert "other head weights" in caplog.text
    assert plan_drafter(t, head_dir).tree_budget.source == "default"


# ------------------------------------------------------------------------------------------------ wiring


def test_make_drafter_auto_budget_keeps_greedy_exact(oracle, head_dir):
    t, _ = oracle
    plan = plan_drafter(t, head_dir)  # depth / total_tokens default to "auto"
    drafter = plan.drafter
    assert plan.tree_budget.source == "auto" and plan.tree_budget.budget is not None
    b = plan.tree_budget.budget
    assert (drafter.depth, drafter.total_tokens, drafter.top_k) == (b.shape.depth, b.shape.tokens, 2)
    assert 1 <= b.shape.depth <= 4 and 1 <= b.shape.tokens <= 10 and b.expected_tau >= 1.0
    assert b.shape in {o.shape for o in b.table}
    assert costs.cost_profile_path(t).is_file()  # measured once, cached
    # verification runs the way its cost was measured
    verifier = make_verifier(t, drafter)
    assert verifier.plan == CostProfile.from_dict(read_json(costs.cost_profile_path(t))).kernel_plan()
    for ids in prompts(2, seed=14):
        assert speculative_generate(verifier, drafter, ids, max_new_tokens=20).tokens == reference(t, ids, 20)
    again = plan_drafter(t, head_dir, depth="auto", total_tokens="auto")
    assert again.tree_budget.budget == b  # from the cached profiles


def test_make_drafter_overrides_and_fallbacks(oracle, head_dir):
    t, head = oracle
    plan = plan_drafter(t, head_dir, depth=3, total_tokens=5)
    fixed = plan.drafter
    assert (fixed.depth, fixed.total_tokens, plan.tree_budget.source, plan.tree_budget.budget) == (3, 5, "given", None)
    # a given budget still verifies with the kernels the cost profile measured fastest
    assert make_verifier(t, fixed).plan == costs.get_cost_profile(t).kernel_plan()
    assert make_verifier(t, fixed, tune="off").plan == {}
    half = plan_drafter(t, head_dir, total_tokens=4)
    assert half.drafter.total_tokens == 4 and half.tree_budget.source == "auto"
    assert half.tree_budget.budget.shape.tokens == 4
    plan = plan_drafter(t, head_dir, top_k=3)  # the profile holds for top_k 2 only
    other_k = plan.drafter
    assert (other_k.depth, other_k.total_tokens, other_k.top_k, plan.tree_budget.source) == (
        DEFAULT_DEPTH,
        DEFAULT_TOTAL_TOKENS,
        3,
        "default",
    )
    plan = plan_drafter(t, head_dir, depth=9)
    too_deep = plan.drafter
    assert (too_deep.depth, too_deep.total_tokens, plan.tree_budget.source) == (9, DEFAULT_TOTAL_TOKENS, "default")
    # a module has no directory and so no profile: the default tree
    assert plan_drafter(t, head).tree_budget.source == "default"
    with pytest.raises(ValueError, match="integer or 'auto'"):
        make_drafter(t, head_dir, depth="deep")


def test_make_drafter_medusa_installs_the_measured_linears(monkeypatch):
    """Medusa heads on a CPU target verify with the linears the (cached) cost profile found faster."""
    from tests.helpers.archs import tiny_llama
    from tests.helpers.heads import random_heads

    t = tiny_llama(seed=9)
    made = cost(
        [1, 2, 4, 8],
        [10.0, 11.0, 12.0, 15.0],
        kernels=("linear", "weight_first", "linear", "linear"),
        kernel_ms={"linear": (10.0, 13.0, 12.0, 15.0), "weight_first": (None, 11.0, 13.0, 16.0)},
    )
    monkeypatch.setattr(costs, "measure_cost_profile", lambda target, *a, **k: made)
    monkeypatch.setattr(costs, "cost_key", lambda target: made.key)
    drafter = make_drafter(t, random_heads(t))
    verifier = make_verifier(t, drafter)
    assert verifier.plan == {2: "weight_first", 3: "weight_first"} and costs.cost_profile_path(t).is_file()
    ids = prompts(1, seed=4)[0]
    assert speculative_generate(verifier, drafter, ids, max_new_tokens=16).tokens == reference(t, ids, 16)


# ------------------------------------------------------------------------------------------------ Medusa


ACC = [[0.5, 0.7], [0.2, 0.3]]  # two heads, top-1 / top-2 accuracy


def test_medusa_tree_scores_and_estimated_tau_by_hand():
    from selfspec.decode.tree import greedy_tree_from_accuracy, greedy_tree_scores

    scored = greedy_tree_scores(ACC, 5)
    # marginals: head 0 [0.5, 0.2], head 1 [0.2, 0.1]; paths by score: (0,) .5, (1,) .2, (0, 0) .1, (0, 1) .05
    assert [p for p, _ in scored] == [(0,), (1,), (0, 0), (0, 1)] == greedy_tree_from_accuracy(ACC, 5)
    assert [round(x, 6) for _, x in scored] == [0.5, 0.2, 0.1, 0.05]
    flat = cost([1, 8], [10.0, 10.0])
    size = choose_medusa(flat, ACC, max_nodes=8)
    # all 6 paths of the 2x2 heads fit (a 7-node tree); tau = 1 + .5 + .2 + .1 + .05 + .04 + .02
    assert size.shape.nodes == 7 and size.expected_tau == pytest.approx(1.91)
    assert [o.shape.nodes for o in size.table] == [2, 3, 4, 5, 6, 7]
    assert (size.shape.depth, size.shape.top_k, size.shape.tokens) == (2, 2, 6)  # paths of 2 heads x top-2
    assert size.expected_speedup == pytest.approx(1.91) and size.expected_cycle_ms == 10.0


def test_medusa_tree_size_follows_the_cost_curve():
    steep = cost([1, 2, 3, 4], [10.0, 12.0, 20.0, 30.0])
    size = choose_medusa(steep, ACC)
    assert size.shape.nodes == 2 and size.expected_speedup == pytest.approx(1.5 * 10 / 12)
    # 3 nodes become cheap: tau 1.7 at 12.5 ms beats 1.5 at 12 ms
    dip = cost([1, 2, 3, 4], [10.0, 12.0, 12.5, 30.0])
    assert choose_medusa(dip, ACC).shape.nodes == 3
    assert choose_medusa(dip, ACC, draft_ms=100.0).shape.nodes == 3
    with pytest.raises(ValueError, match="accuracies"):
        choose_medusa(dip, [])
    with pytest.raises(ValueError, match="max_nodes"):
        choose_medusa(dip, ACC, max_nodes=1)


def test_make_drafter_sizes_the_medusa_tree_unless_told(monkeypatch):
    from tests.helpers.archs import tiny_llama
    from tests.helpers.heads import random_heads

    t = tiny_llama(seed=11)
    heads = random_heads(t, num_heads=2)
    import dataclasses

    heads.config = dataclasses.replace(heads.config, head_topk_accuracy=ACC)
    steep = cost([1, 2, 3, 4, 48], [10.0, 12.0, 20.0, 30.0, 99.0])
    monkeypatch.setattr(costs, "measure_cost_profile", lambda target, *a, **k: steep)
    monkeypatch.setattr(costs, "cost_key", lambda target: steep.key)
    auto = make_drafter(t, heads)
    told = make_drafter(t, heads, tree_nodes=5)
    assert auto.tree.head_index.numel() == 2 and told.tree.head_index.numel() == 5
    ids = prompts(1, seed=5)[0]
    out = speculative_generate(t, auto, ids, max_new_tokens=12)
    assert out.tokens == reference(t, ids, 12) and out.stats.tree_nodes == 2 * out.stats.steps
    out = speculative_generate(t, told, ids, max_new_tokens=12)
    assert out.tokens == reference(t, ids, 12) and out.stats.tree_nodes == 5 * out.stats.steps
