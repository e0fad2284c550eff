"""The engine proofs' one decision when an engine is not there: skip, or fail under CI.

The export proofs run the engines themselves (the speculators package in its own venv, a llama.cpp build).
Where one cannot be had, a developer's run skips its proof with the command that provides it; ``.ci/run``
sets ``SELFSPEC_REQUIRE_ENGINES=1`` after building both, and then a missing engine fails the test, so a green
CI means the engines judged the exports.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE = "SELFSPEC_REQUIRE_ENGINES"


def engines_required() -> bool:
    """Whether ``$SELFSPEC_REQUIRE_ENGINES`` is ``1`` (as ``.ci/run`` sets it)."""
    return os.environ.get(REQUIRE, "") == "1"


def engine_missing(reason: str) -> NoReturn:
    """Skip the calling test (or fixture) because an engine is missing, or fail it when engines are required.

    Args:
        reason: what is missing and the command that provides it.

    Raises:
        pytest.fail.Exception: under ``SELFSPEC_REQUIRE_ENGINES=1``.
        pytest.skip.Exception: otherwise.
    """
    if engines_required():
        pytest.fail(f"{reason} ({REQUIRE}=1: every engine proof must run)", pytrace=False)
    pytest.skip(reason)
