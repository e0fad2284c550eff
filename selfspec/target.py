"""The target loader, under the API's name: :mod:`selfspec.train.target` (training reads the target through it, so
it lives below the API layer)."""

from __future__ import annotations

from selfspec.train.target import ALIASES, SMOLLM2_ALIAS, TargetNotFoundError, load_target, resolve_target

__all__ = ["ALIASES", "SMOLLM2_ALIAS", "TargetNotFoundError", "load_target", "resolve_target"]
