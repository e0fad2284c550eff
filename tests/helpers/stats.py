"""Statistics shared by the seeded sampling tests."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

ALPHA_Z = 3.0902  # standard normal quantile for alpha = 0.001


def chi2_critical(dof: int, z: float = ALPHA_Z) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile for ``dof`` degrees of freedom (default: the
    upper 0.001 point)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def pooled_chi2(counts: Mapping[Any, int], expected: Mapping[Any, float], n: int) -> tuple[float, int]:
    """Pearson chi-square of ``counts`` (``n`` samples in all) against the ``expected`` law (outcome ->
    probability): each outcome expected at least 5 times is its own bin, the rest are pooled into one (merged into
    the last kept bin when the pool itself is expected under 5 times). Returns ``(chi2, degrees of freedom)``."""
    big = [k for k, p in expected.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [expected[k] * n for k in big] + [n * (1 - sum(expected[k] for k in big))]
    if exp[-1] < 5:
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True)), len(obs) - 1
