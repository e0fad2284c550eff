"""A cost profile that can be trusted: steady medians (rounds until the spread is inside the bound, or the
measurement says the machine was busy and stays out of the cache) and costs non-decreasing in the tree size
(pool-adjacent-violators). Timings here are synthetic (an injected clock); nothing is calibrated for real."""

from __future__ import annotations

import itertools
import json
import logging
import math

import pytest
import torch

from selfspec.base.files import read_json, write_json
from selfspec.decode.tuning import costs
from selfspec.decode.tuning.costs import CostProfile
from selfspec.decode.tuning.timing import TimingRule, Timings, measure_timings, median_spread, monotone_fit


class Clock:
    """A synthetic clock: each call of a timed function advances it by the next duration of its key."""

    def __init__(self, durations_ms):
        self.now = 0.0
        self.durations = {k: iter(v) for k, v in durations_ms.items()}
        self.calls = {k: 0 for k in durations_ms}

    def timer(self) -> float:
        return self.now

    def fn(self, key):
        def call() -> None:
            self.calls[key] += 1
            self.now += next(self.durations[key]) / 1e3

        return call

    def fns(self):
        return {k: self.fn(k) for k in self.durations}


def test_monotone_fit_pools_adjacent_violators():
    assert monotone_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]  # already monotone: unchanged
    # a measured profile with 2 nodes dearer than 3: the two are pooled into their mean (4 is above it)
    fit = monotone_fit([22.8, 28.9, 24.7, 27.4, 31.7, 40.5])
    assert fit == pytest.approx([22.8, 26.8, 26.8, 27.4, 31.7, 40.5])
    # a later violation pools back across earlier blocks
    assert monotone_fit([1.0, 4.0, 3.0, 2.0]) == pytest.approx([1.0, 3.0, 3.0, 3.0])
    assert all(a <= b for a, b in itertools.pairwise(fit))
    assert monotone_fit([3.0, 1.0]) == [2.0, 2.0]
    assert monotone_fit([3.0, 1.0], weights=[1.0, 3.0]) == [1.5, 1.5]  # weighted mean
    assert monotone_fit([5.0, 4.0, 3.0, 2.0]) == [3.5] * 4
    assert monotone_fit([]) == []
    with pytest.raises(ValueError, match="positive weight"):
        monotone_fit([1.0, 2.0], weights=[1.0, 0.0])


def test_median_spread_is_the_relative_half_width_of_its_confidence_interval():
    assert median_spread([10.0] * 11) == 0.0
    assert median_spread([10.0]) == math.inf  # one sample says nothing about its spread
    # n = 11: the order statistics of ranks 3 and 9 (1-based) bound the median
    xs = [float(v) for v in range(1, 12)]  # median 6
    assert median_spread(xs) == pytest.approx((9 - 3) / (2 * 6))
    # outliers beyond the interval do not move it
    assert median_spread([*xs[:-1], 1000.0]) == median_spread(xs)
    assert median_spread([1.0, 3.0]) == pytest.approx(2 / (2 * 2))  # n = 2: the whole range


def test_steady_timings_take_one_round():
    clock = Clock({1: [10.0] * 12, 2: [12.0] * 12})
    t = measure_timings(clock.fns(), {1: 11, 2: 11}, torch.device("cpu"), TimingRule(0.03, 4), timer=clock.timer)
    assert t.medians == pytest.approx({1: 10.0, 2: 12.0}) and max(t.spreads.values()) < 1e-9
    assert t.rounds == 1 and not t.disturbed
    assert clock.calls == {1: 12, 2: 12}  # one untimed call each, then 11 timed
    assert t.seconds == pytest.approx((12 * 10 + 12 * 12) / 1e3)


def test_noisy_round_is_repeated_until_the_median_settles():
    # round 1 of size 2 is noisy (a busy moment); rounds 2 and 3 are steady, and pooling settles the median
    noisy = [12.0, 30.0, 12.0, 25.0, 12.0]
    clock = Clock({1: [10.0] * 100, 2: [12.0] + noisy + [12.0] * 100})
    rule = TimingRule(max_spread=0.05, max_rounds=4)
    t = measure_timings(clock.fns(), {1: 5, 2: 5}, torch.device("cpu"), rule, timer=clock.timer)
    assert 1 < t.rounds < 4 and not t.disturbed
    assert t.medians[2] == pytest.approx(12.0) and t.spreads[2] <= 0.05
    assert clock.calls[1] == clock.calls[2] == 1 + 5 * t.rounds  # every size re-timed, interleaved


def test_a_median_that_never_settles_marks_the_machine_busy():
    jitter = itertools.cycle([10.0, 20.0, 15.0, 40.0, 11.0])
    clock = Clock({1: jitter, 2: itertools.repeat(12.0)})
    t = measure_timings(
        clock.fns(), {1: 5, 2: 5}, torch.device("cpu"), TimingRule(max_spread=0.03, max_rounds=3), timer=clock.timer
    )
    assert t.rounds == 3 and t.disturbed and t.spreads[1] > 0.03 and t.spreads[2] < 1e-9
    with pytest.raises(ValueError, match="max_spread"):
        TimingRule(max_spread=0.0)


def key(**over):
    return {"target_fingerprint": "x", "device": "cpu", "dtype": "float32", "threads": 1, "torch": "2", **over}


def test_profile_records_fit_spread_rounds_and_seconds(tmp_path):
    p = CostProfile(
        **key(),
        context_length=128,
        node_counts=(1, 2, 3),
        verify_ms=(22.8, 26.8, 26.8),
        measured_ms=(22.8, 28.9, 24.7),
        spread=(0.01, None, 0.02),
        rounds=3,
        measure_s=7.5,
    )
    assert CostProfile.from_dict(read_json(write_json(tmp_path / "p.json", p.to_dict()))) == p
    assert p.verify_cost_ms(2.5) == 26.8
    plain = CostProfile(**key(), context_length=128, node_counts=(1, 2), verify_ms=(1.0, 2.0))
    assert plain.measured_ms == (1.0, 2.0) and plain.spread == () and plain.rounds == 0  # not measured here
    with pytest.raises(ValueError, match="one value per node count"):
        CostProfile(**key(), context_length=128, node_counts=(1, 2), verify_ms=(1.0, 2.0), spread=(0.1,))
    with pytest.raises(ValueError, match="spread"):
        CostProfile(**key(), context_length=128, node_counts=(1, 2), verify_ms=(1.0, 2.0), spread=(0.1, -1.0))
    # a profile of the previous format version is refused, so the cache measures it again (never mis-read)
    old = {**p.to_dict(), "version": 3}
    for name in ("measured_ms", "spread", "rounds", "measure_s", "disturbed"):
        del old[name]
    with pytest.raises(ValueError, match="version-4"):
        CostProfile.from_dict(old)


def test_measured_profile_is_the_monotone_fit_of_its_medians(tiny_target, monkeypatch):
    fake = {1: 10.0, 2: 14.0, 3: 12.0, 4: 13.0}

    def timings(fns, repeats, device, rule=None, desc=None):
        for fn in fns.values():
            fn()
        return Timings({k: fake[k[0]] for k in fns}, {k: 0.01 for k in fns}, rounds=2, seconds=3.25, disturbed=False)

    monkeypatch.setattr(costs, "measure_timings", timings)
    p = costs.measure_cost_profile(tiny_target, node_counts=(1, 2, 3, 4), context_length=8, kernels=("linear",))
    assert p.measured_ms == (10.0, 14.0, 12.0, 13.0)
    assert p.verify_ms == pytest.approx((10.0, 13.0, 13.0, 13.0))
    assert p.spread == (0.01,) * 4 and p.rounds == 2 and p.measure_s == 3.25 and not p.disturbed
    assert p.kernel_ms["linear"] == p.measured_ms and p.plain_step_ms == 10.0


def test_a_disturbed_profile_is_used_but_never_cached(tiny_target, monkeypatch, caplog):
    sizes = (1, 2)
    made = []

    def measure(target, node_counts, context_length, progress=False, rule=None):
        made.append(1)
        return CostProfile(
            **costs.cost_key(target),
            context_length=context_length,
            node_counts=tuple(node_counts),
            verify_ms=(1.0, 2.0),
            spread=(0.2, None),
            rounds=4,
            disturbed=True,
        )

    monkeypatch.setattr(costs, "measure_cost_profile", measure)
    monkeypatch.setattr(costs, "_PROCESS_ONLY", {})
    path = costs.cost_profile_path(tiny_target)
    path.unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger="selfspec.decode.tuning.costs"):
        p = costs.get_cost_profile(tiny_target, node_counts=sizes, context_length=16)
    assert p.disturbed and not path.exists() and "busy" in caplog.text and "20.0 %" in caplog.text
    assert costs.get_cost_profile(tiny_target, node_counts=sizes, context_length=16) is p and len(made) == 1
    costs.get_cost_profile(tiny_target, refresh=True, node_counts=sizes, context_length=16)
    assert len(made) == 2 and not path.exists()
    # a steady measurement is cached as before
    monkeypatch.setattr(
        costs,
        "measure_cost_profile",
        lambda target, node_counts, context_length, progress=False, rule=None: CostProfile(
            **costs.cost_key(target), context_length=context_length, node_counts=tuple(node_counts), verify_ms=(1, 2)
        ),
    )
    costs.get_cost_profile(tiny_target, refresh=True, node_counts=sizes, context_length=16)
    assert json.loads(path.read_text())["disturbed"] is False
