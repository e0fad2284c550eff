"""``selfspec bench --engine llamacpp``: the same prompts, report and plots as the selfspec bench, decoded by llama.cpp.

Methods, interleaved per prompt turn in one run (the order rotated from turn to turn):

* ``llamacpp``: plain llama.cpp (``llama-completion``), the reference: what a user without speculation gets;
* ``llamacpp_loop``: ``llama-speculative-simple`` with a drafter that never fires (an n-gram drafter matching
  1024 tokens), the engine-only baseline: the speculative tool's own decoding without drafts, same prompt
  processing and arithmetic as the speculative methods, so exactness and the gain of speculation alone are
  measured against it;
* each head, exported on the fly to GGUF by llama.cpp's own converter (:func:`selfspec.export.gguf.export_gguf`;
  EAGLE-3 heads: llama.cpp's ``draft-eagle3``), through ``llama-speculative-simple``;
* llama.cpp's own n-gram drafters (``ngram_simple``, ``ngram_mod``) with settings that fire on chat prompts.

Every speculative method runs with the settings measured best on this machine
(:mod:`selfspec.engines.llamacpp.settings`; swept once and cached). tokens/s is llama.cpp's own decode timer
(prefill excluded); ``wall_s`` is the whole process, model loading included. Greedy only (``--temp 0``).

Exactness: each output's text is compared with ``llamacpp_loop``'s; texts agree when one is a prefix of the other
(``llama-speculative-simple`` may decode one token past ``-n``). Where they part, the position is the
reference's token count before the first differing character, and the difference is a near-tie when the
target's two best logits there, after the reference's prefix, are within :data:`TIE_MARGIN` (llama.cpp's
batched verification does other arithmetic than its one-token decode, so it may rightly choose the other
token): reported as such, not counted as a mismatch.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.bench.driver import BenchEngine, Outcome, Turn, compare_to_reference, run_engine, settings_record
from selfspec.bench.methods import BenchSettings
from selfspec.bench.report import (
    BenchReport,
    LlamaCppRecord,
    LlamaCppSetting,
    MethodRecord,
    MethodSummary,
    Mismatch,
    Result,
    Sample,
    SettingsRecord,
)
from selfspec.bench.ties import TIE_MARGIN, is_near_tie
from selfspec.engines.llamacpp import settings as tuning
from selfspec.export.cli import export_heads
from selfspec.families import family_of
from selfspec.heads import load_heads
from selfspec.llamacpp import Generation, LlamaCpp, build_info, completion, forward_costs, speculative_simple
from selfspec.prompts import BenchPrompt, Message, encode_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

PLAIN = "llamacpp"
LOOP = "llamacpp_loop"
NEVER_FIRES = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024", "--spec-ngram-simple-size-m", "1"]
"""``llama-speculative-simple`` arguments of a drafter that never drafts (no 1024-token n-gram repeats in a context)."""
NGRAM_METHODS = {"ngram_simple": "ngram-simple", "ngram_mod": "ngram-mod"}
PROMPT_TOKEN_SLACK = 0.02


@dataclasses.dataclass
class _Calls:
    """The llama.cpp processes a run starts, and what every call shares: the build, the target's GGUF, threads, and
    the heads' GGUFs."""

    build: LlamaCpp
    target_gguf: Path
    target_dir: Path
    threads: int
    heads: dict[str, Any]
    tmp: Path
    drafts: dict[tuple[str, str], Path] = dataclasses.field(default_factory=dict)

    def draft(self, name: str, outtype: str) -> Path:
        """The head ``name`` as llama.cpp's GGUF of ``outtype``, exported once per run."""
        if (name, outtype) not in self.drafts:
            path = export_heads(
                self.heads[name],
                "gguf",
                self.tmp / f"{name}-{outtype}",
                target_name_or_path=str(self.target_dir),
                name=name,
                outtype=outtype,
                llamacpp=self.build,
            )
            self.drafts[name, outtype] = path
        return self.drafts[name, outtype]

    def plain(self, text: str, n: int) -> Generation:
        return completion(self.build, self.target_gguf, text, n_predict=n, threads=self.threads)

    def no_draft(self, text: str, n: int) -> Generation:
        """``llama-speculative-simple`` without drafts (:data:`NEVER_FIRES`).

        Raises:
            RuntimeError: it drafted after all.
        """
        g = speculative_simple(
            self.build, self.target_gguf, text, spec_type="ngram-simple", n_predict=n, threads=self.threads,
            extra=NEVER_FIRES[2:],
        )  # fmt: skip
        if g.drafted:
            raise RuntimeError(f"the no-draft run drafted {g.drafted} tokens: {NEVER_FIRES} fired")
        return g

    def speculative(self, name: str, setting: LlamaCppSetting, text: str, n: int) -> Generation:
        draft = self.draft(name, setting.outtype or "f16") if setting.spec_type.startswith("draft-") else None
        return speculative_simple(
            self.build,
            self.target_gguf,
            text,
            spec_type=setting.spec_type,
            draft=draft,
            n_predict=n,
            threads=self.threads,
            extra=tuning.setting_args(setting, self.threads),
        )


def depth_counts(g: Generation) -> tuple[list[int], list[int]] | None:
    """``(accepted_by_depth, drafted_by_depth)`` of a speculative run from llama.cpp's per-step lines
    (:attr:`selfspec.llamacpp.Generation.draft_steps`): per position d, the steps whose accepted prefix reached
    d + 1 (accepted > d) and the steps whose draft had a token there (drafted > d), for drafts of any length (a
    confidence cut shortens some); None when nothing was drafted."""
    if not g.draft_steps:
        return None
    width = max(d for _, d in g.draft_steps)
    accepted = [sum(a > i for a, _ in g.draft_steps) for i in range(width)]
    drafted = [sum(d > i for _, d in g.draft_steps) for i in range(width)]
    return accepted, drafted


def _result(g: Generation, tokens: list[int], spec: bool, max_new_tokens: int, eos: set[int]) -> Result:
    """One llama.cpp call's record (speedups and the comparison filled later)."""
    new = min(g.new_tokens, max_new_tokens)  # llama-speculative-simple may decode one past -n
    steps = max(1, g.new_tokens - g.accepted) if spec else None
    draft_s = g.draft_seconds if spec else None
    by_depth = depth_counts(g) if spec else None
    return Result.of_call(
        tokens,
        g.wall_seconds,
        "stop" if new < max_new_tokens or (tokens and tokens[-1] in eos) else "length",
        new_tokens=new,
        tokens_per_s=g.tokens_per_second,
        tau=g.tokens_per_step if spec else None,
        steps=steps,
        accepted_by_depth=by_depth[0] if by_depth else None,
        drafted_by_depth=by_depth[1] if by_depth else None,
        tree_nodes=(g.new_tokens - g.accepted + g.drafted) if spec else None,
        prefill_s=g.prefill_seconds,
        draft_s=draft_s,
        verify_s=(g.decode_seconds - draft_s) if spec and draft_s is not None else None,
    )


def check_prompt_tokens(theirs: int, ours: int, where: str) -> None:
    """llama.cpp's token count of a prompt text against ``transformers``'. The two BPE implementations may split a
    rare stretch of text differently (a token or two, logged); more than :data:`PROMPT_TOKEN_SLACK` of the prompt
    means the GGUF's vocabulary is not the target's.

    Raises:
        RuntimeError: the counts differ by more than that.
    """
    if theirs == ours:
        return
    if abs(theirs - ours) > max(2, PROMPT_TOKEN_SLACK * ours):
        raise RuntimeError(
            f"llama.cpp tokenised prompt {where} into {theirs} tokens, transformers into {ours}: the GGUF's "
            "vocabulary is not the target's; pass the target's own GGUF (--target-gguf)"
        )
    logger.info(
        "prompt %s: llama.cpp reads %d tokens, transformers %d (the two tokenizers split it apart)", where, theirs, ours
    )


def text_difference(reference: str, other: str, tokenizer: Any) -> int | None:
    """Where ``other`` parts from ``reference``: None when one is a prefix of the other, else the number of the
    reference's tokens (``tokenizer``, no special tokens) before the first differing character."""
    if reference.startswith(other) or other.startswith(reference):
        return None
    i = next(k for k, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b)
    return len(tokenizer(reference[:i], add_special_tokens=False).input_ids)


def acceptance(samples: Sequence[Sample], method: str) -> str:
    """Accepted over drafted tokens of a llama.cpp method, summed over the samples (its results' ``steps`` are
    cycles, ``tree_nodes`` the cycles' roots plus drafts, ``tau * steps`` the tokens they produced: roots plus
    accepted drafts)."""
    records = [s.results[method] for s in samples if s.results[method].steps]
    drafted = sum((r.tree_nodes or 0) - r.steps for r in records)
    accepted = sum(round((r.tau or 1.0) * r.steps) - r.steps for r in records)
    return f"{accepted}/{drafted} drafted tokens ({accepted / drafted:.0%})" if drafted > 0 else "nothing drafted"


def _verdict(name: str, speedup: float | None, tau: float | None, costs, setting: LlamaCppSetting) -> str:
    """One sentence on a method against plain llama.cpp, with the reason from the cost decomposition if it loses."""
    if speedup is None:
        return "not measured"
    if speedup >= 1.0:
        return f"{speedup:.2f}x plain llama.cpp (tokens per step {tau or 0:.2f}) with {setting}"
    text = f"slower than plain llama.cpp ({speedup:.2f}x): no setting swept beats plain llama.cpp on this machine"
    if costs is not None and costs.break_even_tau.get(name) is not None:
        draft = costs.draft_units.get(name)
        k = min(setting.draft_max, len(costs.verify_units) - 1)
        text += (
            f"; a cycle costs {costs.break_even_tau[name]:.2f} plain steps (verification of {k + 1} tokens "
            f"{costs.verify_units[k]:.2f}, draft {draft if draft is not None else 0:.2f}) and yields {tau or 0:.2f} "
            "tokens, so it pays only above that many tokens per step"
        )
    return text


def run_llamacpp_bench(
    target: PreTrainedModel,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    *,
    build: LlamaCpp,
    target_gguf: Path,
    target_dir: Path,
    heads: Mapping[str, str | Path] | None = None,
    ngram: Sequence[str] = tuple(NGRAM_METHODS),
    threads: int = 2,
    given: Mapping[str, LlamaCppSetting] | None = None,
    fresh_sweep: bool = False,
) -> BenchReport:
    """Run plain llama.cpp, each head and llama.cpp's n-gram drafters on every prompt turn, interleaved.

    Args:
        target: the target as ``transformers`` loads it (the near-tie check and the context limit only).
        tokenizer: its tokenizer (chat template, the texts' token counts).
        prompts: the questions; later turns are conditioned on plain llama.cpp's answers.
        settings: greedy settings (``max_new_tokens``, ``warmup``, ``max_prompt_tokens``, report metadata).
        build: the llama.cpp build (:func:`selfspec.llamacpp.ensure_llamacpp`).
        target_gguf: the target's GGUF (:func:`selfspec.llamacpp.alias_gguf` for the SmolLM2 alias).
        target_dir: the target's Hugging Face directory, for the converter.
        heads: method name -> head directory (EAGLE-3, DFlash or DSpark heads: the families llama.cpp drafts with).
        ngram: which of :data:`NGRAM_METHODS` to run.
        threads: llama.cpp's threads (``-t`` / ``-tb``).
        given: method -> a fixed setting instead of the sweep's.
        fresh_sweep: measure the settings again even when a sweep is cached.

    Returns:
        The :class:`BenchReport` (``settings.engine == "llamacpp"``, ``llamacpp`` filled).

    Raises:
        ValueError: sampling asked for (llama.cpp runs greedy here), an unknown n-gram method, a taken name,
            no prompt turn fits.
        selfspec.export.common.ExportError: a head llama.cpp cannot load (not EAGLE-3 / DFlash / DSpark, a layer
            kind it lacks, another target); the message names the fix. Nothing falls back to another engine.
    """
    if settings.do_sample:
        raise ValueError("the llama.cpp bench decodes greedily (--temp 0): pass --temperature 0")
    unknown = sorted(set(ngram) - set(NGRAM_METHODS))
    if unknown:
        raise ValueError(f"unknown llama.cpp n-gram methods {unknown}; choose among {list(NGRAM_METHODS)}")
    heads = dict(heads or {})
    for name in heads:
        if name in (PLAIN, LOOP) or name in NGRAM_METHODS:
            raise ValueError(f"head method name {name!r} is taken; pass it as NAME=DIR with another name")
    loaded = {name: load_heads(path) for name, path in heads.items()}
    with tempfile.TemporaryDirectory(prefix="selfspec-llamacpp-") as tmp:
        calls = _Calls(build, Path(target_gguf), Path(target_dir), threads, loaded, Path(tmp))
        # the heads are exported now: a head llama.cpp cannot load is refused before anything is measured
        kinds = {name: (head_spec_type(loaded[name]), calls.draft(name, "f16")) for name in heads}
        kinds.update({name: (NGRAM_METHODS[name], None) for name in ngram})
        choice, chosen_by = _settings(calls, tokenizer, kinds, given, fresh_sweep)
        return _measure(target, tokenizer, prompts, settings, calls, choice, chosen_by, kinds)


def head_spec_type(head: Any) -> str:
    """llama.cpp's ``--spec-type`` of a head, its family's (:attr:`selfspec.families.Family.llamacpp_spec_type`:
    ``draft-eagle3``, ``draft-dflash``, ``draft-dspark``); a family llama.cpp has no drafter for gets ``draft-eagle3``
    and is refused by its GGUF export, which runs before anything is measured."""
    return family_of(head).llamacpp_spec_type or tuning.HEAD_SPEC_TYPE


def _render(tokenizer: Any, messages: Sequence[Message]) -> tuple[torch.Tensor, str]:
    """The text llama.cpp is given (the chat template's tokens decoded, special tokens kept) and its token ids as
    ``tokenizer`` reads that text back (decoding then encoding need not give the template's ids: the text is
    what both engines see)."""
    text = tokenizer.decode(encode_messages(tokenizer, messages), skip_special_tokens=False)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)
    return ids, text


def _settings(calls, tokenizer, kinds, given, fresh) -> tuple[tuning.SettingsChoice, str]:
    if given is not None and set(given) >= set(kinds):
        longest = max([st.draft_max for st in given.values()] + [1]) + 1
        token_ms, forward_ms = forward_costs(calls.build, calls.target_gguf, max_tokens=longest, threads=calls.threads)
        chosen = {name: given[name] for name in kinds}
        return tuning.SettingsChoice(tuning.SWEEP_VERSION, "given", chosen, {}, token_ms, forward_ms, {}), "given"
    texts = [_render(tokenizer, [{"role": "user", "content": p}])[1] for p in tuning.CALIBRATION_PROMPTS]

    def run(name: str, setting: LlamaCppSetting, text: str) -> Generation:
        return calls.speculative(name, setting, text, tuning.CALIBRATION_TOKENS)

    return tuning.choose_settings(calls.build, calls.target_gguf, texts, kinds, run, threads=calls.threads, fresh=fresh)


def _measure(target, tokenizer, prompts, settings, calls, choice, chosen_by, kinds) -> BenchReport:
    """:func:`selfspec.bench.driver.run_engine` on a :class:`LlamaCppEngine` of ``calls`` with the settings chosen."""
    engine = LlamaCppEngine(target, tokenizer, settings, calls, choice, chosen_by, kinds)
    return run_engine(engine, target, tokenizer, prompts, settings)


class LlamaCppEngine(BenchEngine):
    """llama.cpp's methods (the module docstring) on the bench driver: prompts as the chat template's text, each
    method a llama.cpp process, exactness by text against :data:`LOOP` with near-ties of the target allowed.

    Args:
        target: the target as ``transformers`` loads it (the near-tie check).
        tokenizer: its tokenizer (the prompt text, the outputs' token ids).
        settings: greedy settings (``max_new_tokens``, the stop ids).
        calls: the llama.cpp calls of the run (``plain``, ``no_draft``, ``speculative``; its ``build``,
            ``target_gguf`` and ``threads``).
        choice, chosen_by: the settings of every speculative method and where they come from.
        kinds: speculative method -> ``(--spec-type, the head's GGUF or None)``.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: Any,
        settings: BenchSettings,
        calls: _Calls,
        choice: tuning.SettingsChoice,
        chosen_by: str,
        kinds: Mapping[str, tuple[str, Path | None]],
    ) -> None:
        self.target, self.tokenizer, self.calls = target, tokenizer, calls
        self.choice, self.chosen_by, self.kinds = choice, chosen_by, kinds
        self.names = [PLAIN, LOOP, *kinds]
        self.reference, self.engine_reference = PLAIN, LOOP
        self.device = torch.device("cpu")
        self.eos = set(settings.stop_ids(target, tokenizer))
        self.draft_ms: dict[str, list[float]] = {name: [] for name in kinds}

    def prompt(self, messages: Sequence[Message]) -> tuple[torch.Tensor, str | None]:
        return _render(self.tokenizer, messages)

    def turn_seed(self, settings: BenchSettings, index: int) -> int:
        """``settings.seed``: llama.cpp runs greedy here, no turn samples."""
        return settings.seed

    def run(self, name: str, turn: Turn, settings: BenchSettings) -> Outcome:
        """One llama.cpp process, the prompt's token count checked (:func:`check_prompt_tokens`); a measured turn
        keeps a speculative method's draft time per draft call."""
        n = settings.max_new_tokens
        if name in (PLAIN, LOOP):
            g = self.calls.plain(turn.text, n) if name == PLAIN else self.calls.no_draft(turn.text, n)
        else:
            g = self.calls.speculative(name, self.choice.chosen[name], turn.text, n)
        check_prompt_tokens(g.prompt_tokens, turn.ids.numel(), f"{turn.question_id} turn {turn.turn}")
        tokens = self.tokenizer(g.text, add_special_tokens=False).input_ids[:n]
        if not turn.warmup and name in self.draft_ms and g.draft_seconds is not None and g.draft_calls:
            self.draft_ms[name].append(1000.0 * g.draft_seconds / g.draft_calls)
        return Outcome(_result(g, tokens, name not in (PLAIN, LOOP), n, self.eos), g.text)

    def compare(
        self, sample: Sample, turn: Turn, outcomes: dict[str, Outcome], settings: BenchSettings
    ) -> tuple[Sample, list[Mismatch], list[Mismatch]]:
        """Texts against :data:`LOOP`'s (the same tool's decoding without drafts; :func:`text_difference`), a
        difference at a near-tie of the target (:func:`is_near_tie`) reported apart."""
        texts = {name: outcome.text for name, outcome in outcomes.items()}
        reference = outcomes[LOOP].result.tokens
        diffs = {name: text_difference(texts[LOOP], texts[name], self.tokenizer) for name in self.names}
        return compare_to_reference(
            sample,
            PLAIN,
            LOOP,
            False,
            near_tie=lambda i: is_near_tie(self.target, turn.ids, reference, i),
            first_diff=diffs.get,
            exact_reference=LOOP,
        )

    def answer(self, outcome: Outcome, tokenizer: Any) -> str:
        """Plain llama.cpp's text as it printed it."""
        return outcome.text

    def method_records(self) -> dict[str, MethodRecord]:
        methods = {
            PLAIN: MethodRecord("llamacpp", "plain llama.cpp (llama-completion), no drafts", None),
            LOOP: MethodRecord(
                "llamacpp", "llama-speculative-simple with a drafter that never fires (no drafts)", None
            ),
        }
        for name, (spec_type, _) in self.kinds.items():
            what = "the head exported to GGUF" if spec_type.startswith("draft-") else "llama.cpp's n-gram drafter"
            methods[name] = MethodRecord("llamacpp", f"llama-speculative-simple --spec-type {spec_type} ({what})", None)
        return methods

    def settings_record(self, settings: BenchSettings) -> SettingsRecord:
        """The selfspec run's record (:func:`selfspec.bench.driver.settings_record`) with what llama.cpp does
        otherwise."""
        suffixes = self.calls.target_gguf.suffixes
        return dataclasses.replace(
            settings_record(settings, self.target, torch.device("cpu"), self.eos),
            dtype=suffixes[-2].lstrip(".") if len(suffixes) > 1 else "gguf",
            threads=self.calls.threads,
            reference=PLAIN,
            engine_reference=LOOP,
            engine="llamacpp",
            timing="llama.cpp's own decode timer (prefill excluded); wall_s is the whole process, loading included",
            memory_source="not measured (llama.cpp runs in its own process)",
        )

    def finish(self, report: BenchReport) -> BenchReport:
        """The report with its ``llamacpp`` record: the settings chosen, the sweep, the cost decomposition and a
        verdict per speculative method."""
        return dataclasses.replace(report, llamacpp=self.record(report.samples, report.summary))

    def record(self, samples: Sequence[Sample], summary: dict[str, MethodSummary]) -> LlamaCppRecord:
        """The engine's :class:`~selfspec.bench.report.LlamaCppRecord` of a finished run."""
        measured = {name: (sum(v) / len(v) if v else None) for name, v in self.draft_ms.items()}
        costs = tuning.decomposition(self.choice, measured)
        chosen = self.choice.chosen
        verdicts = {
            name: _verdict(name, summary[name].overall.speedup, summary[name].overall.tau, costs, chosen[name])
            + f"; acceptance {acceptance(samples, name)}"
            for name in self.kinds
        }
        stamp = build_info(self.calls.build)
        return LlamaCppRecord(
            build=f"{stamp.get('sdist', 'own build')} ({stamp.get('cpu', self.calls.build.root)})",
            target_gguf=self.calls.target_gguf.name,
            chosen=dict(chosen),
            chosen_by=self.chosen_by,
            sweep=dict(self.choice.sweep),
            costs=costs,
            verdicts=verdicts,
            tie_margin=TIE_MARGIN,
        )
