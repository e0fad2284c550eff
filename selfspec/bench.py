"""``selfspec bench``: speedup, tau and exactness against plain ``transformers`` generate, in one run.

Every method runs in the same process on the same target object, interleaved per prompt (for each
prompt turn every method runs once, in an order rotated from turn to turn so none always runs first),
after a warm-up. So the speedup of a method on a prompt is the ratio of two numbers measured minutes
apart on the same machine state, and the reported speedup is the median of those per-prompt ratios
(Spec-Bench, Xia et al. 2024, reports speedups the same way, against its own baseline in its own run).

Methods:

* ``baseline``: ``model.generate`` (``transformers``), the reference every ratio is taken against.
* ``hf_prompt_lookup``: ``model.generate(prompt_lookup_num_tokens=...)`` (``transformers``' own prompt lookup).
* ``prompt_lookup``, ``draft_model``: selfspec's own drafters through the lossless verifier.
* one method per head directory (``--heads``).
* any callable ``(prompt_ids [T], settings) -> (tokens, GenerationStats | None)`` passed by code
  (:func:`run_bench` ``methods``), e.g. a deliberately wrong method in the tests.

Prompts: an MT-bench / Spec-Bench JSONL file (``question_id``, ``category``, ``turns``); a multi-turn
question is answered turn by turn, each later turn conditioned on the *reference method's* answer to the
previous turns, so every method sees exactly the same token ids on every turn. Or ``sharegpt-heldout``:
the first user turn of every held-out ShareGPT conversation (the split training holds out).

Outputs (``--out DIR``): ``report.json`` (every per-prompt number; layout in :data:`SCHEMA`, checked by
:func:`validate_report`), ``report.md`` (tables), ``speedup.png``, ``accepted_tokens_hist.png``,
``acceptance_by_depth.png``; a short summary goes to stdout.

Usage::

    selfspec bench --prompts mt_bench.jsonl --heads runs/medusa-smollm2/heads --out runs/bench
    selfspec bench --prompts sharegpt-heldout --num-prompts 20 --temperature 0.7 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from selfspec.decode.generate import GenerationStats

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: methods[name].tree_budget
REFERENCE = "baseline"
BUILTIN_METHODS = ("baseline", "hf_prompt_lookup", "prompt_lookup", "draft_model")
DEFAULT_METHODS = ("baseline", "hf_prompt_lookup", "prompt_lookup")
SHAREGPT_HELDOUT = "sharegpt-heldout"

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


# --------------------------------------------------------------------------------------------------
# Settings, prompts, methods


@dataclass(frozen=True)
class BenchSettings:
    """How every method generates, plus what the report records about the run.

    Attributes:
        max_new_tokens: cap on new tokens per prompt turn.
        temperature: 0 = greedy (``do_sample=False``); > 0 = sampling at that temperature.
        top_p: nucleus sampling (1 = off); top-k is always off (``top_k=0``, also passed to ``transformers``).
        seed: prompt turn i of a sampling run uses seed ``seed + i`` in every method.
        warmup: prompts whose first turn every method runs once, untimed, before the measured run.
        max_prompt_tokens: prompt turns longer than this (tokens, chat template included) are skipped,
            with the rest of their question; None = no limit.
        eos_token_ids: stop ids for every method; None = the target's generation config (or tokenizer).
        reference: the method every speedup and every greedy mismatch is measured against.
        target_name, prompts_source, tree_nodes, draft_model: recorded in the report only.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    warmup: int = 1
    max_prompt_tokens: int | None = None
    eos_token_ids: tuple[int, ...] | None = None
    reference: str = REFERENCE
    target_name: str = ""
    prompts_source: str = ""
    tree_nodes: int | None = None
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; pass 1.0 for no nucleus sampling")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0

    def sampling(self):
        """The :class:`~selfspec.decode.sampling.SamplingConfig` every method decodes with."""
        from selfspec.decode.sampling import SamplingConfig

        if not self.do_sample:
            return SamplingConfig()
        return SamplingConfig(do_sample=True, temperature=self.temperature, top_k=0, top_p=self.top_p)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question.

    Attributes:
        question_id: as in the prompt file (stringified).
        category: e.g. ``"writing"``; ``"sharegpt"`` for the held-out ShareGPT prompts.
        turns: the user messages, answered one after another.
        preamble: messages placed before the first turn (e.g. a ShareGPT system message).
    """

    question_id: str
    category: str
    turns: tuple[str, ...]
    preamble: tuple[Message, ...] = ()


MethodFn = Callable[[torch.Tensor, BenchSettings], Any]
"""``fn(prompt_ids, settings) -> (tokens, stats)``: ``prompt_ids`` LongTensor ``[T]`` on the target's
device, ``settings`` with ``seed`` already set for this prompt turn; returns the new token ids (list of
int) and a :class:`GenerationStats` (None for methods without speculation statistics)."""


@dataclass(frozen=True)
class BenchMethod:
    """A named way of generating. ``kind``: ``"hf"``, ``"selfspec"`` or ``"custom"``; ``tree_budget``: the EAGLE
    tree budget in use (:func:`tree_budget_record`), None for other methods."""

    run: MethodFn
    kind: str = "custom"
    description: str = ""
    tree_budget: dict | None = None


def hf_generate_kwargs(settings: BenchSettings, eos_token_ids: Sequence[int], pad_token_id: int | None) -> dict:
    """``model.generate`` keyword arguments whose processing equals ``settings.sampling()`` in selfspec.

    Greedy passes no warper (``generate`` would warn that they are unused); sampling passes
    ``top_k=0`` explicitly (``generate`` otherwise samples with its default top-k 50) and ``min_p=0``
    (overriding a ``min_p`` the model's generation config may set). Check the result against the model's
    own generation config with :func:`check_hf_matches_sampling`.
    """
    kwargs: dict[str, Any] = {
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": settings.do_sample,
        "repetition_penalty": 1.0,
        "eos_token_id": list(eos_token_ids) or None,
        "pad_token_id": pad_token_id,
    }
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_k=0, top_p=settings.top_p, min_p=0.0)
    return kwargs


def check_hf_matches_sampling(model, kwargs: Mapping[str, Any], settings: BenchSettings) -> None:
    """Raise ValueError unless ``model.generate(**kwargs)`` processes logits as selfspec does for ``settings``.

    ``generate`` fills every argument left unset from ``model.generation_config``; a config that sets a
    processor selfspec does not apply (``no_repeat_ngram_size``, ``typical_p``, ...) would make the
    baseline decode a different distribution, so it is refused here rather than silently compared.
    """
    import copy

    from selfspec.decode.sampling import SamplingConfig

    resolved = copy.deepcopy(model.generation_config)
    resolved.update(**{k: v for k, v in kwargs.items() if k not in ("max_new_tokens", "eos_token_id", "pad_token_id")})
    theirs = SamplingConfig.from_generation_config(resolved)  # raises on unsupported processors
    ours = settings.sampling()
    same = (theirs.do_sample, theirs.repetition_penalty) == (ours.do_sample, ours.repetition_penalty)
    if ours.do_sample:
        same = same and theirs == ours
    if not same:
        raise ValueError(f"transformers generate would decode with {theirs}, selfspec with {ours}")


def hf_method(model, settings: BenchSettings, eos_token_ids: Sequence[int], pad_token_id: int | None, **extra) -> BenchMethod:
    """Plain ``model.generate`` (batch 1) with ``hf_generate_kwargs`` plus ``extra`` (e.g. prompt lookup)."""
    base = hf_generate_kwargs(settings, eos_token_ids, pad_token_id)
    check_hf_matches_sampling(model, base, settings)

    def run(prompt_ids: torch.Tensor, s: BenchSettings) -> tuple[list[int], None]:
        kwargs = dict(hf_generate_kwargs(s, eos_token_ids, pad_token_id), **extra)
        if s.do_sample:
            torch.manual_seed(s.seed)  # generate samples from torch's global generator
        ids = prompt_ids.unsqueeze(0)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, ids.shape[1] :].tolist(), None

    mode = "sampling" if settings.do_sample else "greedy"
    what = ", ".join(f"{k}={v}" for k, v in extra.items())
    return BenchMethod(run, "hf", f"transformers generate ({mode}{', ' + what if what else ''})")


def selfspec_method(spec_model, settings: BenchSettings, eos_token_ids: Sequence[int]) -> BenchMethod:
    """A :class:`~selfspec.api.SpeculativeModel` (its drafter) as a bench method."""

    def run(prompt_ids: torch.Tensor, s: BenchSettings) -> tuple[list[int], GenerationStats]:
        out = spec_model.generate(
            prompt_ids,
            s.max_new_tokens,
            do_sample=s.do_sample,
            temperature=s.temperature if s.do_sample else 1.0,
            top_k=0,
            top_p=s.top_p if s.do_sample else 1.0,
            eos_token_id=list(eos_token_ids),
            seed=s.seed,
        )
        return out.tokens, out.stats

    drafter = spec_model.drafter
    return BenchMethod(run, "selfspec", f"selfspec {type(drafter).__name__}")


def resolve_eos(target, tokenizer, settings: BenchSettings) -> list[int]:
    """Stop ids: ``settings.eos_token_ids``, else the target's generation config, else the tokenizer's."""
    if settings.eos_token_ids is not None:
        return list(settings.eos_token_ids)
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def tree_budget_record(drafter) -> dict | None:
    """What the report records of an EAGLE drafter's tree budget (None for other drafters): its ``depth``,
    ``top_k``, ``total_tokens``, how they were set (``chosen_by``: ``"given"``, ``"default"`` or ``"auto"``)
    and, when sized to the machine, the expected tau and speedup."""
    from selfspec.decode.eagle import EagleDrafter

    if not isinstance(drafter, EagleDrafter):
        return None
    budget = drafter.budget
    return {
        "depth": drafter.depth,
        "top_k": drafter.top_k,
        "total_tokens": drafter.total_tokens,
        "chosen_by": drafter.budget_source,
        "expected_tau": budget.expected_tau if budget is not None else None,
        "expected_speedup": budget.expected_speedup if budget is not None else None,
    }


def _eagle_kwargs(head: Any, options: Mapping[str, int | str] | None) -> dict[str, int | str]:
    """EAGLE drafter options, only for heads whose type is EAGLE."""
    if not options:
        return {}
    head_type = getattr(getattr(head, "config", None), "head_type", None)
    if isinstance(head, (str, Path)):
        config = Path(head) / "config.json"
        head_type = json.loads(config.read_text()).get("head_type") if config.is_file() else None
    return {k: v for k, v in options.items() if v is not None} if head_type == "eagle" else {}


def build_methods(
    target,
    tokenizer,
    settings: BenchSettings,
    *,
    methods: Sequence[str] = DEFAULT_METHODS,
    heads: Mapping[str, Any] | None = None,
    draft_model=None,
    tree_nodes: int | None = None,
    extra_methods: Mapping[str, MethodFn | BenchMethod] | None = None,
    eagle_options: Mapping[str, int | str] | None = None,
) -> dict[str, BenchMethod]:
    """The methods to compare, all sharing ``target``.

    Args:
        target: the frozen target (``transformers`` causal LM).
        tokenizer: its tokenizer (or any object with ``decode``); used for decoded text only.
        settings: generation settings (for the ``transformers`` keyword arguments and the EOS ids).
        methods: a subset of :data:`BUILTIN_METHODS`; the reference (``baseline``) is always added.
        heads: method name -> head directory or head module, each one method.
        draft_model: a loaded small causal LM (same tokenizer) for the ``draft_model`` method.
        tree_nodes: tree size for Medusa heads without an explicit tree (None = selfspec's default).
        extra_methods: more methods by name (callables or :class:`BenchMethod`), e.g. for tests.
        eagle_options: ``depth`` / ``top_k`` / ``total_tokens`` for EAGLE heads: integers, ``"auto"`` (sized
            to this machine from the head's acceptance profile) or None (= ``"auto"`` for depth and
            total_tokens, which falls back to the defaults without a profile).

    Returns:
        Ordered name -> :class:`BenchMethod`, the reference first.

    Raises:
        ValueError: unknown or duplicate method names, ``draft_model`` requested without a model.
    """
    from selfspec.api import SpeculativeModel, make_drafter

    unknown = sorted(set(methods) - set(BUILTIN_METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose among {list(BUILTIN_METHODS)}")
    if "draft_model" in methods and draft_model is None:
        raise ValueError("method 'draft_model' needs a draft model: pass --draft-model NAME")
    eos = resolve_eos(target, tokenizer, settings)
    pad = getattr(target.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else None)
    chosen = [REFERENCE] + [m for m in BUILTIN_METHODS if m in methods and m != REFERENCE]
    out: dict[str, BenchMethod] = {}
    lookup = make_drafter(target, prompt_lookup=True)
    for name in chosen:
        if name == "baseline":
            out[name] = hf_method(target, settings, eos, pad)
        elif name == "hf_prompt_lookup":
            # the same proposal length and n-gram size as selfspec's prompt lookup
            out[name] = hf_method(
                target,
                settings,
                eos,
                pad,
                prompt_lookup_num_tokens=lookup.num_tokens,
                max_matching_ngram_size=lookup.max_ngram,
            )
        elif name == "prompt_lookup":
            out[name] = selfspec_method(SpeculativeModel(target, tokenizer, lookup), settings, eos)
        elif name == "draft_model":
            drafter = make_drafter(target, draft_model=draft_model)
            out[name] = selfspec_method(SpeculativeModel(target, tokenizer, drafter), settings, eos)
    for name, head in (heads or {}).items():
        if name in out:
            raise ValueError(f"head method name {name!r} is taken; pass it as NAME=DIR with another name")
        drafter = make_drafter(target, heads=head, tree_nodes=tree_nodes, **_eagle_kwargs(head, eagle_options))
        method = selfspec_method(SpeculativeModel(target, tokenizer, drafter), settings, eos)
        source = f" from {head}" if isinstance(head, (str, Path)) else ""
        out[name] = dataclasses.replace(method, description=method.description + source,
                                        tree_budget=tree_budget_record(drafter))
    for name, fn in (extra_methods or {}).items():
        if name in out:
            raise ValueError(f"extra method name {name!r} is taken")
        out[name] = fn if isinstance(fn, BenchMethod) else BenchMethod(fn, "custom", "custom method")
    return out


# --------------------------------------------------------------------------------------------------
# Prompts


def load_jsonl_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read an MT-bench / Spec-Bench question file: one JSON object a line with ``question_id``,
    ``category`` and ``turns`` (list of user messages). Other keys (``reference`` ...) are ignored.

    Raises:
        ValueError: a line is not JSON or lacks ``turns`` (the message names the line).
    """
    prompts = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno} is not a JSON object: {err}") from err
        turns = record.get("turns") if isinstance(record, dict) else None
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(
                f"{path}:{lineno} needs 'turns': a non-empty list of strings (MT-bench layout: "
                "question_id, category, turns)"
            )
        qid = record.get("question_id", lineno)
        prompts.append(BenchPrompt(str(qid), str(record.get("category", "default")), tuple(turns)))
    return prompts


def load_sharegpt_heldout() -> list[BenchPrompt]:
    """The first user turn of every held-out ShareGPT conversation.

    The split is the one training holds out: :class:`~selfspec.train.config.TrainConfig`'s defaults
    ``max_conversations``, ``eval_fraction`` and ``seed`` (3000, 0.05, 0 at the time of writing).
    """
    from selfspec.train.config import TrainConfig
    from selfspec.train.data import load_conversations, prompt_messages, split_conversations

    cfg = TrainConfig()
    conversations = load_conversations("sharegpt", max_conversations=cfg.max_conversations)
    _, heldout = split_conversations(conversations, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    prompts = []
    for conv in heldout:
        messages = prompt_messages(conv)
        if not messages or messages[-1]["role"] != "user":
            continue
        prompts.append(BenchPrompt(str(conv["id"]), "sharegpt", (messages[-1]["content"],), tuple(messages[:-1])))
    return prompts


def load_prompts(
    source: str, num_prompts: int | None = None, max_turns: int | None = None, per_category: int | None = None
) -> list[BenchPrompt]:
    """Prompts from a JSONL path or ``"sharegpt-heldout"``.

    Args:
        source: the file or ``"sharegpt-heldout"``.
        num_prompts: keep the first N after the other filters (None = all).
        max_turns: keep only the first ``max_turns`` turns of each question (1 = first turns only).
        per_category: keep the first N questions of each category, in file order.
    """
    prompts = load_sharegpt_heldout() if source == SHAREGPT_HELDOUT else load_jsonl_prompts(source)
    if max_turns is not None:
        prompts = [dataclasses.replace(p, turns=p.turns[:max_turns]) for p in prompts]
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for prompt in prompts:
            seen[prompt.category] = seen.get(prompt.category, 0) + 1
            if seen[prompt.category] <= per_category:
                kept.append(prompt)
        prompts = kept
    return prompts[:num_prompts] if num_prompts is not None else prompts


def encode_messages(tokenizer, messages: Sequence[Message]) -> torch.Tensor:
    """Render chat messages with the tokenizer's chat template plus the generation prompt: LongTensor ``[T]``."""
    enc = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_dict=True)
    return torch.tensor(list(enc["input_ids"]), dtype=torch.long)


# --------------------------------------------------------------------------------------------------
# The run


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset (MiB); CPU: the process's peak RSS so far (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def memory_source(device: torch.device) -> str:
    """What ``peak_memory_mb`` measures on ``device``."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, reset before each call (per method)"
    return "resource.getrusage ru_maxrss: the process's high-water mark, shared by all methods"


def _timed(method: BenchMethod, prompt_ids: torch.Tensor, settings: BenchSettings, device: torch.device):
    """Run one method once. Returns ``(tokens, stats | None, wall_s, peak_memory_mb)``; CUDA is synchronised
    before and after so ``wall_s`` covers the GPU work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    result = method.run(prompt_ids, settings)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - t0
    tokens, stats = result if isinstance(result, tuple) else (result, None)
    return [int(t) for t in tokens], stats, wall_s, _peak_memory_mb(device)


def first_difference(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (the shorter length if one is a prefix
    of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def _result_record(tokens, stats: GenerationStats | None, wall_s: float, memory_mb: float, eos: set[int]) -> dict:
    rec: dict[str, Any] = {
        "new_tokens": len(tokens),
        "wall_s": wall_s,
        "tokens_per_s": len(tokens) / wall_s if wall_s > 0 else 0.0,
        "speedup": None,
        "peak_memory_mb": memory_mb,
        "finish_reason": "stop" if tokens and tokens[-1] in eos else "length",
        "tau": None,
        "steps": None,
        "accepted_per_step": None,
        "accepted_by_depth": None,
        "drafted_by_depth": None,
        "tree_nodes": None,
        "prefill_s": None,
        "draft_s": None,
        "verify_s": None,
        "matches_reference": None,
        "first_diff": None,
        "tokens": list(tokens),
    }
    if stats is not None:
        rec.update(
            tau=stats.mean_accepted_tokens if stats.steps else None,
            steps=stats.steps,
            accepted_per_step=list(stats.accepted_per_step),
            accepted_by_depth=list(stats.accepted_by_depth),
            drafted_by_depth=list(stats.drafted_by_depth),
            tree_nodes=stats.tree_nodes,
            prefill_s=stats.prefill_s,
            draft_s=stats.draft_s,
            verify_s=stats.verify_s,
            finish_reason=stats.finish_reason,
        )
    return rec


def run_bench(
    target,
    tokenizer,
    methods: Mapping[str, BenchMethod | MethodFn],
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
) -> dict:
    """Run every method on every prompt turn, interleaved, and return the report (see :data:`SCHEMA`).

    Args:
        target: the frozen target; only its device, dtype and generation config are read here.
        tokenizer: renders messages (``apply_chat_template``) and decodes the reference answers that
            later turns are conditioned on (``decode``).
        methods: name -> :class:`BenchMethod` or a bare callable ``(prompt_ids [T], settings) ->
            (tokens, GenerationStats | None)``; must include ``settings.reference``.
        prompts: the questions.
        settings: generation settings and report metadata.

    Returns:
        The report dict (valid under :func:`validate_report`).

    Raises:
        ValueError: the reference method is missing, or no prompt turn fits ``max_prompt_tokens``.
    """
    methods = {n: m if isinstance(m, BenchMethod) else BenchMethod(m, "custom", "custom method") for n, m in methods.items()}
    if settings.reference not in methods:
        raise ValueError(f"methods must include the reference {settings.reference!r}: speedups are ratios to it")
    device = _device(target)
    eos = set(resolve_eos(target, tokenizer, settings))
    names = list(methods)

    for prompt in prompts[: settings.warmup]:
        ids = encode_messages(tokenizer, [*prompt.preamble, {"role": "user", "content": prompt.turns[0]}]).to(device)
        for name in names:
            _timed(methods[name], ids, settings, device)
            logger.info("warm-up %s done", name)

    samples: list[dict] = []
    skipped: list[dict] = []
    mismatches: list[dict] = []
    for prompt in prompts:
        history: list[Message] = list(prompt.preamble)
        for turn, text in enumerate(prompt.turns, start=1):
            messages = history + [{"role": "user", "content": text}]
            ids = encode_messages(tokenizer, messages).to(device)
            if settings.max_prompt_tokens is not None and ids.numel() > settings.max_prompt_tokens:
                skipped.append({"question_id": prompt.question_id, "turn": turn, "prompt_tokens": ids.numel()})
                break
            seed = settings.seed + len(samples)
            call_settings = dataclasses.replace(settings, seed=seed)
            k = len(samples) % len(names)
            results = {}
            for name in names[k:] + names[:k]:
                results[name] = _result_record(*_timed(methods[name], ids, call_settings, device), eos)
            sample = {
                "question_id": prompt.question_id,
                "category": prompt.category,
                "turn": turn,
                "prompt_tokens": ids.numel(),
                "seed": seed,
                "results": {name: results[name] for name in names},
            }
            mismatches += _compare_to_reference(sample, settings)
            samples.append(sample)
            ref_tokens = results[settings.reference]["tokens"]
            logger.info(
                "%s turn %d: %s", prompt.question_id, turn,
                ", ".join(f"{n} {r['tokens_per_s']:.1f} tok/s" for n, r in sample["results"].items()),
            )
            answer = tokenizer.decode(ref_tokens, skip_special_tokens=True)
            history = messages + [{"role": "assistant", "content": answer}]
    if not samples:
        raise ValueError("no prompt turn was run: every prompt is longer than max_prompt_tokens, or no prompts")

    categories = sorted({s["category"] for s in samples})
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": _settings_record(settings, target, device, eos),
        "environment": _environment(device),
        "methods": {n: {"kind": m.kind, "description": m.description, "tree_budget": m.tree_budget}
                    for n, m in methods.items()},
        "categories": categories,
        "samples": samples,
        "skipped": skipped,
        "mismatches": mismatches,
        "summary": {n: summarize(samples, n, categories, settings.do_sample) for n in names},
    }


def _compare_to_reference(sample: dict, settings: BenchSettings) -> list[dict]:
    """Fill ``speedup`` (always) and ``matches_reference`` / ``first_diff`` (greedy) for one sample."""
    results = sample["results"]
    ref = results[settings.reference]
    found = []
    for name, rec in results.items():
        rec["speedup"] = rec["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] > 0 else None
        if settings.do_sample:
            continue  # sampled outputs legitimately differ; losslessness is a distribution property
        diff = first_difference(ref["tokens"], rec["tokens"])
        rec["matches_reference"] = diff is None
        rec["first_diff"] = diff
        if diff is not None:
            found.append(
                {
                    "method": name,
                    "question_id": sample["question_id"],
                    "category": sample["category"],
                    "turn": sample["turn"],
                    "first_diff": diff,
                    "reference_token": _token_at(ref["tokens"], diff),
                    "method_token": _token_at(rec["tokens"], diff),
                }
            )
    return found


def _token_at(tokens: Sequence[int], i: int) -> int | None:
    return tokens[i] if i < len(tokens) else None


def _settings_record(settings: BenchSettings, target, device: torch.device, eos: set[int]) -> dict:
    return {
        "target": settings.target_name or type(target).__name__,
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": settings.do_sample,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": 0,
        "seed": settings.seed,
        "warmup": settings.warmup,
        "max_prompt_tokens": settings.max_prompt_tokens,
        "eos_token_ids": sorted(eos),
        "reference": settings.reference,
        "prompts_source": settings.prompts_source,
        "tree_nodes": settings.tree_nodes,
        "draft_model": settings.draft_model,
        "memory_source": memory_source(device),
    }


def _environment(device: torch.device) -> dict:
    import os

    import transformers

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count() or 0,
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(samples: Sequence[dict], method: str, categories: Sequence[str], do_sample: bool) -> dict:
    """Aggregate one method: ``{"overall": {...}, "by_category": {category: {...}}}`` (see :data:`SCHEMA`)."""
    return {
        "overall": _aggregate([s["results"][method] for s in samples], do_sample),
        "by_category": {
            c: _aggregate([s["results"][method] for s in samples if s["category"] == c], do_sample) for c in categories
        },
    }


def _aggregate(records: Sequence[dict], do_sample: bool) -> dict:
    with_stats = [r for r in records if r["steps"] is not None]
    steps = sum(r["steps"] for r in with_stats)
    wall = sum(r["wall_s"] for r in with_stats)
    depth = max((len(r["drafted_by_depth"]) for r in with_stats), default=0)
    accepted = [sum(r["accepted_by_depth"][d] for r in with_stats if d < len(r["accepted_by_depth"])) for d in range(depth)]
    drafted = [sum(r["drafted_by_depth"][d] for r in with_stats if d < len(r["drafted_by_depth"])) for d in range(depth)]
    return {
        "num_samples": len(records),
        "median_tokens_per_s": _median([r["tokens_per_s"] for r in records]),
        "speedup": _median([r["speedup"] for r in records]),
        # tau pooled over steps: accepted tokens per target verification forward
        "tau": sum(sum(r["accepted_per_step"]) for r in with_stats) / steps if steps else None,
        "acceptance_by_depth": [a / d if d else None for a, d in zip(accepted, drafted)] if with_stats else None,
        "draft_share": sum(r["draft_s"] for r in with_stats) / wall if with_stats and wall > 0 else None,
        "verify_share": sum(r["verify_s"] for r in with_stats) / wall if with_stats and wall > 0 else None,
        "peak_memory_mb": max(r["peak_memory_mb"] for r in records) if records else None,
        "mismatches": None if do_sample else sum(1 for r in records if r["matches_reference"] is False),
    }


# --------------------------------------------------------------------------------------------------
# Schema


def _doc(kind: str | list[str], description: str, **more: Any) -> dict:
    return {"type": kind, "description": description, **more}


def _object(description: str, /, **properties: dict) -> dict:
    return {"type": "object", "description": description, "properties": properties}


def _map(description: str, values: dict) -> dict:
    return {"type": "object", "description": description, "additionalProperties": values}


def _array(kind: str | list[str], description: str, items: dict, **more: Any) -> dict:
    return {"type": kind, "description": description, "items": items, **more}


_NUM, _NUM_OR_NULL, _INT, _INT_OR_NULL = "number", ["number", "null"], "integer", ["integer", "null"]

_RESULT = _object(
    "One method on one prompt turn.",
    new_tokens=_doc(_INT, "tokens generated (EOS included when produced)"),
    wall_s=_doc(_NUM, "seconds for the whole call, prefill included (CUDA synchronised before and after)"),
    tokens_per_s=_doc(_NUM, "new_tokens / wall_s"),
    speedup=_doc(_NUM_OR_NULL, "tokens_per_s / the reference's tokens_per_s on this same prompt turn"),
    peak_memory_mb=_doc(_NUM, "MiB; see settings.memory_source"),
    finish_reason=_doc("string", "'stop' (EOS) or 'length'"),
    tau=_doc(_NUM_OR_NULL, "mean accepted tokens per target verification forward (null: no speculation stats)"),
    steps=_doc(_INT_OR_NULL, "target verification forwards after prefill"),
    accepted_per_step=_array(["array", "null"], "tokens produced by each verification step", _doc(_INT, "")),
    accepted_by_depth=_array(["array", "null"], "[d]: steps whose accepted path reached depth d+1", _doc(_INT, "")),
    drafted_by_depth=_array(["array", "null"], "[d]: steps whose tree had a node at depth d+1", _doc(_INT, "")),
    tree_nodes=_doc(_INT_OR_NULL, "tree nodes verified, summed over steps"),
    prefill_s=_doc(_NUM_OR_NULL, "seconds in prefill (selfspec's own timer)"),
    draft_s=_doc(_NUM_OR_NULL, "seconds in the drafter"),
    verify_s=_doc(_NUM_OR_NULL, "seconds in tree verification (target forward, acceptance, KV compaction)"),
    matches_reference=_doc(["boolean", "null"], "greedy: output equals the reference's; null under sampling"),
    first_diff=_doc(_INT_OR_NULL, "greedy: first position differing from the reference; null if equal or sampling"),
    tokens=_array("array", "the generated token ids", _doc(_INT, "")),
)

_AGGREGATE = _object(
    "One method over a set of prompt turns.",
    num_samples=_doc(_INT, "prompt turns aggregated"),
    median_tokens_per_s=_doc(_NUM_OR_NULL, "median of per-turn tokens_per_s"),
    speedup=_doc(_NUM_OR_NULL, "median of per-turn speedups (ratios measured in this run)"),
    tau=_doc(_NUM_OR_NULL, "accepted tokens per verification forward, pooled over all steps"),
    acceptance_by_depth=_array(
        ["array", "null"],
        "[d]: sum accepted_by_depth[d] / sum drafted_by_depth[d]",
        _doc(_NUM_OR_NULL, "acceptance rate at depth d+1"),
    ),
    draft_share=_doc(_NUM_OR_NULL, "sum draft_s / sum wall_s"),
    verify_share=_doc(_NUM_OR_NULL, "sum verify_s / sum wall_s"),
    peak_memory_mb=_doc(_NUM_OR_NULL, "max peak_memory_mb, MiB"),
    mismatches=_doc(_INT_OR_NULL, "greedy: prompt turns whose output differs from the reference; null under sampling"),
)

_TREE_BUDGET = {
    **_object(
        "EAGLE heads: the dynamic-tree budget decoded with; null for other methods.",
        depth=_doc(_INT, "draft depth"),
        top_k=_doc(_INT, "candidates per expansion"),
        total_tokens=_doc(_INT, "draft tokens kept per step (tree nodes - 1)"),
        chosen_by=_doc("string", "'given' (explicit values), 'default' (no acceptance profile) or 'auto' "
                       "(sized to this machine from the head's acceptance profile and measured costs)",
                       enum=["given", "default", "auto"]),
        expected_tau=_doc(_NUM_OR_NULL, "'auto': tau the acceptance profile predicts for this budget"),
        expected_speedup=_doc(_NUM_OR_NULL, "'auto': speedup over plain decoding the cost model predicts"),
    ),
    "type": ["object", "null"],
}

SCHEMA: dict = _object(
    "selfspec bench report (report.json). A JSON-Schema subset: every listed property is required, no other "
    "property is allowed, 'additionalProperties' gives the value layout of maps keyed by method or category.",
    schema_version=_doc(_INT, f"layout version, {SCHEMA_VERSION}"),
    created_utc=_doc("string", "ISO 8601 UTC time the report was made"),
    settings=_object(
        "How the run generated.",
        target=_doc("string", "target name (or model class)"),
        dtype=_doc("string", "target parameter dtype"),
        device=_doc("string", "target device"),
        threads=_doc(_INT, "torch intra-op threads"),
        max_new_tokens=_doc(_INT, "cap on new tokens per prompt turn"),
        do_sample=_doc("boolean", "False: greedy"),
        temperature=_doc(_NUM, "0 when greedy"),
        top_p=_doc(_NUM, "nucleus sampling, 1 = off"),
        top_k=_doc(_INT, "always 0 (off), passed to transformers explicitly"),
        seed=_doc(_INT, "prompt turn i used seed + i"),
        warmup=_doc(_INT, "prompts run once untimed by every method first"),
        max_prompt_tokens=_doc(_INT_OR_NULL, "longer prompt turns were skipped"),
        eos_token_ids=_array("array", "stop ids used by every method", _doc(_INT, "")),
        reference=_doc("string", "the method speedups and mismatches are measured against"),
        prompts_source=_doc("string", "prompt file or 'sharegpt-heldout'"),
        tree_nodes=_doc(_INT_OR_NULL, "tree size asked for Medusa heads (null: default)"),
        draft_model=_doc(["string", "null"], "draft model name, if any"),
        memory_source=_doc("string", "what peak_memory_mb measures"),
    ),
    environment=_object(
        "Where it ran.",
        python=_doc("string", "Python version"),
        platform=_doc("string", "platform.platform()"),
        torch=_doc("string", "torch version"),
        transformers=_doc("string", "transformers version"),
        cpu_count=_doc(_INT, "os.cpu_count()"),
        accelerator=_doc(["string", "null"], "CUDA device name, null on CPU"),
    ),
    methods=_map(
        "Method name -> what it is (reference first).",
        _object(
            "",
            kind=_doc("string", "'hf', 'selfspec' or 'custom'", enum=["hf", "selfspec", "custom"]),
            description=_doc("string", ""),
            tree_budget=_TREE_BUDGET,
        ),
    ),
    categories=_array("array", "categories present, sorted", _doc("string", "")),
    samples=_array(
        "array",
        "One entry per prompt turn, in run order.",
        _object(
            "",
            question_id=_doc("string", "from the prompt file"),
            category=_doc("string", ""),
            turn=_doc(_INT, "1-based turn"),
            prompt_tokens=_doc(_INT, "prompt length in tokens (chat template included)"),
            seed=_doc(_INT, "sampling seed of this turn"),
            results=_map("Method name -> result.", _RESULT),
        ),
    ),
    skipped=_array(
        "array",
        "Prompt turns skipped for exceeding max_prompt_tokens (later turns of the question are skipped too).",
        _object(
            "",
            question_id=_doc("string", ""),
            turn=_doc(_INT, ""),
            prompt_tokens=_doc(_INT, ""),
        ),
    ),
    mismatches=_array(
        "array",
        "Greedy runs: every (method, prompt turn) whose output differs from the reference's.",
        _object(
            "",
            method=_doc("string", ""),
            question_id=_doc("string", ""),
            category=_doc("string", ""),
            turn=_doc(_INT, ""),
            first_diff=_doc(_INT, "first differing position"),
            reference_token=_doc(_INT_OR_NULL, "reference token there (null: reference ended)"),
            method_token=_doc(_INT_OR_NULL, "method token there (null: method output ended)"),
        ),
    ),
    summary=_map(
        "Method name -> aggregates.",
        _object("", overall=_AGGREGATE, by_category=_map("Category -> aggregate.", _AGGREGATE)),
    ),
)
"""Layout of ``report.json``: see the ``description`` of every node."""


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    raise ValueError(f"schema uses unknown type {kind!r}")


def _check(value: Any, schema: dict, path: str, errors: list[str]) -> None:
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    matched = [k for k in kinds if _type_ok(value, k)]
    if not matched:
        errors.append(f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__} {value!r:.60}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if matched[0] == "object" and "properties" in schema:
        props = schema["properties"]
        for key in props.keys() - value.keys():
            errors.append(f"{path}: missing key {key!r}")
        for key in value.keys() - props.keys():
            errors.append(f"{path}: unexpected key {key!r}")
        for key in props.keys() & value.keys():
            _check(value[key], props[key], f"{path}.{key}", errors)
    elif matched[0] == "object" and "additionalProperties" in schema:
        for key, item in value.items():
            if not isinstance(key, str):
                errors.append(f"{path}: key {key!r} is not a string")
            _check(item, schema["additionalProperties"], f"{path}.{key}", errors)
    elif matched[0] == "array" and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", errors)


def validate_report(report: Any, schema: dict = SCHEMA) -> None:
    """Check a report against :data:`SCHEMA` plus cross-references (every sample and summary has every
    method, the reference is a method).

    Raises:
        ValueError: listing every problem found, each with its JSON path.
    """
    errors: list[str] = []
    _check(report, schema, "report", errors)
    if not errors:
        names = set(report["methods"])
        if report["settings"]["reference"] not in names:
            errors.append("report.settings.reference: not one of report.methods")
        if set(report["summary"]) != names:
            errors.append("report.summary: keys differ from report.methods")
        for i, sample in enumerate(report["samples"]):
            if set(sample["results"]) != names:
                errors.append(f"report.samples[{i}].results: keys differ from report.methods")
            if sample["category"] not in report["categories"]:
                errors.append(f"report.samples[{i}].category: not in report.categories")
        for name, summ in report["summary"].items():
            if set(summ["by_category"]) != set(report["categories"]):
                errors.append(f"report.summary.{name}.by_category: keys differ from report.categories")
    if errors:
        raise ValueError("invalid bench report:\n  " + "\n  ".join(errors))


# --------------------------------------------------------------------------------------------------
# Outputs


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _depth_text(rates: list[float | None] | None) -> str:
    return "-" if not rates else " / ".join(_fmt(r, ".2f") for r in rates)


_COLUMNS = "tokens/s (median) | speedup (median) | tau | acceptance by depth | draft share | verify share | peak MiB | mismatches"


def _row(agg: dict) -> str:
    mism = "-" if agg["mismatches"] is None else f"{agg['mismatches']}/{agg['num_samples']}"
    return " | ".join(
        [
            str(agg["num_samples"]),
            _fmt(agg["median_tokens_per_s"], ".1f"),
            _fmt(agg["speedup"], ".2f", "x"),
            _fmt(agg["tau"]),
            _depth_text(agg["acceptance_by_depth"]),
            _fmt(agg["draft_share"], ".0%"),
            _fmt(agg["verify_share"], ".0%"),
            _fmt(agg["peak_memory_mb"], ".0f"),
            mism,
        ]
    )


def _budget_text(budget: dict | None) -> str:
    if budget is None:
        return ""
    text = (f"; EAGLE tree depth {budget['depth']}, top_k {budget['top_k']}, total_tokens {budget['total_tokens']} "
            f"({budget['chosen_by']}")
    if budget["expected_tau"] is not None:
        text += f": expected tau {budget['expected_tau']:.2f}, expected speedup {_fmt(budget['expected_speedup'], '.2f', 'x')}"
    return text + ")"


def markdown_report(report: dict) -> str:
    """``report.md``: settings, a table by method x category, an overall table, and the greedy mismatches."""
    s = report["settings"]
    mode = "greedy" if not s["do_sample"] else f"sampling T={s['temperature']} top_p={s['top_p']}"
    lines = [
        "# selfspec bench",
        "",
        f"Target `{s['target']}` ({s['dtype']}, {s['device']}, {s['threads']} threads), {mode}, "
        f"max {s['max_new_tokens']} new tokens, prompts `{s['prompts_source'] or 'given in code'}` "
        f"({len(report['samples'])} prompt turns), reference `{s['reference']}`. Speedup: median over prompt "
        "turns of tokens/s divided by the reference's tokens/s on the same turn, same run.",
        "",
        "## By category",
        "",
        f"| method | category | n | {_COLUMNS} |",
        "|" + "---|" * 11,
    ]
    for name, summ in report["summary"].items():
        for cat in report["categories"]:
            lines.append(f"| {name} | {cat} | {_row(summ['by_category'][cat])} |")
    lines += ["", "## Overall", "", f"| method | n | {_COLUMNS} |", "|" + "---|" * 10]
    for name, summ in report["summary"].items():
        lines.append(f"| {name} | {_row(summ['overall'])} |")
    lines += ["", "## Methods", ""]
    lines += [f"- `{n}` ({m['kind']}): {m['description']}{_budget_text(m['tree_budget'])}"
              for n, m in report["methods"].items()]
    if not s["do_sample"]:
        lines += ["", "## Outputs differing from the reference (greedy)", ""]
        if report["mismatches"]:
            lines += ["| method | question | category | turn | first differing position |", "|---|---|---|---|---|"]
            for m in report["mismatches"]:
                lines.append(f"| {m['method']} | {m['question_id']} | {m['category']} | {m['turn']} | {m['first_diff']} |")
        else:
            lines.append("None: every method produced the reference's tokens on every prompt turn.")
    if report["skipped"]:
        lines += ["", f"Skipped {len(report['skipped'])} prompt turns longer than {s['max_prompt_tokens']} tokens."]
    return "\n".join(lines) + "\n"


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """Write ``speedup.png``, ``accepted_tokens_hist.png`` and ``acceptance_by_depth.png`` (matplotlib,
    no pyplot state: a bare ``Figure`` renders with the Agg canvas). Returns the paths."""
    from matplotlib.figure import Figure

    names = list(report["methods"])
    groups = report["categories"] + ["overall"]
    paths = []

    fig = Figure(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(names)) / 2), 4.0))
    ax = fig.subplots()
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        summ = report["summary"][name]
        vals = [summ["by_category"][c]["speedup"] for c in report["categories"]] + [summ["overall"]["speedup"]]
        ax.bar([g + i * width for g in range(len(groups))], [v or 0.0 for v in vals], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))], groups, rotation=30, ha="right")
    ax.set_ylabel(f"speedup vs {report['settings']['reference']} (median)")
    ax.set_title("Speedup by category")
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=100)

    spec_names = [n for n in names if any(s["results"][n]["accepted_per_step"] for s in report["samples"])]
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.subplots()
    width = 0.8 / max(1, len(spec_names))
    for i, name in enumerate(spec_names):
        counts = [c for s in report["samples"] for c in (s["results"][name]["accepted_per_step"] or [])]
        values = range(1, max(counts) + 1)
        ax.bar([v - 0.4 + (i + 0.5) * width for v in values], [counts.count(v) / len(counts) for v in values],
               width, label=name)
    if not spec_names:
        ax.text(0.5, 0.5, "no speculative methods", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize="small")
    ax.set_xlabel("tokens produced per verification step (accepted drafts + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accepted tokens per step")
    fig.tight_layout()
    paths.append(out_dir / "accepted_tokens_hist.png")
    fig.savefig(paths[-1], dpi=100)

    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.subplots()
    plotted = False
    for name in names:
        rates = report["summary"][name]["overall"]["acceptance_by_depth"]
        if rates:
            ax.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], marker="o", label=name)
            plotted = True
    if plotted:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no speculative methods", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("tree depth")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0.0, 1.05)
    ax.set_title("Acceptance rate by depth")
    fig.tight_layout()
    paths.append(out_dir / "acceptance_by_depth.png")
    fig.savefig(paths[-1], dpi=100)
    return paths


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Validate ``report`` and write ``report.json``, ``report.md`` and the plots into ``out_dir``.

    Returns:
        ``{"json", "markdown", "plots"...}`` -> path.
    """
    validate_report(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(report, allow_nan=False))  # compact: token lists are long
    paths["markdown"].write_text(markdown_report(report))
    for p in write_plots(report, out):
        paths[p.stem] = p
    return paths


def summary_text(report: dict) -> str:
    """The short stdout summary: reference tokens/s, then tau, speedup and mismatches per method."""
    ref = report["settings"]["reference"]
    overall = {n: s["overall"] for n, s in report["summary"].items()}
    lines = [
        f"{ref}: {_fmt(overall[ref]['median_tokens_per_s'], '.1f')} tokens/s (median over "
        f"{overall[ref]['num_samples']} prompt turns)",
        f"{'method':<24} {'tau':>6} {'speedup':>8} {'tokens/s':>9} {'mismatches':>11}",
    ]
    for name, agg in overall.items():
        mism = "-" if agg["mismatches"] is None else f"{agg['mismatches']}/{agg['num_samples']}"
        lines.append(
            f"{name:<24} {_fmt(agg['tau']):>6} {_fmt(agg['speedup'], '.2f', 'x'):>8} "
            f"{_fmt(agg['median_tokens_per_s'], '.1f'):>9} {mism:>11}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# CLI


def _parse_heads(items: Sequence[str]) -> dict[str, str]:
    """``DIR`` or ``NAME=DIR`` -> {name: dir}. A bare ``.../heads`` directory is named after its parent."""
    heads: dict[str, str] = {}
    for item in items:
        name, sep, directory = item.partition("=")
        if not sep:
            directory = item
            path = Path(item.rstrip("/"))
            name = path.parent.name if path.name == "heads" and path.parent.name else path.name
        if not name or name in heads or name in BUILTIN_METHODS:
            raise ValueError(f"head method name {name!r} (from {item!r}) is empty or taken; pass NAME=DIR")
        heads[name] = directory
    return heads


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="selfspec bench",
        description="Speedup, tau and exactness of selfspec methods against plain transformers generate, "
        "measured in one process, methods interleaved per prompt.",
    )
    p.add_argument("--prompts", default=SHAREGPT_HELDOUT, help="MT-bench/Spec-Bench JSONL file, or 'sharegpt-heldout'")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name, directory or Hub id")
    p.add_argument("--heads", nargs="*", default=[], metavar="DIR", help="head directories (or NAME=DIR), one method each")
    p.add_argument("--methods", nargs="+", default=None, choices=BUILTIN_METHODS,
                   help=f"built-in methods (default: {' '.join(DEFAULT_METHODS)}, plus draft_model with --draft-model); "
                   "baseline always runs")
    p.add_argument("--draft-model", default=None, help="small causal LM with the target's tokenizer (draft_model method)")
    p.add_argument("--eagle-depth", type=_int_or_auto, default=None,
                   help="EAGLE-2 tree depth, or 'auto' (default): sized to this machine when the head has an "
                   "acceptance profile (selfspec tune-tree), else selfspec's default")
    p.add_argument("--eagle-top-k", type=int, default=None, help="EAGLE-2 expansions per node")
    p.add_argument("--eagle-total-tokens", type=_int_or_auto, default=None,
                   help="EAGLE-2 draft tokens kept per step, or 'auto' (default; see --eagle-depth)")
    p.add_argument("--tree-nodes", type=int, default=None, help="tree size for Medusa heads (default: sized to this machine from the heads' accuracies)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--num-prompts", type=int, default=None, help="first N questions (default: all)")
    p.add_argument("--max-turns", type=int, default=None, help="answer only the first N turns (1: first turns)")
    p.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="skip longer prompt turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="prompts run untimed by every method first")
    p.add_argument("--out", default="runs/bench", help="directory for report.json, report.md and PNG plots")
    return p


def load_target(name: str, dtype: str, device: str):
    """:func:`selfspec.target.load_target` (a seam the CLI tests replace)."""
    from selfspec.target import load_target as _load

    return _load(name, dtype=dtype, device=device)


def main(argv: Sequence[str] | None = None) -> int:
    """``selfspec bench ...``: returns 0 on success, 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        heads = _parse_heads(args.heads)
        settings = BenchSettings(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            warmup=args.warmup,
            max_prompt_tokens=args.max_prompt_tokens,
            target_name=args.target,
            prompts_source=args.prompts,
            tree_nodes=args.tree_nodes,
            draft_model=args.draft_model,
        )
    except ValueError as err:
        parser.error(str(err))
    methods = args.methods or list(DEFAULT_METHODS) + (["draft_model"] if args.draft_model else [])
    prompts = load_prompts(args.prompts, args.num_prompts, args.max_turns, args.per_category)
    target, tokenizer = load_target(args.target, args.dtype, args.device)
    draft = load_target(args.draft_model, args.dtype, args.device)[0] if args.draft_model else None
    try:
        bench_methods = build_methods(
            target, tokenizer, settings, methods=methods, heads=heads, draft_model=draft, tree_nodes=args.tree_nodes,
            eagle_options={"depth": args.eagle_depth, "top_k": args.eagle_top_k, "total_tokens": args.eagle_total_tokens}
        )
    except ValueError as err:
        parser.error(str(err))
    logger.info("bench: %d questions, methods %s", len(prompts), ", ".join(bench_methods))
    report = run_bench(target, tokenizer, bench_methods, prompts, settings)
    paths = write_report(report, args.out)
    print(summary_text(report))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
