"""Statistics shared by the seeded sampling tests."""

from __future__ import annotations

import math

ALPHA_Z = 3.0902  # standard normal quantile for alpha = 0.001


def chi2_critical(dof: int, z: float = ALPHA_Z) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile for ``dof`` degrees of freedom (default: the
    upper 0.001 point)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3
