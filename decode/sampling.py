"""Logits processing and sampling, bit-identical to ``transformers``' ``model.generate``.

Speculative decoding is lossless only with respect to *one* target distribution: the one plain
decoding would sample from. So the target's raw logits go through exactly the processors that
``GenerationMixin._get_logits_processor`` (transformers 5.24) builds, in its order:

1. ``RepetitionPenaltyLogitsProcessor`` (when ``repetition_penalty != 1``),
1b. ``MinNewTokensLengthLogitsProcessor`` (EOS banned while fewer than ``min_new_tokens`` tokens exist;
   here :class:`EosBan`, row by row, since tree nodes at different depths have generated different counts),
2. the user's own processors (merged the way ``_merge_criteria_processor_list`` merges them: a user
   processor of the same class as a built-in one takes its place, the others are appended),
3. only when ``do_sample``: ``TemperatureLogitsWarper`` (``temperature != 1``), ``TopKLogitsWarper``
   (``top_k != 0``), ``TopPLogitsWarper`` (``top_p < 1``), ``MinPLogitsWarper`` (``min_p > 0``).

The processor classes are ``transformers``' own, so the numbers are the same bits. Greedy decoding
is the argmax of the processed logits (``torch.argmax``: first maximal index on ties), sampling is
``torch.multinomial`` over their softmax, as in ``GenerationMixin._sample``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

LogitsProcessorLike = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# GenerationConfig fields that make `generate` build processors this module does not reproduce,
# with their "off" test. Converting a config that sets one of them is an error (see from_generation_config).
_UNSUPPORTED_GENERATION_FIELDS: dict[str, Callable[[Any], bool]] = {
    "num_beams": lambda v: v is None or v == 1,
    "guidance_scale": lambda v: v is None or v == 1,
    "sequence_bias": lambda v: v is None,
    "encoder_repetition_penalty": lambda v: v is None or v == 1.0,
    "no_repeat_ngram_size": lambda v: v is None or v == 0,
    "encoder_no_repeat_ngram_size": lambda v: v is None or v == 0,
    "bad_words_ids": lambda v: v is None,
    "forced_bos_token_id": lambda v: v is None,
    "forced_eos_token_id": lambda v: v is None,
    "remove_invalid_values": lambda v: not v,
    "exponential_decay_length_penalty": lambda v: v is None,
    "suppress_tokens": lambda v: v is None,
    "begin_suppress_tokens": lambda v: v is None,
    "top_h": lambda v: v is None,
    "typical_p": lambda v: v is None or v >= 1.0,
    "epsilon_cutoff": lambda v: v is None or not (0.0 < v < 1.0),
    "eta_cutoff": lambda v: v is None or not (0.0 < v < 1.0),
    "watermarking_config": lambda v: v is None,
    "renormalize_logits": lambda v: not v,
}

# What `generate` uses for unset fields (transformers 5.24 `_get_default_generation_params`), and "off".
_GENERATE_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
_OFF: dict[str, Any] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class SamplingConfig:
    """How target (and draft) logits become a next-token distribution.

    Same meaning and defaults as ``transformers.GenerationConfig``, except ``top_k``: 0 (off) here,
    50 in ``GenerationConfig``. Use :meth:`from_generation_config` to copy a ``GenerationConfig``
    faithfully. With ``do_sample=False`` the warpers (temperature, top-k, top-p, min-p) are ignored,
    exactly as ``generate`` ignores them.

    Attributes:
        do_sample: False = greedy (argmax of the processed logits); True = sample from their softmax.
        temperature: > 0; logits are divided by it (sampling only).
        top_k: >= 0; keep the k most likely tokens (0 = off; sampling only).
        top_p: in (0, 1]; nucleus sampling (1 = off; sampling only).
        min_p: in [0, 1]; drop tokens with p < min_p * max p (0 = off; sampling only).
        repetition_penalty: > 0; CTRL penalty on tokens present in the context (1 = off; greedy too).

    Raises:
        ValueError: a value out of range; the message says what to pass instead.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool, got {self.do_sample!r}; pass True or False")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            # transformers' warpers insist on Python floats; accept ints and store floats.
            object.__setattr__(self, name, float(value))
        if self.temperature <= 0.0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature}; for greedy decoding pass do_sample=False "
                "(temperature is then ignored), for sampling pass e.g. temperature=0.7"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}; pass 0 to turn top-k off")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; pass 1.0 to turn nucleus sampling off")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}; pass 0.0 to turn min-p off")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}; pass 1.0 for no penalty")

    @classmethod
    def from_generation_config(cls, generation_config: Any) -> SamplingConfig:
        """Copy the sampling settings of a ``transformers.GenerationConfig``.

        Unset (``None``) fields take the values ``generate`` itself falls back to
        (``GenerationConfig._get_default_generation_params()``: notably ``top_k = 50``, so a plain
        ``generate(do_sample=True)`` samples with top-k 50, and so does the config returned here);
        ``min_p`` unset means off. To mirror ``model.generate(**kwargs)`` exactly, pass the config
        ``generate`` resolves (the model's ``generation_config`` updated with the call's kwargs).

        Raises:
            ValueError: the config sets something that makes ``generate`` build another processor
                (bad_words_ids, no_repeat_ngram_size, typical_p, num_beams > 1, ...); build that processor
                yourself and pass it as ``logits_processor`` instead, or unset the field.
        """
        unsupported = [
            name
            for name, is_off in _UNSUPPORTED_GENERATION_FIELDS.items()
            if not is_off(getattr(generation_config, name, None))
        ]
        if unsupported:
            raise ValueError(
                f"GenerationConfig sets {unsupported}, which SamplingConfig does not reproduce; unset them, "
                "or build the matching transformers LogitsProcessor and pass it as logits_processor"
            )
        get_defaults = getattr(type(generation_config), "_get_default_generation_params", None)
        defaults = dict(_GENERATE_DEFAULTS, **(get_defaults() if callable(get_defaults) else {}))

        def pick(name: str) -> Any:
            value = getattr(generation_config, name, None)
            if value is None:
                value = defaults.get(name)
            return _OFF[name] if value is None else value

        return cls(
            do_sample=bool(pick("do_sample")),
            temperature=pick("temperature"),
            top_k=int(pick("top_k")),
            top_p=pick("top_p"),
            min_p=pick("min_p"),
            repetition_penalty=pick("repetition_penalty"),
        )


class EosBan:
    """``generate``'s ``MinNewTokensLengthLogitsProcessor`` for rows that have generated different counts.

    Row i's EOS scores become ``-inf`` where ``rows[i]`` (that position has fewer than ``min_new_tokens``
    new tokens before it), exactly the bits ``torch.where(eos_mask, -inf, scores)`` gives there.

    Args:
        eos_ids: the EOS token ids (``generate``'s ``eos_token_id``).
        rows: BoolTensor ``[N]``, which rows ban EOS.
    """

    def __init__(self, eos_ids: Sequence[int], rows: torch.Tensor) -> None:
        self.eos_ids = [int(e) for e in eos_ids]
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        rows = self.rows.to(scores.device).nonzero().flatten()
        if rows.numel() and self.eos_ids:
            eos = torch.tensor(self.eos_ids, device=scores.device)
            out[rows.unsqueeze(1), eos.unsqueeze(0)] = float("-inf")
        return out


def build_logits_processor(
    config: SamplingConfig,
    logits_processor: Sequence[LogitsProcessorLike] | None = None,
    eos_ban: EosBan | None = None,
) -> LogitsProcessorList:
    """The processor list ``generate`` builds for ``config`` plus the user's processors, in its order.

    Mirrors ``GenerationMixin._get_logits_processor`` (transformers 5.24) for the settings of
    :class:`SamplingConfig`, including ``_merge_criteria_processor_list`` (a user processor of the same
    class as a built-in one replaces it in place; the rest are appended before the warpers).

    Args:
        config: the sampling settings.
        logits_processor: user processors, each called as ``proc(input_ids [N, T], scores [N, V])``.
        eos_ban: the ``min_new_tokens`` EOS ban, placed where ``generate`` places
            ``MinNewTokensLengthLogitsProcessor``: after the repetition penalty, before the user's processors
            and the warpers (so top-k / top-p / min-p choose among the tokens still allowed).

    Returns:
        A ``LogitsProcessorList`` (possibly empty).
    """
    defaults = LogitsProcessorList()
    if config.repetition_penalty != 1.0:
        defaults.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if eos_ban is not None:
        defaults.append(eos_ban)
    custom = list(logits_processor or [])
    processors = LogitsProcessorList()
    for default in defaults:
        same = next((c for c in custom if type(c) is type(default)), None)
        processors.append(default if same is None else same)
    for proc in custom:
        if proc not in processors:
            processors.append(proc)
    if config.do_sample:
        if config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
        if config.min_p > 0.0:  # generate also appends MinPLogitsWarper(0.0) for min_p=0.0: a no-op
            processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return processors


def process_logits(
    logits: torch.Tensor,
    contexts: torch.Tensor | None,
    config: SamplingConfig,
    logits_processor: Sequence[LogitsProcessorLike] | None = None,
    eos_ban: EosBan | None = None,
) -> torch.Tensor:
    """Turn raw logits into the scores plain ``generate`` would sample from (or take the argmax of).

    Rows are independent: row i is processed as if ``generate`` had ``contexts[i]`` as its
    ``input_ids`` and ``logits[i]`` as the model's last logits. Tree nodes can therefore be processed in
    one call per depth (all contexts of one depth have the same length T).

    Args:
        logits: ``[N, V]`` raw logits, any float dtype (cast to float32 first, like ``generate``).
        contexts: ``[N, T]`` long, the tokens preceding each position (prompt included). May be ``None``
            when no processor reads it (no repetition penalty, no user processors; the warpers do not).
        config: the sampling settings.
        logits_processor: optional user processors (a ``LogitsProcessorList`` or a list), called as
            ``proc(contexts, scores)`` after the repetition penalty, before the warpers.
        eos_ban: optional ``min_new_tokens`` EOS ban (:class:`EosBan`, ``rows`` of length N), applied in
            ``generate``'s order (see :func:`build_logits_processor`).

    Returns:
        ``[N, V]`` float32 processed logits, disallowed tokens at ``-inf``. A new tensor: ``logits`` is
        never modified.

    Raises:
        ValueError: ``logits`` not 2-D floating; ``contexts`` not 2-D integer with N rows; ``contexts``
            is None while a processor needs it.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [N, V], got {tuple(logits.shape)} {logits.dtype}")
    processors = build_logits_processor(config, logits_processor, eos_ban)
    # generate: `outputs.logits[:, -1].to(copy=True, dtype=torch.float32)`; the copy also shields
    # the caller's tensor from processors that write in place.
    scores = logits.to(dtype=torch.float32, copy=True)
    if len(processors) == 0:
        return scores
    if contexts is None:
        if config.repetition_penalty != 1.0 or logits_processor:
            raise ValueError(
                "contexts is None but the repetition penalty or a user logits processor needs the preceding "
                "tokens; pass contexts [N, T]"
            )
        # the warpers (temperature, top-k, top-p, min-p) never read input_ids
        contexts = torch.zeros((logits.shape[0], 0), dtype=torch.long, device=logits.device)
    if contexts.dim() != 2 or contexts.shape[0] != logits.shape[0] or contexts.is_floating_point():
        raise ValueError(
            f"contexts must be an integer tensor [N, T] with N = {logits.shape[0]}, got "
            f"{tuple(contexts.shape)} {contexts.dtype}"
        )
    for proc in processors:
        scores = proc(contexts, scores)
    return scores


def probs_from_logits(processed: torch.Tensor) -> torch.Tensor:
    """Softmax of processed logits, as ``generate`` samples from.

    Args:
        processed: ``[N, V]`` (or ``[V]``) processed logits; ``-inf`` entries get probability exactly 0.

    Returns:
        float32 probabilities of the same shape, rows summing to 1. A row that is entirely ``-inf``
        (every token banned) gives NaN, as it would in ``generate``.
    """
    return torch.softmax(processed.to(torch.float32), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row with ``torch.multinomial``, exactly as ``GenerationMixin._sample``.

    Args:
        probs: ``[N, V]`` non-negative weights (need not be normalised).
        generator: the ``torch.Generator`` to draw from (on ``probs``' device); None = torch's default.

    Returns:
        LongTensor ``[N]``.

    Raises:
        ValueError: ``probs`` is not 2-D.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}; use probs[None] for one row")
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def greedy(processed: torch.Tensor) -> torch.Tensor:
    """Greedy choice per row: ``torch.argmax`` (first maximal index on ties), like ``generate``.

    Args:
        processed: ``[N, V]`` processed logits.

    Returns:
        LongTensor ``[N]``.
    """
    return torch.argmax(processed, dim=-1)
