"""What every engine's settings sweep shares (llama.cpp's settings, OpenVINO GenAI's draft length): the prompts it
measures on and the reading of its cache.

The prompts are fixed, so a cached sweep answers the same question on every run, and shared, so two engines' sweeps
are measured on the same text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from selfspec.base.files import read_cached, read_dataclass

__all__ = ["CALIBRATION_PROMPTS", "CALIBRATION_TOKENS", "SweepRecord", "read_sweep"]

CALIBRATION_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h? Show the steps.",
    "Rewrite this sentence in a formal tone: we gotta finish the report by friday or the boss will be mad.",
)
"""The sweep's prompts (one each of explanation, code, arithmetic, rewriting)."""
CALIBRATION_TOKENS = 64
"""New tokens of every calibration call."""


@dataclass(frozen=True)
class SweepRecord:
    """What every finished sweep (a cache file) starts with: the engine's sweep ``version`` and the ``key`` of what it
    depends on; each engine's record adds what it chose and measured."""

    version: int
    key: str


T = TypeVar("T", bound=SweepRecord)


def read_sweep(cls: type[T], path: Path, key: str, version: int, what: str) -> T | None:
    """The sweep of dataclass ``cls`` cached in ``path`` (its ``version`` and ``key`` fields must be these), or None:
    no file, one this selfspec cannot read (a warning naming ``what``), or another version or key; the caller measures
    again.

    Args:
        cls: the sweep's record (a dataclass with ``version`` and ``key`` fields).
        path: the cache file.
        key: what the sweep depends on (the engine's cache key).
        version: the engine's sweep version.
        what: the sweep's name in the warning (``"llama.cpp sweep"``).
    """
    choice: Any = read_cached(path, lambda data: read_dataclass(cls, data, str(path), root="choice"), what)
    return choice if choice is not None and choice.version == version and choice.key == key else None
