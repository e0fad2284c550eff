"""vLLM's engine record: plain vLLM (CPU build, its own venv) against each head exported to the speculators layout,
with vLLM's own acceptance counters (:mod:`selfspec.engines.vllm.bench`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from selfspec.engines.registry import Engine, EngineOption, EngineOutput, EngineRun, register_engine, runtime_error_of

if TYPE_CHECKING:
    from selfspec.bench.report import BenchReport

__all__ = ["ENGINE", "bench", "chains", "missing"]


def missing() -> str | None:
    """Why vLLM cannot run here (its venv is not built; the message names the command), or None."""
    from selfspec.engines.vllm.bench import require_env

    return runtime_error_of(require_env)


def _run(run: EngineRun, num_speculative_tokens: int | Mapping[str, int] | None) -> BenchReport:
    from selfspec.engines.vllm.bench import run_vllm_bench
    from selfspec.target import resolve_target

    return run_vllm_bench(
        run.target, run.tokenizer, run.prompts, run.settings, target_dir=resolve_target(run.target_name),
        heads=run.heads, num_speculative_tokens=num_speculative_tokens, threads=run.threads,
    )  # fmt: skip


def bench(run: EngineRun) -> EngineOutput:
    """``selfspec bench --engine vllm`` (:func:`selfspec.engines.vllm.bench.run_vllm_bench`)."""
    return EngineOutput(_run(run, run.options.get("spec_tokens")))


def chains(run: EngineRun, lengths: Mapping[str, int]) -> BenchReport:
    """``num_speculative_tokens=k`` for each method."""
    return _run(run, dict(lengths))


SPEC_TOKENS = "--engine vllm: num_speculative_tokens for every head (default: each export's own)"
HELP = (
    "vllm: plain vLLM (CPU build) against each --heads (EAGLE-3, EAGLE-3.1 or DFlash, exported to the speculators "
    "layout), with vLLM's own acceptance counters (needs `python -m selfspec.engine_envs vllm`)"
)

ENGINE = register_engine(Engine(
    "vllm", "vLLM", bench, chains, missing, env="vllm", export_format="speculators", families=("eagle3", "dflash"),
    worker="selfspec/engines/vllm/vllm_worker.py", help=HELP,
    options=(EngineOption("--spec-tokens", {"type": int, "default": None, "help": SPEC_TOKENS}),),
))  # fmt: skip
