"""The export tests' tiny random Llama target (tests/helpers/archs.py); their heads: tests/helpers/heads.py."""

from __future__ import annotations

import pytest

from tests.helpers.archs import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")
