"""The engine registry: one record per engine that decodes selfspec's heads, registered once.

An engine (selfspec itself, llama.cpp, vLLM, OpenVINO GenAI) is everything ``selfspec bench --engine NAME``, the export
fidelity report (:mod:`selfspec.bench.fidelity`), the trainer comparison and the reports need of it: its display name,
the environment it runs in (a venv of :mod:`selfspec.engine_envs`, or a build), the export format its heads are
written in, the head families it drafts with, its worker script, its settings sweep, its own bench flags, and two
entry points: ``bench`` (one ``selfspec bench`` run) and ``chains`` (the fidelity report's chains of k drafts). Each
runs the one bench driver (:func:`selfspec.bench.driver.run_engine`) with its own
:class:`~selfspec.bench.driver.BenchEngine`. Code that needs something of an engine asks :func:`engine` and never
switches on the name.

The built-in engines live in their own folders (``selfspec/engines/<name>/``, the record in ``engine.py``), named in
:data:`BUILTIN_ENGINES` and imported the first time they are asked for, so importing the registry loads no engine.
A new engine is its own files plus one :func:`register_engine` call: ``tests/helpers/toy_engine.py`` is one, defined
entirely in the tests, that the bench CLI and the fidelity report run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from selfspec.base.registry import register_once

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The bench's types (BenchSettings, BenchPrompt, BenchReport) are named, not imported: the bench's modules read this
# registry (the report checks its engine names), so importing them here would close a cycle.
BenchSettings = BenchPrompt = BenchReport = Any

__all__ = [
    "BUILTIN_ENGINES",
    "DEFAULT_ENGINE",
    "Engine",
    "EngineOption",
    "EngineOutput",
    "EngineRun",
    "engine",
    "engine_title",
    "register_engine",
    "registered_engines",
    "runtime_error_of",
]

DEFAULT_ENGINE = "selfspec"
"""The engine ``selfspec bench`` runs without ``--engine``, and the one the fidelity report compares the others with:
selfspec's own decoding."""

# The built-in engines: name -> the module that defines and registers its record (imported on the first lookup).
BUILTIN_ENGINES: Mapping[str, str] = {
    DEFAULT_ENGINE: "selfspec.engines.selfspec.engine",
    "llamacpp": "selfspec.engines.llamacpp.engine",
    "vllm": "selfspec.engines.vllm.engine",
    "openvino": "selfspec.engines.openvino.engine",
}


@dataclass(frozen=True)
class EngineRun:
    """One bench call of an engine, as the bench CLI and the fidelity report make it.

    Attributes:
        target: the target as ``transformers`` loads it (an engine of its own uses it for the context limit, the stop
            ids and the near-tie check; selfspec decodes with it).
        tokenizer: its tokenizer.
        prompts: the questions (:func:`selfspec.prompts.load_prompts`).
        settings: generation settings and report metadata.
        target_name: the target as the user named it (a directory, Hub id or alias).
        heads: method name -> head directory, one method each.
        threads: the threads the user asked for (None: the engine's own default).
        options: the ``selfspec bench`` flags by their argparse names (the engine's own
            :attr:`Engine.options` among them); the fidelity report passes none.
    """

    target: PreTrainedModel
    tokenizer: Any
    prompts: Sequence[BenchPrompt]
    settings: BenchSettings
    target_name: str
    heads: Mapping[str, str]
    threads: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineOutput:
    """What one bench call returns: the report, and the engine's own records written beside it as
    ``<out>/<file name>`` (JSON), e.g. ``{"openvino.json": {...}}``."""

    report: BenchReport
    records: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineOption:
    """One ``selfspec bench`` flag of an engine's own: ``flag`` (``"--ngram"``) and the keyword arguments of
    ``argparse.ArgumentParser.add_argument`` (``help`` among them)."""

    flag: str
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class Engine:
    """One engine as the bench, the fidelity report and the reports use it.

    Attributes:
        name: the ``--engine`` value, the report's ``settings.engine`` and its methods' ``kind``.
        title: the engine's name for people (``"llama.cpp"``), in reports, summaries and model cards.
        bench: ``bench(run) -> EngineOutput``: one ``selfspec bench --engine NAME`` run. Raises ``ValueError`` or
            ``ExportError`` for what the user asked wrong (the message names the fix), ``RuntimeError`` when the engine
            itself failed (its message and log).
        chains: ``chains(run, lengths) -> BenchReport``: the fidelity report's run, greedy, ``run.heads`` one EAGLE-3
            head under several method names and ``lengths`` method -> k, each drafting a fixed chain of k tokens with no
            confidence cut, beside the engine's plain decoding; None: the engine takes no part in the report.
        missing: ``missing() -> str | None``: why the engine cannot run on this machine, naming the command that
            builds it; None when it can. Nothing is started.
        env: the venv it runs in (:data:`selfspec.engine_envs.ENGINE_ENVS`), or None.
        export_format: the ``selfspec export`` format its heads are written in (None: it decodes selfspec's own).
        families: the head families it drafts with (``head_type`` names; empty: every registered family).
        eagle31: whether it computes EAGLE-3.1 heads (``fc_norm`` / ``norm_output``); its export refuses them if not.
        worker: its worker script (a path from the repository root) or None: it runs in this process or as tools.
        sweep: the module that sweeps its settings once per machine (``--fresh-sweep`` applies), or None.
        options: its own ``selfspec bench`` flags.
        takes_methods: whether ``selfspec bench --methods`` (selfspec's built-in methods) applies to it.
        help: one line for ``selfspec bench --help``: what it runs and what it needs.
        report_lines: ``report_lines(report) -> lines``: the engine's own section of ``report.md`` (from what its
            bench added to the report); summary_lines: its own lines of the stdout summary.
    """

    name: str
    title: str
    bench: Callable[[EngineRun], EngineOutput]
    chains: Callable[[EngineRun, Mapping[str, int]], BenchReport] | None = None
    missing: Callable[[], str | None] = lambda: None
    env: str | None = None
    export_format: str | None = None
    families: tuple[str, ...] = ()
    eagle31: bool = True
    worker: str | None = None
    sweep: str | None = None
    options: tuple[EngineOption, ...] = ()
    takes_methods: bool = False
    help: str = ""
    report_lines: Callable[[BenchReport], list[str]] = lambda report: []
    summary_lines: Callable[[BenchReport], list[str]] = lambda report: []


_ENGINES: dict[str, Engine] = {}


def register_engine(record: Engine) -> Engine:
    """Register ``record`` (registering the same record again is a no-op).

    Returns:
        ``record``.

    Raises:
        ValueError: another record under the same name, or a flag another registered engine declares already.
    """
    for other in _ENGINES.values():
        taken = {o.flag for o in other.options} & {o.flag for o in record.options}
        if other.name != record.name and taken:
            raise ValueError(f"engine {record.name!r}: flags {sorted(taken)} are engine {other.name!r}'s already")
    return register_once(_ENGINES, record.name, record, "engine")


def _load_builtins() -> None:
    for module in BUILTIN_ENGINES.values():
        importlib.import_module(module)  # the module registers its engine as it runs


def registered_engines() -> tuple[str, ...]:
    """The names of every engine, the built-in ones first (``selfspec`` first of all), then those registered since."""
    _load_builtins()
    return tuple(dict.fromkeys([*BUILTIN_ENGINES, *_ENGINES]))


def engine(name: str) -> Engine:
    """The registered engine ``name``.

    Raises:
        ValueError: no engine of that name (the message lists them).
    """
    if name not in _ENGINES and name in BUILTIN_ENGINES:
        importlib.import_module(BUILTIN_ENGINES[name])
    if name not in _ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {list(registered_engines())}")
    return _ENGINES[name]


def runtime_error_of(check: Callable[[], object]) -> str | None:
    """The message of the ``RuntimeError`` that ``check()`` raises, or None when it returns: an engine's
    :attr:`Engine.missing` made from a check that raises when the engine is not built."""
    try:
        check()
    except RuntimeError as err:
        return str(err)
    return None


def engine_title(name: str) -> str:
    """The display name of the engine ``name`` (:attr:`Engine.title`), or ``name`` itself for an engine not registered
    in this process (a report written elsewhere)."""
    try:
        return engine(name).title
    except ValueError:
        return name
