"""The bench report (``report.json``) as typed dataclasses.

A report is written with :func:`dataclasses.asdict` and read back with :func:`read_dataclass`, which
rebuilds the dataclasses from their type hints and refuses what they do not describe: a missing or
unexpected key, a value of the wrong type (``bool`` is not a number; numbers are finite), a string
outside a ``Literal``. :meth:`BenchReport.check` adds the cross-references (every sample and summary has
every method, the reference is a method, categories agree).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

SCHEMA_VERSION = 2  # 2: methods[name].tree_budget

T = TypeVar("T")


@dataclass(frozen=True)
class TreeBudgetRecord:
    """EAGLE heads: the dynamic-tree budget decoded with (null in the report for other methods).

    Attributes:
        depth: draft depth.
        top_k: candidates per expansion.
        total_tokens: draft tokens kept per step (tree nodes - 1).
        chosen_by: ``"given"`` (explicit values), ``"default"`` (no acceptance profile) or ``"auto"`` (sized
            to this machine from the head's acceptance profile and measured costs).
        expected_tau: ``"auto"``: tau the acceptance profile predicts for this budget.
        expected_speedup: ``"auto"``: speedup over plain decoding the cost model predicts.
    """

    depth: int
    top_k: int
    total_tokens: int
    chosen_by: Literal["given", "default", "auto"]
    expected_tau: float | None
    expected_speedup: float | None


@dataclass(frozen=True)
class MethodRecord:
    """What a method is. ``kind``: ``"hf"``, ``"selfspec"`` or ``"custom"``."""

    kind: Literal["hf", "selfspec", "custom"]
    description: str
    tree_budget: TreeBudgetRecord | None


@dataclass(frozen=True)
class SettingsRecord:
    """How the run generated.

    Attributes:
        target: target name (or model class); dtype, device: of its parameters; threads: torch intra-op.
        max_new_tokens: cap on new tokens per prompt turn.
        do_sample: False = greedy; temperature: 0 when greedy; top_p: nucleus, 1 = off.
        top_k: always 0 (off), passed to ``transformers`` explicitly.
        seed: prompt turn i used ``seed + i``; warmup: prompts run once untimed by every method first.
        max_prompt_tokens: longer prompt turns were skipped (None = no limit).
        eos_token_ids: stop ids used by every method (sorted).
        reference: the method speedups and mismatches are measured against.
        prompts_source: prompt file or ``"sharegpt-heldout"``.
        tree_nodes: tree size asked for Medusa heads (None: default); draft_model: its name, if any.
        memory_source: what ``peak_memory_mb`` measures.
    """

    target: str
    dtype: str
    device: str
    threads: int
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    warmup: int
    max_prompt_tokens: int | None
    eos_token_ids: list[int]
    reference: str
    prompts_source: str
    tree_nodes: int | None
    draft_model: str | None
    memory_source: str


@dataclass(frozen=True)
class EnvironmentRecord:
    """Where it ran: Python, ``platform.platform()``, torch and transformers versions, ``os.cpu_count()``,
    the CUDA device name (None on CPU)."""

    python: str
    platform: str
    torch: str
    transformers: str
    cpu_count: int
    accelerator: str | None


@dataclass(frozen=True)
class Result:
    """One method on one prompt turn.

    Attributes:
        new_tokens: tokens generated (EOS included when produced).
        wall_s: seconds for the whole call, prefill included (CUDA synchronised before and after).
        tokens_per_s: ``new_tokens / wall_s``.
        speedup: ``tokens_per_s`` / the reference's ``tokens_per_s`` on this same prompt turn.
        peak_memory_mb: MiB; see ``settings.memory_source``.
        finish_reason: ``"stop"`` (EOS) or ``"length"``.
        tau: mean accepted tokens per target verification forward (None: no speculation stats).
        steps: target verification forwards after prefill.
        accepted_per_step: tokens produced by each verification step.
        accepted_by_depth: ``[d]``: steps whose accepted path reached depth d+1.
        drafted_by_depth: ``[d]``: steps whose tree had a node at depth d+1.
        tree_nodes: tree nodes verified, summed over steps.
        prefill_s, draft_s, verify_s: seconds in prefill, in the drafter, in tree verification (target
            forward, acceptance, KV compaction), by selfspec's own timers.
        matches_reference: greedy: output equals the reference's; None under sampling.
        first_diff: greedy: first position differing from the reference; None if equal or sampling.
        tokens: the generated token ids.
    """

    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float | None
    peak_memory_mb: float
    finish_reason: str
    tau: float | None
    steps: int | None
    accepted_per_step: list[int] | None
    accepted_by_depth: list[int] | None
    drafted_by_depth: list[int] | None
    tree_nodes: int | None
    prefill_s: float | None
    draft_s: float | None
    verify_s: float | None
    matches_reference: bool | None
    first_diff: int | None
    tokens: list[int]


@dataclass(frozen=True)
class Sample:
    """One prompt turn: its question, category, 1-based turn, prompt length in tokens (chat template
    included), sampling seed, and method name -> :class:`Result`."""

    question_id: str
    category: str
    turn: int
    prompt_tokens: int
    seed: int
    results: dict[str, Result]


@dataclass(frozen=True)
class Skipped:
    """A prompt turn skipped for exceeding ``max_prompt_tokens`` (later turns of the question are skipped too)."""

    question_id: str
    turn: int
    prompt_tokens: int


@dataclass(frozen=True)
class Mismatch:
    """Greedy runs: a (method, prompt turn) whose output differs from the reference's, first at
    ``first_diff``; the two tokens there (None: that output ended)."""

    method: str
    question_id: str
    category: str
    turn: int
    first_diff: int
    reference_token: int | None
    method_token: int | None


@dataclass(frozen=True)
class Aggregate:
    """One method over a set of prompt turns.

    Attributes:
        num_samples: prompt turns aggregated.
        median_tokens_per_s: median of per-turn ``tokens_per_s``.
        speedup: median of per-turn speedups (ratios measured in this run).
        tau: accepted tokens per verification forward, pooled over all steps.
        acceptance_by_depth: ``[d]``: sum ``accepted_by_depth[d]`` / sum ``drafted_by_depth[d]``.
        draft_share, verify_share: sum ``draft_s`` (``verify_s``) / sum ``wall_s``.
        peak_memory_mb: max ``peak_memory_mb``, MiB.
        mismatches: greedy: prompt turns whose output differs from the reference; None under sampling.
    """

    num_samples: int
    median_tokens_per_s: float | None
    speedup: float | None
    tau: float | None
    acceptance_by_depth: list[float | None] | None
    draft_share: float | None
    verify_share: float | None
    peak_memory_mb: float | None
    mismatches: int | None


@dataclass(frozen=True)
class MethodSummary:
    """A method's aggregates: over every prompt turn, and per category."""

    overall: Aggregate
    by_category: dict[str, Aggregate]


@dataclass(frozen=True)
class BenchReport:
    """``report.json``.

    Attributes:
        schema_version: layout version, :data:`SCHEMA_VERSION`.
        created_utc: ISO 8601 UTC time the report was made.
        settings, environment: how and where the run generated.
        methods: method name -> what it is (reference first).
        categories: categories present, sorted.
        samples: one entry per prompt turn, in run order.
        skipped: prompt turns longer than ``max_prompt_tokens``.
        mismatches: greedy runs: every differing (method, prompt turn).
        summary: method name -> aggregates.
    """

    schema_version: int
    created_utc: str
    settings: SettingsRecord
    environment: EnvironmentRecord
    methods: dict[str, MethodRecord]
    categories: list[str]
    samples: list[Sample]
    skipped: list[Skipped]
    mismatches: list[Mismatch]
    summary: dict[str, MethodSummary]

    def to_dict(self) -> dict[str, Any]:
        """The JSON layout: :func:`dataclasses.asdict`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> BenchReport:
        """Rebuild a report from its JSON layout (:func:`read_dataclass`, then :meth:`check`).

        Raises:
            ValueError: listing every problem found, each with its path (``report.samples[0].results...``).
        """
        report = read_dataclass(cls, data, "report")
        report.check()
        return report

    def check(self) -> None:
        """Raise ValueError unless every sample and summary has exactly the methods, the reference is one
        of them, and categories agree."""
        errors = []
        names = set(self.methods)
        if self.settings.reference not in names:
            errors.append("report.settings.reference: not one of report.methods")
        if set(self.summary) != names:
            errors.append("report.summary: keys differ from report.methods")
        for i, sample in enumerate(self.samples):
            if set(sample.results) != names:
                errors.append(f"report.samples[{i}].results: keys differ from report.methods")
            if sample.category not in self.categories:
                errors.append(f"report.samples[{i}].category: not in report.categories")
        for name, summ in self.summary.items():
            if set(summ.by_category) != set(self.categories):
                errors.append(f"report.summary.{name}.by_category: keys differ from report.categories")
        if errors:
            raise ValueError("invalid bench report:\n  " + "\n  ".join(errors))


def read_report(path: str | Path) -> BenchReport:
    """Read a ``report.json`` strictly (:meth:`BenchReport.from_dict`).

    Raises:
        ValueError: not JSON, or not a report of this layout (every problem listed).
    """
    return BenchReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


# --------------------------------------------------------------------------------------------------
# Strict reading


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(kind: Any) -> str:
    if kind is type(None):
        return "null"
    if typing.get_origin(kind) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(kind))
    return getattr(kind, "__name__", str(kind))


def read_dataclass(cls: type[T], data: Any, path: str = "value") -> T:
    """Build dataclass ``cls`` from JSON-like ``data`` (dicts, lists, numbers, strings, bools, None),
    following its field type hints: nested dataclasses, ``list[X]``, ``dict[str, X]``, ``X | None``,
    ``Literal[...]``, ``int``, ``float`` (an int is accepted), ``str``, ``bool``.

    Raises:
        ValueError: every missing or unexpected key, every wrong type, every non-finite number and every
            value outside a ``Literal``, one line each, with its path.
    """
    errors: list[str] = []
    value = _read(cls, data, path, errors)
    if errors:
        raise ValueError(f"invalid {cls.__name__}:\n  " + "\n  ".join(errors))
    return value


def _read(kind: Any, value: Any, path: str, errors: list[str]) -> Any:
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object ({kind.__name__}), got {type(value).__name__}")
            return None
        names = [f.name for f in dataclasses.fields(kind)]
        before = len(errors)
        errors += [f"{path}: missing key {n!r}" for n in names if n not in value]
        errors += [f"{path}: unexpected key {k!r}" for k in value if k not in names]
        hints = _hints(kind)
        fields = {n: _read(hints[n], value[n], f"{path}.{n}", errors) for n in names if n in value}
        return kind(**fields) if len(errors) == before else None
    if origin in (Union, types.UnionType):
        for option in typing.get_args(kind):
            trial: list[str] = []
            out = _read(option, value, path, trial)
            if not trial:
                return out
        wanted = " or ".join(_describe(a) for a in typing.get_args(kind))
        errors.append(f"{path}: expected {wanted}, got {type(value).__name__} {value!r:.60}")
        return None
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return None
        (item,) = typing.get_args(kind)
        return [_read(item, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return None
        _, item = typing.get_args(kind)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                errors.append(f"{path}: key {k!r} is not a string")
            out[k] = _read(item, v, f"{path}.{k}", errors)
        return out
    if origin is Literal:
        if value not in typing.get_args(kind):
            errors.append(f"{path}: {value!r} not in {list(typing.get_args(kind))}")
        return value
    ok = {
        type(None): value is None,
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        str: isinstance(value, str),
    }.get(kind)
    if ok is None:
        raise TypeError(f"read_dataclass cannot read type {kind!r} (at {path})")
    if not ok:
        errors.append(f"{path}: expected {_describe(kind)}, got {type(value).__name__} {value!r:.60}")
    return value
