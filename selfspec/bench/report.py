"""The bench report (``report.json``) as typed dataclasses.

A report is written with :func:`dataclasses.asdict` and read back with
:func:`selfspec.heads.files.read_dataclass` (the one strict reader of every selfspec file), which rebuilds the
dataclasses from their type hints and refuses what they do not describe: a missing or
unexpected key, a value of the wrong type (``bool`` is not a number; numbers are finite), a string
outside a ``Literal``. :meth:`BenchReport.check` adds the cross-references (every sample and summary has
every method, the reference is a method, categories agree).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from selfspec.heads.files import read_dataclass, read_json

SCHEMA_VERSION = 2  # 2: methods[name].tree_budget


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
    def from_dict(cls, data: Any, where: str = "") -> BenchReport:
        """Rebuild a report from its JSON layout (:func:`~selfspec.heads.files.read_dataclass`, then
        :meth:`check`); ``where`` (the file) heads the message.

        Raises:
            ValueError: listing every problem found, each with its path (``report.samples[0].results...``).
        """
        report = read_dataclass(cls, data, where, root="report")
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
    return BenchReport.from_dict(read_json(path), str(path))
