"""Timing a set of calls until their medians can be trusted, and the monotone fit of a cost curve.

Cost profiles (:mod:`selfspec.decode.tuning.costs`, :mod:`selfspec.decode.tuning.draft_costs`,
:mod:`selfspec.decode.tuning.batch_rule`) time calls of several sizes on a machine that may be busy.
:func:`measure_timings` interleaves the calls (a load change shifts every size alike) and repeats rounds until every
median's relative spread (:func:`median_spread`: the half-width of its distribution-free confidence interval) is inside
a :class:`TimingRule`'s bound, or says the machine was busy (``Timings.disturbed``). :func:`monotone_fit`
(pool-adjacent-violators, Ayer et al. 1955) makes a cost curve non-decreasing in the size.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class TimingRule:
    """When repeated timings are trusted (:func:`measure_timings`).

    Attributes:
        max_spread: the largest relative spread allowed for every median: the half-width of its distribution-free
            95 % confidence interval (order statistics, :func:`median_spread`) over the median; 0.03 = 3 %.
        max_rounds: interleaved rounds at most (each round times every call its number of repeats again, the
            samples of all rounds pooled); a median still outside the bound after them marks the machine busy.
    """

    max_spread: float = 0.03
    max_rounds: int = 4

    def __post_init__(self) -> None:
        if not self.max_spread > 0 or self.max_rounds < 1:
            raise ValueError("a timing rule needs max_spread > 0 and max_rounds >= 1")


# The rule every cost measurement uses unless given one (read at call time).
DEFAULT_TIMING_RULE = TimingRule()


@dataclass(frozen=True)
class Timings:
    """The result of :func:`measure_timings`.

    Attributes:
        medians: median wall ms of each call.
        spreads: the relative spread of each median (:func:`median_spread`).
        rounds: interleaved rounds run.
        seconds: wall seconds the whole measurement took (untimed first calls included).
        disturbed: True when some median was still outside the rule's bound after its last round (the machine
            was busy: the result is not to be cached).
    """

    medians: dict[Any, float]
    spreads: dict[Any, float]
    rounds: int
    seconds: float
    disturbed: bool


def median_spread(samples: Sequence[float]) -> float:
    """Relative spread of the median of ``samples``: half the width of its distribution-free ~95 % confidence
    interval (the order statistics of ranks ``n/2 -+ 0.98 sqrt(n)``, 1-based, clipped to the sample) over the
    median. ``inf`` for fewer than 2 samples or a non-positive median with a non-zero width (nothing can be
    trusted), 0.0 for identical samples."""
    n = len(samples)
    if n < 2:
        return math.inf
    xs = sorted(samples)
    lo = min(max(math.ceil(n / 2 - 0.98 * math.sqrt(n)), 1), n) - 1
    hi = min(max(math.floor(1 + n / 2 + 0.98 * math.sqrt(n)), 1), n) - 1
    width = xs[hi] - xs[lo]
    med = statistics.median(xs)
    if width == 0:
        return 0.0
    return width / (2 * med) if med > 0 else math.inf


def monotone_fit(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (isotonic regression by
    pool-adjacent-violators, Ayer et al. 1955): adjacent values that decrease are pooled into their weighted
    mean until none does. Values already non-decreasing are returned unchanged.

    Args:
        values: the measured costs in order of size.
        weights: positive weights, one per value; None = equal.

    Raises:
        ValueError: weights of another length, or a weight <= 0.
    """
    w = [1.0] * len(values) if weights is None else [float(x) for x in weights]
    if len(w) != len(values) or any(not x > 0 for x in w):
        raise ValueError("monotone_fit needs one positive weight per value")
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for y, wi in zip(values, w, strict=True):
        blocks.append([wi * float(y), wi, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, ww, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += ww
            blocks[-1][2] += c
    out: list[float] = []
    for s, ww, c in blocks:
        out.extend([s / ww] * int(c))
    return out


def measure_timings(
    fns: Mapping[Any, Callable[[], None]],
    repeats: Mapping[Any, int],
    device: torch.device,
    rule: TimingRule | None = None,
    desc: str | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> Timings:
    """Median wall ms of each ``fns[k]()``, timed interleaved in rounds until every median is steady.

    One untimed call each first; then a round times ``repeats[k]`` calls of each, interleaved (k1, k2, ..., k1,
    k2, ...) so that a load change on a busy machine shifts every size alike instead of biasing the sizes measured
    during it (CUDA synchronised around each call). After each round the samples of all rounds so far give each
    median and its :func:`median_spread`; rounds go on while some spread exceeds ``rule.max_spread``, up to
    ``rule.max_rounds``, after which the result is marked ``disturbed``.

    Args:
        fns: the calls, by key.
        repeats: timed calls per round, by key (>= 1).
        device: where they run.
        rule: the :class:`TimingRule`; None = :data:`DEFAULT_TIMING_RULE`.
        desc: show a tqdm progress bar with this title.
        timer: seconds, monotonic (tests inject a synthetic clock).

    Returns:
        :class:`Timings`.
    """
    rule = DEFAULT_TIMING_RULE if rule is None else rule
    start = timer()
    bar = tqdm(total=len(fns) + sum(repeats.values()), desc=desc, leave=False, disable=desc is None)
    for fn in fns.values():
        fn()
        bar.update()
    times: dict[Any, list[float]] = {k: [] for k in fns}
    rounds, spreads = 0, {k: math.inf for k in fns}
    while rounds < rule.max_rounds:
        rounds += 1
        if rounds > 1:
            bar.total += sum(repeats.values())
            bar.refresh()
        for r in range(max(repeats.values())):
            for k, fn in fns.items():
                if r >= repeats[k]:
                    continue
                _sync(device)
                t0 = timer()
                fn()
                _sync(device)
                times[k].append((timer() - t0) * 1e3)
                bar.update()
        spreads = {k: median_spread(v) for k, v in times.items()}
        if max(spreads.values()) <= rule.max_spread:
            break
    bar.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    disturbed = max(spreads.values()) > rule.max_spread
    return Timings(medians, spreads, rounds, timer() - start, disturbed)


def interleaved_medians(
    fns: Mapping[Any, Callable[[], None]], repeats: Mapping[Any, int], device: torch.device, desc: str | None = None
) -> dict[Any, float]:
    """Median wall ms of each ``fns[k]()`` over ``repeats[k]`` calls, after one untimed call each: one round of
    :func:`measure_timings` (interleaved), without the steadiness rule (drafting and batch costs)."""
    return measure_timings(fns, repeats, device, TimingRule(max_spread=math.inf, max_rounds=1), desc).medians
