"""Bench settings and methods: every way of generating the bench compares, behind one callable shape."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.api import DrafterPlan, SpeculativeModel, make_drafter, make_verifier, plan_drafter
from selfspec.bench.report import TreeBudgetRecord
from selfspec.decode.drafters import NoDraftDrafter, PromptLookupDrafter
from selfspec.decode.drafters.hybrid import HybridDrafter
from selfspec.decode.drafters.suffix_index import SuffixIndex
from selfspec.decode.loop import GenerationStats
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tuning.costs import get_cost_profile
from selfspec.families import family, family_of
from selfspec.prompts import resolve_eos

if TYPE_CHECKING:
    from transformers import PreTrainedModel

REFERENCE = "baseline"
ENGINE_REFERENCE = "no_draft"
"""selfspec's own loop and verifier (the same kernels as every selfspec method) with no drafts: one token per
step. Speedups over it are the gain of speculation alone; over ``baseline`` they include the kernels' gain."""
BUILTIN_METHODS = ("baseline", "no_draft", "hf_prompt_lookup", "prompt_lookup", "draft_model", "hybrid")
DEFAULT_METHODS = ("baseline", "hf_prompt_lookup", "prompt_lookup")


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
        engine_reference: the method ``engine_speedup`` is measured against (the engine with no drafts).
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
    engine_reference: str = ENGINE_REFERENCE
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

    def sampling(self) -> SamplingConfig:
        """The :class:`~selfspec.decode.sampling.SamplingConfig` every method decodes with."""
        if not self.do_sample:
            return SamplingConfig()
        return SamplingConfig(do_sample=True, temperature=self.temperature, top_k=0, top_p=self.top_p)

    def stop_ids(self, target: PreTrainedModel, tokenizer: Any) -> list[int]:
        """Stop ids: ``eos_token_ids`` when set, else :func:`selfspec.prompts.resolve_eos` (the target's
        generation config, else the tokenizer's)."""
        if self.eos_token_ids is not None:
            return list(self.eos_token_ids)
        return resolve_eos(target, tokenizer)


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
    tree_budget: TreeBudgetRecord | None = None


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


def check_hf_matches_sampling(model: PreTrainedModel, kwargs: Mapping[str, Any], settings: BenchSettings) -> None:
    """Raise ValueError unless ``model.generate(**kwargs)`` processes logits as selfspec does for ``settings``.

    ``generate`` fills every argument left unset from ``model.generation_config``; a config that sets a
    processor selfspec does not apply (``no_repeat_ngram_size``, ``typical_p``, ...) would make the
    baseline decode a different distribution, so it is refused here rather than silently compared.
    """
    resolved = copy.deepcopy(model.generation_config)
    resolved.update(**{k: v for k, v in kwargs.items() if k not in ("max_new_tokens", "eos_token_id", "pad_token_id")})
    theirs = SamplingConfig.from_generation_config(resolved)  # raises on unsupported processors
    ours = settings.sampling()
    same = (theirs.do_sample, theirs.repetition_penalty) == (ours.do_sample, ours.repetition_penalty)
    if ours.do_sample:
        same = same and theirs == ours
    if not same:
        raise ValueError(f"transformers generate would decode with {theirs}, selfspec with {ours}")


def hf_method(
    model: PreTrainedModel, settings: BenchSettings, eos_token_ids: Sequence[int], pad_token_id: int | None, **extra
) -> BenchMethod:
    """Plain ``model.generate`` (batch 1) with ``hf_generate_kwargs`` plus ``extra`` (e.g. prompt lookup).

    Raises:
        ValueError: the model's generation config would decode differently (:func:`check_hf_matches_sampling`).
    """
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


def selfspec_method(spec_model: SpeculativeModel, settings: BenchSettings, eos_token_ids: Sequence[int]) -> BenchMethod:
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


def tree_budget_record(plan: DrafterPlan) -> TreeBudgetRecord | None:
    """What the report records of an EAGLE drafter's tree budget (None for other drafters): its ``depth``,
    ``top_k``, ``total_tokens``, how they were set (``chosen_by``: ``"given"``, ``"default"`` or ``"auto"``)
    and, when sized to the machine, the expected tau and speedup."""
    shape = plan.drafter.info().tree
    if shape is None or plan.tree_budget is None:
        return None
    budget = plan.tree_budget.budget
    return TreeBudgetRecord(
        depth=shape.depth,
        top_k=shape.top_k,
        total_tokens=shape.tokens,
        chosen_by=plan.tree_budget.source,
        expected_tau=budget.expected_tau if budget is not None else None,
        expected_speedup=budget.expected_speedup if budget is not None else None,
    )


def eagle_kwargs(head: Any, options: Mapping[str, int | str] | None) -> dict[str, int | str]:
    """The drafter options (``depth``, ``top_k``, ``total_tokens``, ...) that ``head``'s family takes
    (:attr:`selfspec.families.Family.drafter_options`: EAGLE-1 and EAGLE-3 heads take the EAGLE-2 tree's), without
    the ones left None."""
    if not options:
        return {}
    if isinstance(head, (str, Path)):
        config = Path(head) / "config.json"
        head_type = json.loads(config.read_text()).get("head_type") if config.is_file() else None
        takes = family(head_type).drafter_options if head_type is not None else ()
    else:
        takes = family_of(head).drafter_options
    return {k: v for k, v in options.items() if v is not None and k in takes}


def build_methods(
    target: PreTrainedModel,
    tokenizer: Any,
    settings: BenchSettings,
    *,
    methods: Sequence[str] = DEFAULT_METHODS,
    heads: Mapping[str, Any] | None = None,
    draft_model: PreTrainedModel | None = None,
    tree_nodes: int | None = None,
    extra_methods: Mapping[str, MethodFn | BenchMethod] | None = None,
    eagle_options: Mapping[str, int | str] | None = None,
    suffix_index: str | Path | SuffixIndex | None = None,
) -> dict[str, BenchMethod]:
    """The methods to compare, all sharing ``target``.

    Args:
        target: the frozen target (``transformers`` causal LM).
        tokenizer: its tokenizer (or any object with ``decode``); used for decoded text only.
        settings: generation settings (for the ``transformers`` keyword arguments and the EOS ids).
        methods: a subset of :data:`BUILTIN_METHODS`; the reference (``baseline``) and the engine-only
            baseline (``no_draft``, :data:`ENGINE_REFERENCE`) are always added.
        heads: method name -> head directory or head module, each one method.
        draft_model: a loaded small causal LM (same tokenizer) for the ``draft_model`` method.
        tree_nodes: tree size for Medusa heads without an explicit tree (None = selfspec's default).
        extra_methods: more methods by name (callables or :class:`BenchMethod`), e.g. for tests.
        eagle_options: ``depth`` / ``top_k`` / ``total_tokens`` for EAGLE heads: integers, ``"auto"`` (sized
            to this machine from the head's acceptance profile) or None (= ``"auto"`` for depth and
            total_tokens, which falls back to the defaults without a profile).
        suffix_index: with ``hybrid`` among ``methods``, adds ``hybrid_suffix``: the hybrid with this
            :class:`~selfspec.decode.drafters.suffix_index.SuffixIndex` of training answers as a second n-gram source
            (an index, a saved ``.safetensors`` index, or a JSONL of conversations indexed with ``tokenizer``).

    Returns:
        Ordered name -> :class:`BenchMethod`, the reference first.

    Raises:
        ValueError: unknown or duplicate method names, ``draft_model`` requested without a model,
            ``suffix_index`` without ``hybrid`` among ``methods``.
    """
    unknown = sorted(set(methods) - set(BUILTIN_METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose among {list(BUILTIN_METHODS)}")
    if "draft_model" in methods and draft_model is None:
        raise ValueError("method 'draft_model' needs a draft model: pass --draft-model NAME")
    if "hybrid" in methods and not heads:
        raise ValueError("method 'hybrid' merges a head's tree with prompt lookup: pass --heads DIR too")
    if suffix_index is not None and "hybrid" not in methods:
        raise ValueError("--suffix-index adds hybrid_suffix beside the hybrid method: pass --methods ... hybrid too")
    eos = settings.stop_ids(target, tokenizer)
    pad = getattr(target.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else None)
    always = (REFERENCE, ENGINE_REFERENCE)
    chosen = [*always] + [m for m in BUILTIN_METHODS if m in methods and m not in always]
    for name in heads or {}:
        if name in chosen or (suffix_index is not None and name == "hybrid_suffix"):
            raise ValueError(f"head method name {name!r} is taken; pass it as NAME=DIR with another name")
    lookup = make_drafter(target, prompt_lookup=True)
    head_plans = {
        name: plan_drafter(target, heads=head, tree_nodes=tree_nodes, **eagle_kwargs(head, eagle_options))
        for name, head in (heads or {}).items()
    }
    head_drafters = {name: plan.drafter for name, plan in head_plans.items()}
    # One verifier for every selfspec method: the kernels are measured and packed once per target, and every
    # method verifies with the same kernels (plain ones when no head method asks for the tuned ones).
    verifier = make_verifier(target, next(iter(head_drafters.values()), lookup))
    out: dict[str, BenchMethod] = {}
    for name in chosen:
        if name == "baseline":
            out[name] = hf_method(target, settings, eos, pad)
        elif name == ENGINE_REFERENCE:
            out[name] = dataclasses.replace(
                selfspec_method(SpeculativeModel(target, tokenizer, NoDraftDrafter(), verifier), settings, eos),
                description="selfspec with no drafts: its loop and verification kernels, one token per step",
            )
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
            out[name] = selfspec_method(SpeculativeModel(target, tokenizer, lookup, verifier), settings, eos)
        elif name == "draft_model":
            drafter = make_drafter(target, draft_model=draft_model)
            out[name] = selfspec_method(SpeculativeModel(target, tokenizer, drafter, verifier), settings, eos)
    if "hybrid" in methods:
        # the first head's drafter (its own fork: the hybrid keeps the head method's drafter untouched)
        first = next(iter(head_drafters.values()))
        verify_cost_ms = get_cost_profile(target).verify_cost_ms
        hybrid = HybridDrafter(first.fork(), verify_cost_ms, PromptLookupDrafter(lookup.num_tokens))
        out["hybrid"] = dataclasses.replace(
            selfspec_method(SpeculativeModel(target, tokenizer, hybrid, verifier), settings, eos),
            description=f"hybrid: the {next(iter(head_drafters))} head's tree + prompt lookup, split by cost",
        )
    if "hybrid" in methods and suffix_index is not None:
        index = SuffixIndex.open(suffix_index, tokenizer)
        index.check_vocab(target.get_output_embeddings().weight.shape[0])
        drafter = HybridDrafter(first.fork(), verify_cost_ms, PromptLookupDrafter(lookup.num_tokens), index)
        out["hybrid_suffix"] = dataclasses.replace(
            selfspec_method(SpeculativeModel(target, tokenizer, drafter, verifier), settings, eos),
            description=f"hybrid_suffix: the hybrid + a suffix index of {index.num_tokens} answer tokens",
        )
    for name, plan in head_plans.items():
        head = heads[name]
        model = SpeculativeModel(target, tokenizer, plan.drafter, verifier, plan.tree_budget)
        method = selfspec_method(model, settings, eos)
        source = f" from {head}" if isinstance(head, (str, Path)) else ""
        shape = plan.drafter.info().tree
        if shape is not None and plan.tree_budget is None:  # a tree sized at load (an EAGLE budget has its record)
            width = f", {shape.top_k} candidates on the first {shape.branch_depth}" if shape.top_k > 1 else ""
            source += f" (tree: a chain of {shape.depth} drafts{width})"
        out[name] = dataclasses.replace(
            method, description=method.description + source, tree_budget=tree_budget_record(plan)
        )
    for name, fn in (extra_methods or {}).items():
        if name in out:
            raise ValueError(f"extra method name {name!r} is taken")
        out[name] = fn if isinstance(fn, BenchMethod) else BenchMethod(fn, "custom", "custom method")
    return out
