"""Shared pieces of every head family: the draft vocabulary map and strict config parsing.

File reading and writing: :mod:`selfspec.heads.io`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

# Re-exported: callers import the error and the readers from here as well as from selfspec.heads.io.
from selfspec.heads.io import HeadFormatError, read_json, read_safetensors

__all__ = ["HeadFormatError", "config_from_dict", "draft_vocab_from_counts", "read_json", "read_safetensors"]

C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any], where: str = "config") -> C:
    """Build a frozen dataclass config from a dict, refusing unknown keys.

    Raises:
        HeadFormatError: a key is not a field of ``cls`` (the message lists the valid fields).
    """
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise HeadFormatError(f"unknown keys {unknown} in {where}; valid keys are {sorted(fields)}.")
    return cls(**data)  # type: ignore[call-arg]


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target token ids, sorted ascending (the FR-Spec / EAGLE-3 reduced vocabulary).

    Args:
        counts: ``[V]`` integer or float token counts over the training data.
        size: draft vocabulary size S <= V.

    Returns:
        ``d2t_ids``: LongTensor ``[S]`` of target token ids; draft id ``i`` is target id ``d2t_ids[i]``.

    Raises:
        ValueError: ``size`` is not in ``[1, V]``.
    """
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocab size must be in [1, {counts.numel()}], got {size}")
    # Stable ordering: count descending, id ascending on ties, so the map is reproducible.
    order = torch.argsort(-counts.to(torch.float64), stable=True)
    return torch.sort(order[:size]).values
