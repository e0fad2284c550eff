"""A ``transformers`` ``generate`` call's arguments in selfspec's terms, so the same call decodes the same way.

* :func:`resolve_generation_config`: the ``GenerationConfig`` a call decodes with, by ``generate``'s own precedence
  (``GenerationMixin._prepare_generation_config``, transformers 5.x): the call's arguments, then the
  ``generation_config=`` passed, then the target's ``generation_config``; what is still unset takes ``generate``'s
  global defaults when :meth:`~selfspec.decode.sampling.SamplingConfig.from_generation_config` reads it (``top_k``
  50, ``temperature`` 1, ``top_p`` 1). So ``model.generate(ids, do_sample=True, temperature=0.7)`` samples from the
  distribution ``target.generate(ids, do_sample=True, temperature=0.7)`` samples from.
* :func:`new_token_budget`: ``max_new_tokens``, else ``max_length`` less the prompt's (padded) length.
* :func:`prompt_rows`: the prompts of a padded ``input_ids`` batch (left or right padding, by ``attention_mask``).
* :func:`check_vocab`: every prompt id inside the target's vocabulary.
* :class:`SequencesOutput`: the ``return_dict_in_generate=True`` result, ``sequences`` as ``generate`` returns them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from selfspec.decode.request import GenerationOutput

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "SequencesOutput",
    "build_sequences",
    "check_vocab",
    "new_token_budget",
    "prompt_rows",
    "resolve_generation_config",
]

DEFAULT_MAX_NEW_TOKENS = 128
"""New tokens when neither the call nor a generation config sets ``max_new_tokens`` or ``max_length`` (``generate``
itself would stop at a total length of 20)."""


def resolve_generation_config(
    target: Any, generation_config: GenerationConfig | None = None, **explicit: Any
) -> GenerationConfig:
    """The generation settings of a call, by ``generate``'s precedence: ``explicit`` values that are not None, then
    ``generation_config``, then ``target.generation_config``; fields none of them sets stay None (unset).

    Args:
        target: the ``transformers`` causal LM (its ``generation_config`` may be None).
        generation_config: the call's ``GenerationConfig`` (not modified).
        explicit: the call's own arguments (``do_sample``, ``temperature``, ``top_k``, ``max_new_tokens`` ...);
            None means not given.

    Returns:
        A new ``GenerationConfig``.
    """
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    if target.generation_config is not None:
        config.update(**target.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**{name: value for name, value in explicit.items() if value is not None})
    return config


def new_token_budget(max_new_tokens: int | None, max_length: int | None, prompt_length: int) -> int:
    """New tokens of a call: ``max_new_tokens``, else ``max_length - prompt_length`` (``generate``'s rule;
    ``prompt_length`` is a padded batch's width), else :data:`DEFAULT_MAX_NEW_TOKENS`. The caller passes the call's
    values, else its generation config's; the request checks the number.

    Raises:
        ValueError: ``max_length`` leaves no room after the prompt.
    """
    if max_new_tokens is not None:
        return max_new_tokens
    if max_length is None:
        return DEFAULT_MAX_NEW_TOKENS
    if max_length <= prompt_length:
        raise ValueError(
            f"max_length={max_length} leaves no room after the prompt's {prompt_length} tokens: pass a larger "
            "max_length, or max_new_tokens"
        )
    return max_length - prompt_length


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The prompts of a batch ``input_ids`` ``[B, T]`` (or ``[T]``): row i's tokens where ``attention_mask[i]`` is 1.

    Args:
        input_ids: LongTensor ``[B, T]`` or ``[T]``, left- or right-padded.
        attention_mask: ``[B, T]`` (or ``[T]``) of 0 / 1, each row's ones contiguous (padding on one side); None:
            every token is a prompt token.

    Returns:
        B LongTensors ``[T_i]``, on ``input_ids``' device.

    Raises:
        ValueError: not an integer tensor of one or two dimensions, a mask of another shape, or a row whose mask
            has holes or no ones.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be an integer tensor [B, T] or [T], got {input_ids!r:.80}")
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if attention_mask is None:
        return list(ids)
    mask = attention_mask if attention_mask.dim() == 2 else attention_mask[None]
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask {tuple(mask.shape)} must have input_ids' shape {tuple(ids.shape)}")
    rows = []
    for i, (row, keep) in enumerate(zip(ids, mask.bool(), strict=True)):
        where = keep.nonzero().flatten().tolist()
        if not where or where[-1] - where[0] + 1 != len(where):
            raise ValueError(
                f"attention_mask row {i} must mark one run of prompt tokens (padding on the left or the right), "
                f"got {keep.int().tolist()}"
            )
        rows.append(row[where[0] : where[-1] + 1])
    return rows


def check_vocab(rows: Sequence[torch.Tensor], vocab_size: int) -> None:
    """Refuse prompt ids outside ``[0, vocab_size)`` (the target's embedding would raise an IndexError mid-call).

    Raises:
        ValueError: the first row holding such an id, with the id and the range.
    """
    for i, row in enumerate(rows):
        if row.numel() and (int(row.min()) < 0 or int(row.max()) >= vocab_size):
            bad = int(row.min()) if int(row.min()) < 0 else int(row.max())
            raise ValueError(
                f"prompt {i} holds token id {bad}, outside the target's vocabulary [0, {vocab_size}): encode the "
                "prompt with the target's own tokenizer"
            )


@dataclass(frozen=True)
class SequencesOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns.

    Attributes:
        sequences: LongTensor ``[B, T + N]``: each row's prompt (as given when ``input_ids`` was a tensor, padding
            included; else left-padded to the longest prompt, T) then its new tokens, right-padded with
            ``pad_token_id`` to the longest output N (``generate``'s layout).
        prompt_length: T, the width of the prompt part.
        outputs: the :class:`~selfspec.decode.request.GenerationOutput` of every row (tokens, text, stats).
    """

    sequences: torch.Tensor
    prompt_length: int
    outputs: list[GenerationOutput]


def build_sequences(
    prompts: torch.Tensor | Sequence[torch.Tensor], outputs: Sequence[GenerationOutput], pad_token_id: int
) -> SequencesOutput:
    """``generate``'s ``sequences`` for prompts (a ``[B, T]`` tensor kept as given, or a list of ``[T_i]`` rows,
    left-padded) and their outputs, padded with ``pad_token_id``; on the prompts' device."""
    if isinstance(prompts, torch.Tensor):
        head = prompts if prompts.dim() == 2 else prompts[None]
    else:
        width = max(row.numel() for row in prompts)
        device = prompts[0].device
        head = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
        for i, row in enumerate(prompts):
            head[i, width - row.numel() :] = row
    longest = max(len(out.tokens) for out in outputs)
    tail = torch.full((len(outputs), longest), pad_token_id, dtype=torch.long, device=head.device)
    for i, out in enumerate(outputs):
        tail[i, : len(out.tokens)] = torch.tensor(out.tokens, dtype=torch.long)
    return SequencesOutput(torch.cat([head.long(), tail], dim=1), head.shape[1], list(outputs))
