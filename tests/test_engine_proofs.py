"""tests/helpers/engines.py: a missing engine skips a developer's run and fails a run under .ci/run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.engines import REQUIRE, engine_missing


def test_a_missing_engine_skips_with_the_reason(monkeypatch):
    monkeypatch.delenv(REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="run python -m selfspec.llamacpp"):
        engine_missing("no llama.cpp build: run python -m selfspec.llamacpp")


@pytest.mark.parametrize("value, fails", [("1", True), ("0", False), ("", False)])
def test_a_missing_engine_fails_when_engines_are_required(monkeypatch, value, fails):
    monkeypatch.setenv(REQUIRE, value)
    expected = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(expected, match="no speculators venv"):
        engine_missing("no speculators venv")


def test_ci_requires_the_engines_and_runs_both_tiers():
    """``.ci/run`` builds both engines, then sets the variable and runs every tier."""
    script = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    lines = [line.strip() for line in script.splitlines() if not line.lstrip().startswith("#")]
    order = [
        next(i for i, line in enumerate(lines) if needle in line)
        for needle in ("selfspec.engine_envs", "selfspec.llamacpp", f"export {REQUIRE}=1", "-m pytest")
    ]
    assert order == sorted(order)
    assert '-m "slow or not slow"' in lines[order[-1]]
