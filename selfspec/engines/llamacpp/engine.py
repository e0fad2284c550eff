"""llama.cpp's engine record: plain ``llama-completion`` against each head exported to GGUF and llama.cpp's n-gram
drafters, settings swept once per machine (:mod:`selfspec.engines.llamacpp.bench`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.engines.registry import Engine, EngineOption, EngineOutput, EngineRun, register_engine

if TYPE_CHECKING:
    from selfspec.bench.report import BenchReport

__all__ = ["BUILD_COMMAND", "ENGINE", "bench", "chains", "missing"]

BUILD_COMMAND = "python -m selfspec.llamacpp"


def missing() -> str | None:
    """Why llama.cpp cannot run here (no build; the message names the command), or None."""
    from selfspec.llamacpp import find_llamacpp

    if find_llamacpp() is not None:
        return None
    return (
        f"no llama.cpp build: run `{BUILD_COMMAND}` once (about 5-12 minutes on 2 cores; needs cmake and a C++ "
        "compiler) and `pip install 'selfspec[llamacpp]'`"
    )


def _target_files(run: EngineRun) -> tuple[Path, Path]:
    """``(the target's GGUF, its Hugging Face directory)``: ``--target-gguf`` or the alias's GGUF.

    Raises:
        ValueError: no GGUF for the target (only the alias targets have one; the message says to pass one).
    """
    from selfspec.llamacpp import alias_gguf
    from selfspec.target import resolve_target

    given = run.options.get("target_gguf")
    try:
        gguf = Path(given) if given else alias_gguf(run.target_name)
    except (KeyError, FileNotFoundError) as err:
        raise ValueError(f"--engine llamacpp needs the target's GGUF: pass --target-gguf FILE ({err})") from err
    return gguf, Path(resolve_target(run.target_name))


def bench(run: EngineRun) -> EngineOutput:
    """``selfspec bench --engine llamacpp`` (:func:`selfspec.engines.llamacpp.bench.run_llamacpp_bench`)."""
    from selfspec.engines.llamacpp.bench import NGRAM_METHODS, run_llamacpp_bench
    from selfspec.llamacpp import find_llamacpp

    gguf, target_dir = _target_files(run)
    report = run_llamacpp_bench(
        run.target, run.tokenizer, run.prompts, run.settings, build=find_llamacpp(), target_gguf=gguf,
        target_dir=target_dir, heads=run.heads, ngram=run.options.get("ngram", tuple(NGRAM_METHODS)),
        threads=run.threads or 2, fresh_sweep=bool(run.options.get("fresh_sweep")),
    )  # fmt: skip
    return EngineOutput(report)


def chains(run: EngineRun, lengths: Mapping[str, int]) -> BenchReport:
    """``draft-eagle3`` with the fixed setting ``--spec-draft-n-max k --spec-draft-p-min 0`` instead of the sweep's."""
    from selfspec.engines.llamacpp.bench import run_llamacpp_bench
    from selfspec.engines.llamacpp.settings import head_setting
    from selfspec.llamacpp import find_llamacpp

    gguf, target_dir = _target_files(run)
    return run_llamacpp_bench(
        run.target, run.tokenizer, run.prompts, run.settings, build=find_llamacpp(), target_gguf=gguf,
        target_dir=target_dir, heads=run.heads, ngram=(), threads=run.threads or 2,
        given={name: head_setting(draft_max=k, p_min=0.0) for name, k in lengths.items()},
    )  # fmt: skip


OPTIONS = (
    EngineOption("--ngram", {
        "nargs": "*", "default": ["ngram_simple", "ngram_mod"], "metavar": "METHOD",
        "help": "--engine llamacpp: llama.cpp n-gram drafters to run (ngram_simple, ngram_mod; none: --ngram)",
    }),
    EngineOption("--target-gguf", {
        "default": None,
        "help": "--engine llamacpp: the target's GGUF (default: the file the smollm2-135m-instruct alias is made from)",
    }),
)  # fmt: skip
HELP = (
    "llamacpp: plain llama.cpp against each --heads (EAGLE-3, DFlash or DSpark, exported to GGUF) and llama.cpp's "
    "n-gram drafts, with settings swept once per machine (needs `python -m selfspec.llamacpp` and selfspec[llamacpp])"
)


def report_lines(report: BenchReport) -> list[str]:
    """llama.cpp's section of ``report.md`` (:mod:`selfspec.engines.llamacpp.report_text`)."""
    from selfspec.engines.llamacpp import report_text

    return report_text.report_lines(report)


def summary_lines(report: BenchReport) -> list[str]:
    """llama.cpp's verdict lines of the summary (:mod:`selfspec.engines.llamacpp.report_text`)."""
    from selfspec.engines.llamacpp import report_text

    return report_text.summary_lines(report)


ENGINE = register_engine(Engine(
    "llamacpp", "llama.cpp", bench, chains, missing, export_format="gguf", families=("eagle3", "dflash", "dspark"),
    eagle31=False, sweep="selfspec.engines.llamacpp.settings", options=OPTIONS, help=HELP,
    report_lines=report_lines, summary_lines=summary_lines,
))  # fmt: skip
