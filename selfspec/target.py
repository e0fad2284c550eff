"""The target loader, under the API's name: :mod:`selfspec.base.target` (training and decoding both read the
target through it, so it lives in the base layer)."""

from __future__ import annotations

from selfspec.base.target import ALIASES, SMOLLM2_ALIAS, TargetNotFoundError, load_target, resolve_target

__all__ = ["ALIASES", "SMOLLM2_ALIAS", "TargetNotFoundError", "load_target", "resolve_target"]
