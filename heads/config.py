"""Shared pieces of every head family: the draft vocabulary map and strict config parsing.

File reading and writing: :mod:`selfspec.heads.io`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from selfspec.base.files import read_dataclass

# Re-exported: callers import the error and the readers from here as well as from selfspec.heads.io.
from selfspec.heads.io import CONFIG_NAME, HeadFormatError, check_fingerprint, read_json, read_safetensors

__all__ = [
    "HeadFormatError",
    "check_family_fields",
    "check_layer_ids",
    "config_from_dict",
    "draft_vocab_from_counts",
    "read_json",
    "read_safetensors",
    "read_selfspec_config",
]

C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any], where: str = "config") -> C:
    """Build a frozen dataclass head config from a dict strictly (:func:`selfspec.base.files.read_dataclass`:
    fields with a default may be missing, so configs written before a field existed still load).

    Raises:
        HeadFormatError: an unknown key (the message lists the valid ones), a missing required key, a value of
            the wrong type, or a value the config refuses; the message names ``where`` and the key.
    """
    try:
        return read_dataclass(cls, data, where, defaults=True)
    except (TypeError, ValueError) as err:
        raise HeadFormatError(str(err)) from err


def read_selfspec_config(
    directory: Path, raw: dict[str, Any], cls: type[C], target_fingerprint: str | None = None
) -> C:
    """The ``selfspec`` object of a head's ``config.json`` (``raw``, read from ``directory``; the object is popped
    from it) as the family's config ``cls`` (:func:`config_from_dict`), and the head's target checked.

    Args:
        directory: the head directory (named in the messages).
        raw: the parsed ``config.json``.
        cls: the family's frozen config dataclass (with ``target`` and ``target_fingerprint`` fields).
        target_fingerprint: when given, must equal the stored fingerprint
            (:func:`~selfspec.heads.io.check_fingerprint`).

    Raises:
        HeadFormatError: no ``selfspec`` object, an invalid one, or a head trained on another target.
    """
    where = directory / CONFIG_NAME
    ours = raw.pop("selfspec", None)
    if not isinstance(ours, dict):
        raise HeadFormatError(f"{where} lacks its 'selfspec' object; re-export with save_pretrained")
    try:
        config = config_from_dict(cls, ours, where=f"{where} ['selfspec']")
    except (TypeError, ValueError) as err:
        raise HeadFormatError(f"{where} ['selfspec']: {err}") from err
    check_fingerprint(directory, config.target_fingerprint, target_fingerprint, config.target)
    return config


def check_family_fields(
    head_type: str, expected: str | tuple[str, ...], draft_vocab_size: int | None, vocab_size: int
) -> None:
    """The checks every head config makes of the fields all families share.

    Args:
        head_type: the config's ``head_type``.
        expected: the family's head type, or the types one config class serves (DFlash and DSpark).
        draft_vocab_size: S, the draft vocabulary's size; None: the full vocabulary.
        vocab_size: V, the target's vocabulary size.

    Raises:
        HeadFormatError: another head type, or S outside ``[1, V]``.
    """
    if head_type not in ((expected,) if isinstance(expected, str) else expected):
        raise HeadFormatError(
            f"head_type {head_type!r} is not " + (repr(expected) if isinstance(expected, str) else f"one of {expected}")
        )
    if draft_vocab_size is not None and not 1 <= draft_vocab_size <= vocab_size:
        raise HeadFormatError(f"draft_vocab_size must be in [1, vocab_size={vocab_size}]")


def check_layer_ids(
    field: str, ids: Sequence[int], low: int, high: int | None = None, count: int | None = None
) -> tuple[int, ...]:
    """The one check of the target layers a head takes: EAGLE-3's ``target_layers`` (layer inputs,
    ``hidden_states[i]``), the block heads' ``target_layer_ids`` (layer outputs, ``hidden_states[i + 1]``), and the
    training options that set them before the target is known.

    Args:
        field: the field's name as the user writes it (named in the message).
        ids: the layer indices (anything integer-like).
        low, high: the range every index must lie in, both included; ``high`` None: not known yet (no upper bound).
        count: how many indices there must be; None: at least one.

    Returns:
        ``ids`` as a tuple of ints.

    Raises:
        HeadFormatError: an index that is not an integer, too few or too many, or one out of range; the message
            names the field, the range and what was given.
    """
    try:
        layers = tuple(operator.index(i) for i in ids)
    except TypeError as err:
        raise HeadFormatError(f"{field} must be layer indices (integers), got {ids!r}") from err
    span = f"[{low}, {high}]" if high is not None else f">= {low}"
    if count is not None and len(layers) != count:
        raise HeadFormatError(f"{field} must be {count} layer indices, each {span}; got {layers}")
    if not layers or not all(low <= i and (high is None or i <= high) for i in layers):
        raise HeadFormatError(f"{field} must be layer indices, each {span}; got {layers}")
    return layers


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
