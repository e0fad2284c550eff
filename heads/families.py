"""The head-family registry of the heads layer: which head families exist and how each one's directory loads.

A head family is named once, by the ``head_type`` its ``config.json`` holds, and registered here by its own module
with :func:`register_head_family` (the built-in families at the end of ``heads/medusa.py``, ``heads/eagle.py``,
``heads/eagle3.py`` and ``heads/dflash.py``). A built-in family's module is named in :data:`BUILTIN_FAMILIES` and
imported the first time the family is asked for, so importing a package or a module registers nothing as a side
effect and loads no head module it does not use. Every layer above keeps its own part of a family, keyed by
the same name, in its own registry (the training recipe in :mod:`selfspec.train.recipes`, the drafter, the export
layouts and the model-card text in :mod:`selfspec.families`), so each layer asks only for what it holds and the
imports still go downward. Code that needs something of a family asks a registry; it never switches on the name.

This module imports nothing but the strict reader's error at module level, so every head module (and
:mod:`selfspec.heads.hub`, which checks a Hub repo names a family before downloading it) can import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from selfspec.base.registry import register_once
from selfspec.heads.io import HeadFormatError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

__all__ = ["HeadFamily", "family_of", "head_families", "head_family", "register_head_family"]


@dataclass(frozen=True)
class HeadFamily:
    """A head family as the heads layer knows it.

    Attributes:
        name: the family's ``head_type`` (in ``config.json`` and in every registry above this one).
        title: the family's name for people (``"EAGLE-3"``), used in messages, reports and model cards.
        head_class: the ``nn.Module`` class of its heads (one class may serve several families: ``BlockHead`` serves
            DFlash and DSpark, told apart by ``head.config.head_type``).
        load: ``load(directory, target, target_fingerprint) -> head``: the family's strict loader of a local head
            directory; ``target`` (or None) is the frozen target whose lm_head / embeddings the head shares, and
            ``target_fingerprint`` (or None) must equal the stored one. Raises ``HeadFormatError``.
    """

    name: str
    title: str
    head_class: type
    load: Callable[[Path, PreTrainedModel | None, str | None], nn.Module]


# The built-in families: name -> the heads-layer module that defines and registers it (tests/test_layers.py holds
# the table to that layer).
BUILTIN_FAMILIES: Mapping[str, str] = {
    "medusa": "selfspec.heads.medusa",
    "eagle": "selfspec.heads.eagle",
    "eagle3": "selfspec.heads.eagle3",
    "dflash": "selfspec.heads.dflash",
    "dspark": "selfspec.heads.dflash",
}

_FAMILIES: dict[str, HeadFamily] = {}


def _registered(name: Any) -> HeadFamily | None:
    """The record of ``name``, its built-in module imported first when it has not registered yet; None: unknown."""
    if isinstance(name, str) and name not in _FAMILIES and name in BUILTIN_FAMILIES:
        importlib.import_module(BUILTIN_FAMILIES[name])  # the module registers the family as it runs
    return _FAMILIES.get(name) if isinstance(name, str) else None


def register_head_family(family: HeadFamily) -> HeadFamily:
    """Register ``family`` (once per process; registering the same record again is a no-op).

    Returns:
        ``family``.

    Raises:
        ValueError: another record is registered under the same name.
    """
    return register_once(_FAMILIES, family.name, family, "head family")


def head_families() -> tuple[str, ...]:
    """The family names: the built-in ones, then the others in registration order (no module is imported)."""
    return tuple(dict.fromkeys([*BUILTIN_FAMILIES, *_FAMILIES]))


def head_family(name: Any) -> HeadFamily:
    """The registered family ``name``.

    Raises:
        HeadFormatError: no family of that name; the message lists the registered ones.
    """
    family = _registered(name)
    if family is None:
        raise HeadFormatError(
            f"head_type {name!r} names no selfspec head family; expected one of {list(head_families())} (a new family "
            "registers itself with selfspec.heads.families.register_head_family)"
        )
    return family


def family_of(head: Any) -> HeadFamily:
    """The family of a head module: its ``config.head_type``, which must name a registered family whose class the
    head is an instance of.

    Raises:
        HeadFormatError: ``head`` is not a head of a registered family (the message names its type).
    """
    if not any(isinstance(head, family.head_class) for family in _FAMILIES.values()):
        raise HeadFormatError(
            f"not a selfspec head: {type(head).__name__}; load one with selfspec.heads.load_heads(DIR) (registered "
            f"families: {list(head_families())})"
        )
    family = _registered(head.config.head_type)
    if family is None or not isinstance(head, family.head_class):
        raise HeadFormatError(
            f"a {type(head).__name__} whose config names head_type {head.config.head_type!r}, which is not its "
            "family: build the head with its own family's config"
        )
    return family
