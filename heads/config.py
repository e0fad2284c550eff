"""Shared pieces of every head family: the draft vocabulary map and strict config / file handling."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

import torch

C = TypeVar("C")


class HeadFormatError(ValueError):
    """Raised when a head directory or config is wrong, incomplete or made for another target."""


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


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, turning any parse failure into :class:`HeadFormatError`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HeadFormatError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise HeadFormatError(f"{path} must hold a JSON object")
    return data


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target token ids, sorted ascending (the FR-Spec / EAGLE-3 reduced vocabulary).

    Args:
        counts: ``[V]`` integer or float token counts over the training data.
        size: draft vocabulary size N <= V.

    Returns:
        ``d2t_ids``: LongTensor ``[N]`` of target token ids; draft id ``i`` is target id ``d2t_ids[i]``.

    Raises:
        ValueError: ``size`` is not in ``[1, V]``.
    """
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocab size must be in [1, {counts.numel()}], got {size}")
    # Stable ordering: count descending, id ascending on ties, so the map is reproducible.
    order = torch.argsort(-counts.to(torch.float64), stable=True)
    return torch.sort(order[:size]).values


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file, turning a missing or corrupt file into :class:`HeadFormatError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise HeadFormatError(f"cannot read {path}: {err}; re-export the heads with save_pretrained") from err
