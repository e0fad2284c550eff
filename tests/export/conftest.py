"""The export tests' tiny random Llama target (tests/helpers/archs.py; their heads: tests/helpers/heads.py) and the
speculators package's venv, which judges the speculators exports."""

from __future__ import annotations

import pytest

from selfspec.export.speculators_env import build_env
from tests.helpers.archs import tiny_target
from tests.helpers.engines import engine_missing


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def spec_python():
    """The Python of the speculators package's own venv (built once per machine, about a minute)."""
    try:
        return build_env()
    except (RuntimeError, OSError) as err:
        engine_missing(
            f"the speculators environment cannot be built here ({err}); run python -m selfspec.export.speculators_env"
        )
