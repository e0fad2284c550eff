"""What one call of the decode loop is asked to do, checked once, and what it returns.

:class:`GenerationRequest` holds every setting shared by the rows of a call (sampling, lengths, stop ids and
strings, processors, random generator, acceptance rule), validated when it is built, so the loop
(:mod:`selfspec.decode.loop`) never checks an argument again. :class:`GenerationStats` and
:class:`GenerationOutput` are what each row returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from selfspec.decode.drafters.base import context_length
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.step import ACCEPTANCE_RULES


def _count(name: str, value: Any, low: int) -> int:
    """``value`` as an int (anything with ``__index__``, e.g. numpy integers; not bool), at least ``low``."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value.__index__()


@dataclass(frozen=True)
class GenerationRequest:
    """The settings of one decode call, for every row (validated on construction; :meth:`from_settings` builds
    it from keyword settings and refuses unknown names with a ValueError).

    Attributes:
        max_new_tokens: hard cap on each row's new tokens (>= 1; never exceeded). The target's context
            (``max_position_embeddings``) caps it too: prompt plus output never pass it.
        min_new_tokens: EOS is suppressed until this many tokens exist (>= 0; counts tokens, not steps).
        sampling: greedy by default (:class:`~selfspec.decode.sampling.SamplingConfig`).
        eos_ids: EOS ids (one int or several are accepted and stored as a tuple); output stops right after
            the first one produced.
        stop_strings: output stops at the token that completes any of them (needs ``tokenizer``).
        tokenizer: decodes ``text`` and the stop strings' tail; None for ids only.
        logits_processor: ``transformers`` ``LogitsProcessor`` objects applied at every position, or None.
        generator: ``torch.Generator`` for every random draw (drafts, acceptance, residual, bonus).
        acceptance: ``"exact"`` (lossless) or ``"typical"`` (Medusa's typical acceptance: LOSSY, flagged).

    Raises:
        ValueError: a count below its minimum or not an integer, an unknown ``acceptance``, ``stop_strings``
            without a tokenizer; each message says what to pass.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_ids: tuple[int, ...] | int | Sequence[int] | None = ()
    stop_strings: tuple[str, ...] | Sequence[str] = ()
    tokenizer: Any = None
    logits_processor: Any = None
    generator: torch.Generator | None = None
    acceptance: str = "exact"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "max_new_tokens", _count("max_new_tokens", self.max_new_tokens, 1))
        set_(self, "min_new_tokens", _count("min_new_tokens", self.min_new_tokens, 0))
        eos = self.eos_ids
        set_(self, "eos_ids", (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in (eos or ())))
        set_(self, "stop_strings", tuple(s for s in self.stop_strings if s))
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer=... to generate")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError("acceptance must be 'exact' (lossless) or 'typical' (lossy, Medusa)")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> GenerationRequest:
        """A request from keyword settings (those of :func:`~selfspec.decode.loop.speculative_generate`): the
        fields above, ``eos_token_id`` as ``generate``'s name for ``eos_ids``, and ``sampling=None`` for the
        default.

        Raises:
            ValueError: a name that is no field (the message lists the valid names, and points sampling
                options such as ``temperature`` to ``sampling=SamplingConfig(...)``), or any error of construction.
        """
        settings = dict(settings)
        names = [f.name for f in fields(cls)]
        unknown = sorted(k for k in settings if k not in names and k != "eos_token_id")
        if unknown:
            sampling = [k for k in unknown if k in {f.name for f in fields(SamplingConfig)}]
            hint = f"; sampling options ({', '.join(sampling)}) go in sampling=SamplingConfig(...)" if sampling else ""
            raise ValueError(
                f"unknown generation settings {unknown}: rename or drop them; the valid names are "
                f"{[*names, 'eos_token_id']}{hint}"
            )
        if "eos_token_id" in settings:
            settings["eos_ids"] = settings.pop("eos_token_id")
        if settings.get("sampling") is None:
            settings.pop("sampling", None)
        return cls(**settings)

    @property
    def greedy(self) -> bool:
        """Whether steps choose by argmax (exact acceptance without sampling)."""
        return self.acceptance == "exact" and not self.sampling.do_sample


@dataclass
class GenerationStats:
    """Per-row statistics of one call.

    Attributes:
        steps: target verification forwards (prefill excluded).
        new_tokens: tokens returned.
        accepted_per_step: tokens produced by each verification step (accepted drafts + 1).
        mean_accepted_tokens: tau, mean of ``accepted_per_step``.
        accepted_by_depth: ``accepted_by_depth[d]`` = steps whose accepted path reached depth d+1.
        drafted_by_depth: ``drafted_by_depth[d]`` = steps whose tree had a node at depth d+1.
        tree_nodes: nodes verified over all steps (roots included).
        steps_by_nodes: tree size (nodes, root included) -> steps that verified a tree of that size: the trees a
            tree rule chose, as it resized them.
        plain_steps: steps that verified the root alone (nothing drafted: no continuation found, the end of the
            output or context, or drafting switched off).
        drafting_off_steps: of those, the steps a tree rule switched drafting off (live acceptance that did not pay,
            or a batch too large for any tree); ``drafting_off_s``: their wall seconds.
        prefill_s, draft_s, verify_s, total_s: wall seconds (``total_s`` of a batch is the whole call's).
        tokens_per_s: ``new_tokens / total_s`` (prefill included, like plain generate).
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"``.
        lossy: True when typical acceptance was used (not distribution-preserving).
    """

    steps: int = 0
    new_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    drafted_by_depth: list[int] = field(default_factory=list)
    tree_nodes: int = 0
    steps_by_nodes: dict[int, int] = field(default_factory=dict)
    plain_steps: int = 0
    drafting_off_steps: int = 0
    drafting_off_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"
    lossy: bool = False

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(self.accepted_per_step) / max(1, len(self.accepted_per_step))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["mean_accepted_tokens"] = self.mean_accepted_tokens
        d["tokens_per_s"] = self.tokens_per_s
        return d

    def count_step(self, nodes: int, max_depth: int, accepted_depth: int) -> None:
        """Record one verification step: its tree's node count and depth, how deep its accepted path went."""
        self.steps += 1
        self.tree_nodes += nodes
        self.steps_by_nodes[nodes] = self.steps_by_nodes.get(nodes, 0) + 1
        self.plain_steps += int(nodes == 1)
        self.accepted_per_step.append(accepted_depth + 1)
        while len(self.drafted_by_depth) < max_depth:
            self.drafted_by_depth.append(0)
            self.accepted_by_depth.append(0)
        for d in range(max_depth):
            self.drafted_by_depth[d] += 1
        for d in range(accepted_depth):
            self.accepted_by_depth[d] += 1


@dataclass
class GenerationOutput:
    """``tokens``: the new token ids; ``text``: their decoding (when a tokenizer was given); ``stats``."""

    tokens: list[int]
    stats: GenerationStats
    text: str | None = None


def single_prompt(input_ids: torch.Tensor) -> torch.Tensor:
    """``input_ids`` as ``[T]``: ``[T]`` or ``[1, T]`` pass.

    Raises:
        ValueError: not an integer tensor, batch-shaped (``[B, T]`` with B > 1: pass a list of prompts), or
            empty.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must be an integer tensor [T] or [1, T], got {input_ids!r}")
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)}: one prompt is [T] or [1, T]; decode a batch as a "
            "list of prompts (selfspec.decode.loop.speculative_generate_batch, or generate([...]))"
        )
    if input_ids.numel() == 0:
        raise ValueError("the prompt is empty: pass at least one token")
    return input_ids


def room_in_context(target, prompt_len: int) -> int | None:
    """New tokens the target's context still holds after a prompt of ``prompt_len`` tokens (None: no limit).

    Raises:
        ValueError: the prompt fills or passes the context.
    """
    n = context_length(target)
    if n is None:
        return None
    if prompt_len >= n:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, which leaves no room for a new token in the target's context "
            f"of {n} positions (max_position_embeddings); shorten the prompt to at most {n - 1} tokens"
        )
    return n - prompt_len
