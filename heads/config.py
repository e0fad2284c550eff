"""Shared pieces of every head family: the draft vocabulary map and strict config parsing.

File reading and writing: :mod:`selfspec.heads.io`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from selfspec.heads.files import read_dataclass

# Re-exported: callers import the error and the readers from here as well as from selfspec.heads.io.
from selfspec.heads.io import HeadFormatError, read_json, read_safetensors

__all__ = ["HeadFormatError", "config_from_dict", "draft_vocab_from_counts", "read_json", "read_safetensors"]

C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any], where: str = "config") -> C:
    """Build a frozen dataclass head config from a dict strictly (:func:`selfspec.heads.files.read_dataclass`:
    fields with a default may be missing, so configs written before a field existed still load).

    Raises:
        HeadFormatError: an unknown key (the message lists the valid ones), a missing required key, a value of
            the wrong type, or a value the config refuses; the message names ``where`` and the key.
    """
    try:
        return read_dataclass(cls, data, where, defaults=True)
    except (TypeError, ValueError) as err:
        raise HeadFormatError(str(err)) from err


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
