"""The bench report (``report.json``) as typed dataclasses.

A report is written with :func:`dataclasses.asdict` and read back with
:func:`selfspec.base.files.read_dataclass` (the one strict reader of every selfspec file), which rebuilds the
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

from selfspec.base.files import read_dataclass, read_json
from selfspec.bench.report_schema import upgrade

# 2: methods[name].tree_budget; 3: the engine reference (engine_speedup), ties, llamacpp; 4: the steps that drafted
# nothing and those the live tree rule switched drafting off (results), their share (aggregates); 5: the steps by
# tree size (results and aggregates)
SCHEMA_VERSION = 5


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
    """What a method is. ``kind``: ``"hf"`` (``transformers``), ``"custom"`` (a callable given by code), or the name
    of the engine that decoded it (:mod:`selfspec.engines.registry`: ``"selfspec"``, ``"llamacpp"``, ...)."""

    kind: str
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
        reference: the method speedups and mismatches are measured against (``transformers`` ``generate`` in
            the selfspec engine, plain llama.cpp in the llama.cpp engine).
        engine_reference: the engine's own decoding with no drafts (``no_draft``: selfspec's loop and
            kernels, one token per step; plain llama.cpp in the llama.cpp engine): ``engine_speedup`` is
            against it, the gain of speculation alone. None only in reports of schema 2, read back upgraded.
        engine: which engine decoded the methods: a name of :mod:`selfspec.engines.registry` (``"selfspec"``, ...).
        timing: what ``tokens_per_s`` divides by (the whole call's wall time, or the engine's decode timer).
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
    engine_reference: str | None
    engine: str
    timing: str
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
        engine_speedup: ``tokens_per_s`` / the engine reference's on this turn (the gain of speculation).
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
        near_tie: greedy, output differing: True when the reference's own choice at ``first_diff`` was a
            near-tie of the target (top-2 logit margin under ``llamacpp.tie_margin``), where another
            arithmetic may rightly choose otherwise: reported, not counted as a mismatch. None otherwise.
        tokens: the generated token ids.
        plain_steps: steps that verified the root alone (nothing drafted); None: no speculation stats.
        drafting_off_steps, drafting_off_s: of those, the steps (and their seconds) the live tree rule switched
            drafting off (:class:`~selfspec.decode.tuning.batch_rule.BatchTreeRule`).
        steps_by_nodes: tree size in nodes (root included, as a string) -> steps verifying a tree of that size;
            None: no speculation stats.
    """

    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float | None
    engine_speedup: float | None
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
    near_tie: bool | None
    tokens: list[int]
    plain_steps: int | None = None
    drafting_off_steps: int | None = None
    drafting_off_s: float | None = None
    steps_by_nodes: dict[str, int] | None = None

    @classmethod
    def of_call(cls, tokens: list[int], wall_s: float, finish_reason: str, **measured: Any) -> Result:
        """One engine call's record before the driver compares it: ``new_tokens`` and ``tokens_per_s`` from
        ``tokens`` and ``wall_s`` (seconds), ``peak_memory_mb`` 0.0, every other field None (the speedups and the
        comparison are the driver's to fill), unless ``measured`` gives it (``tau=..., steps=..., ...``).

        Raises:
            TypeError: a name in ``measured`` that is not a field.
        """
        fields: dict[str, Any] = dict.fromkeys(f.name for f in dataclasses.fields(cls))
        unknown = set(measured) - set(fields)
        if unknown:
            raise TypeError(f"Result has no fields {sorted(unknown)}")
        tokens = [int(t) for t in tokens]
        rate = len(tokens) / wall_s if wall_s > 0 else 0.0
        fields.update(new_tokens=len(tokens), wall_s=wall_s, tokens_per_s=rate, peak_memory_mb=0.0, tokens=tokens)
        fields.update(finish_reason=finish_reason, **measured)
        return cls(**fields)


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
        engine_speedup: median of per-turn speedups over the engine reference (the gain of speculation).
        tau: accepted tokens per verification forward, pooled over all steps.
        acceptance_by_depth: ``[d]``: sum ``accepted_by_depth[d]`` / sum ``drafted_by_depth[d]``.
        draft_share, verify_share: sum ``draft_s`` (``verify_s``) / sum ``wall_s``.
        peak_memory_mb: max ``peak_memory_mb``, MiB.
        mismatches: greedy: prompt turns whose output differs from the reference, near-ties not counted
            (:attr:`Result.near_tie`); None under sampling.
        near_ties: greedy: prompt turns whose output differs first at a near-tie; None under sampling.
        drafting_off_share: sum ``drafting_off_steps`` / sum ``steps`` (the live tree rule's steps without drafts);
            ``drafting_off_time_share``: sum ``drafting_off_s`` / sum ``wall_s``; None without speculation stats.
        steps_by_nodes: tree size in nodes (a string) -> steps, summed over the turns (the trees used); None
            without speculation stats.
    """

    num_samples: int
    median_tokens_per_s: float | None
    speedup: float | None
    engine_speedup: float | None
    tau: float | None
    acceptance_by_depth: list[float | None] | None
    draft_share: float | None
    verify_share: float | None
    peak_memory_mb: float | None
    mismatches: int | None
    near_ties: int | None
    drafting_off_share: float | None = None
    drafting_off_time_share: float | None = None
    steps_by_nodes: dict[str, int] | None = None


@dataclass(frozen=True)
class LlamaCppSetting:
    """One way of running llama.cpp's speculation (``llama-speculative-simple``).

    Attributes:
        spec_type: ``--spec-type``: ``"draft-eagle3"`` (a head exported to GGUF), ``"ngram-simple"``, ``"ngram-mod"``.
        draft_max: the longest draft per cycle: ``--spec-draft-n-max`` (heads), ``--spec-ngram-simple-size-m``
            or ``--spec-ngram-mod-n-max`` (n-gram drafts).
        p_min: heads: ``--spec-draft-p-min``, drafting stops below this top probability (0: never).
        draft_threads: heads: ``--spec-draft-threads`` (None: the target's thread count).
        outtype: heads: the converter's ``--outtype`` of the head's GGUF (``"f16"``, ``"q8_0"``).
        ngram_size: n-gram drafts: the match length (``--spec-ngram-simple-size-n`` / ``--spec-ngram-mod-n-match``).
    """

    spec_type: str
    draft_max: int
    p_min: float | None
    draft_threads: int | None
    outtype: str | None
    ngram_size: int | None


@dataclass(frozen=True)
class SweepPoint:
    """One setting measured on the sweep's calibration prompts, interleaved with plain llama.cpp.

    Attributes:
        setting: what ran.
        speedup: median over the calibration prompts of decode tokens/s over plain llama.cpp's.
        tokens_per_step: generated tokens per target verification (tau).
        acceptance: accepted / drafted tokens (None: nothing drafted).
        draft_ms_per_cycle: llama.cpp's draft timer per drafting call (None: not reported).
    """

    setting: LlamaCppSetting
    speedup: float
    tokens_per_step: float
    acceptance: float | None
    draft_ms_per_cycle: float | None


@dataclass(frozen=True)
class CostDecomposition:
    """What a llama.cpp speculation cycle costs on this machine, in target-token units (one plain decode step
    of the target = 1), from ``llama-bench`` and llama.cpp's own timers.

    Attributes:
        token_ms: one target decode step (``llama-bench -n``), ms.
        verify_units: ``[k - 1]``: one target forward over k tokens (``llama-bench -p k``, k = 1..), in
            units of ``token_ms``: the verification cost of a draft of k - 1 tokens.
        draft_units: method -> the draft cost per cycle (llama.cpp's draft timer), in units of ``token_ms``;
            None where llama.cpp reports none.
        break_even_tau: method -> the tokens per step at which a cycle of its chosen draft length costs what
            plain decoding of the same tokens does: ``draft_units + verify_units[draft_max]``.
    """

    token_ms: float
    verify_units: list[float]
    draft_units: dict[str, float | None]
    break_even_tau: dict[str, float | None]


@dataclass(frozen=True)
class LlamaCppRecord:
    """The llama.cpp engine's run: its build, the settings chosen per method and how, and the cost decomposition.

    Attributes:
        build: the ``llama-cpp-python`` sdist and CPU key of the build (``selfspec.llamacpp``).
        target_gguf: the target's GGUF file name.
        chosen: method -> the setting it decoded with.
        chosen_by: ``"sweep"`` (measured in this run), ``"cache"`` (the sweep cached for this machine) or
            ``"given"`` (fixed by the caller).
        sweep: method -> every setting measured (empty unless ``chosen_by`` is ``"sweep"`` or ``"cache"``).
        costs: the cost decomposition.
        verdicts: method -> one plain sentence: how it compares with plain llama.cpp, and why when it loses.
        tie_margin: logit margin under which the reference's choice counts as a near-tie (:attr:`Result.near_tie`).
    """

    build: str
    target_gguf: str
    chosen: dict[str, LlamaCppSetting]
    chosen_by: Literal["sweep", "cache", "given"]
    sweep: dict[str, list[SweepPoint]]
    costs: CostDecomposition | None
    verdicts: dict[str, str]
    tie_margin: float


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
        mismatches: greedy runs: every differing (method, prompt turn), near-ties excluded.
        ties: greedy runs: every (method, prompt turn) differing first at a near-tie of the target.
        summary: method name -> aggregates.
        llamacpp: the llama.cpp engine's record (None in the selfspec engine).
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
    ties: list[Mismatch]
    summary: dict[str, MethodSummary]
    llamacpp: LlamaCppRecord | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON layout: :func:`dataclasses.asdict`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> BenchReport:
        """Rebuild a report from its JSON layout (:func:`~selfspec.base.files.read_dataclass`, then
        :meth:`check`); ``where`` (the file) heads the message.

        Raises:
            ValueError: listing every problem found, each with its path (``report.samples[0].results...``).
        """
        report = read_dataclass(cls, upgrade(data), where, root="report")
        report.check()
        return report

    def check(self) -> None:
        """Raise ValueError unless every sample and summary has exactly the methods, the reference is one
        of them, categories agree, and the engine and every method's kind are known (the engines of
        :mod:`selfspec.engines.registry`, and ``"hf"`` / ``"custom"`` for a method's kind)."""
        from selfspec.engines.registry import registered_engines

        errors = []
        names = set(self.methods)
        engines = list(registered_engines())
        if self.settings.engine not in engines:
            errors.append(f"report.settings.engine must be one of {engines}, got {self.settings.engine!r}")
        kinds = ["hf", *engines, "custom"]
        errors += [
            f"methods.{name}.kind must be one of {kinds}, got {m.kind!r}"
            for name, m in self.methods.items()
            if m.kind not in kinds
        ]
        for field, name in (
            ("reference", self.settings.reference),
            ("engine_reference", self.settings.engine_reference),
        ):
            if name not in names and (field == "reference" or name is not None):
                errors.append(f"report.settings.{field}: not one of report.methods")
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
