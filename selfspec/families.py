"""The family registry of the API layer: what ``selfspec.load``, the bench, ``selfspec export`` and the model card
need of each head family, one record per family, registered once.

A family is named by its ``head_type`` and exists in the heads layer first (:mod:`selfspec.heads.families`: its head
class and strict loader); its training recipe is registered in :mod:`selfspec.train.recipes`; this record holds the
rest: how its heads become a drafter (with the tree sized through :mod:`selfspec.decode.tuning.budget`), the drafter
options it takes, the export layouts it has per format, and its model-card text. Each layer keeps only what it holds,
keyed by the one name, so the imports still go downward; code that needs something of a family asks
:func:`family` / :func:`family_of` and never switches on the name.

The built-in records are :mod:`selfspec.family_records`. A new family is its own files plus one :func:`register_family`
call (and, below, its :func:`~selfspec.heads.families.register_head_family` and
:func:`~selfspec.train.recipes.register_recipe`); ``tests/helpers/toy_family.py`` is one, defined entirely in the
tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from selfspec.base.registry import register_once
from selfspec.card_text import CardText
from selfspec.heads.families import HeadFamily, head_family
from selfspec.heads.families import family_of as head_family_of

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "BUILTIN_RECORDS",
    "EXPORT_FORMATS",
    "Exporter",
    "Family",
    "family",
    "family_of",
    "register_family",
    "registered_families",
]

# The formats ``selfspec export`` writes; a family lists the ones it has a layout in (Family.exports).
EXPORT_FORMATS = ("speculators", "sglang", "gguf", "openvino")

# ``export(head, out_dir, *, target_name_or_path=..., **options) -> written path``: one family's layout in one format
# (a format's own options pass on: gguf takes ``name``, ``outtype`` and ``llamacpp``).
Exporter = Callable[..., Path]

BUILTIN_RECORDS = "selfspec.family_records"
"""The module that registers the built-in families' records, imported the first time a family is asked for (so this
registry imports no exporter: the export package's command asks it, and nothing here imports that package)."""


@dataclass(frozen=True)
class Family:
    """One head family as the API layer uses it.

    Attributes:
        name: the family's ``head_type`` (a family registered in :mod:`selfspec.heads.families`).
        make_drafter: ``make(setup, **options) -> (drafter, tree budget choice or None)``: the head of a
            :class:`~selfspec.head_drafters.DraftSetup` (on the target's device and dtype) as a drafter, its tree sized
            to this machine with ``tune="auto"`` (:mod:`selfspec.head_drafters`).
        drafter_options: the keyword options of ``selfspec.load`` its ``make_drafter`` reads (the bench passes only
            these on).
        exports: ``{format: exporter}`` for each format of :data:`EXPORT_FORMATS` that holds this family; ``selfspec
            export`` refuses the others with the formats that do.
        export_hint: ``export_hint(head) -> str``: what to do with ``head`` when a format does not hold its family
            (said in that refusal; it names a format that takes this very head, or none).
        card: the model card's text (:class:`~selfspec.card_text.CardText`).
        tree_tuning: what ``selfspec tune-tree`` does for the family: ``"acceptance_profile"`` (EAGLE-2 trees:
            decode prompts for an acceptance profile, then choose the budget), ``"head_accuracy"`` (a static tree sized
            from the heads' held-out accuracies), or None (nothing to tune: ``selfspec.load`` sizes the tree itself).
        llamacpp_spec_type: llama.cpp's ``--spec-type`` for the family's drafts (``"draft-eagle3"``, ...), or None:
            llama.cpp has no drafter for it.
    """

    name: str
    make_drafter: Callable[..., tuple[Any, Any]]
    drafter_options: tuple[str, ...] = ()
    exports: Mapping[str, Exporter] = field(default_factory=dict)
    export_hint: Callable[[Any], str] = lambda head: "no export format holds them; serve them with selfspec"
    card: CardText | None = None
    tree_tuning: str | None = None
    llamacpp_spec_type: str | None = None

    @property
    def heads(self) -> HeadFamily:
        """The family's heads-layer record (title, head class, loader)."""
        return head_family(self.name)

    @property
    def title(self) -> str:
        """The family's name for people (``"EAGLE-3"``)."""
        return self.heads.title

    @property
    def card_title(self) -> str:
        """The family's name on a model card and in a Hub commit message."""
        return (self.card.title if self.card is not None else None) or self.title


_FAMILIES: dict[str, Family] = {}


def register_family(record: Family) -> Family:
    """Register ``record`` (its heads must be registered already; registering the same record again is a no-op).

    Returns:
        ``record``.

    Raises:
        HeadFormatError: no head family of that name (register it with ``register_head_family`` first).
        ValueError: another record under the same name, or an export format not in :data:`EXPORT_FORMATS`.
    """
    head_family(record.name)
    if record.tree_tuning not in (None, "acceptance_profile", "head_accuracy"):
        raise ValueError(f"family {record.name!r}: tree_tuning {record.tree_tuning!r} is not one of the Family docs'")
    unknown = sorted(set(record.exports) - set(EXPORT_FORMATS))
    if unknown:
        raise ValueError(
            f"family {record.name!r} exports to unknown formats {unknown}; formats: {list(EXPORT_FORMATS)}"
        )
    return register_once(_FAMILIES, record.name, record, "family")


def _load_builtins() -> None:
    importlib.import_module(BUILTIN_RECORDS)  # the module registers the built-in records as it runs


def registered_families() -> tuple[str, ...]:
    """The names of the families registered here, the built-in ones first, in registration order."""
    _load_builtins()
    return tuple(_FAMILIES)


def family(name: Any) -> Family:
    """The registered family ``name``.

    Raises:
        HeadFormatError: no head family of that name (the message lists them).
        ValueError: a head family that has no record here (register it with :func:`register_family`).
    """
    heads = head_family(name)
    if heads.name not in _FAMILIES:
        _load_builtins()
    record = _FAMILIES.get(heads.name)
    if record is None:
        raise ValueError(
            f"head family {heads.name!r} has no drafter, export or card record: register one with "
            "selfspec.families.register_family"
        )
    return record


def family_of(head: nn.Module) -> Family:
    """The family record of a head module (by its ``config.head_type``, checked against its class).

    Raises:
        HeadFormatError: not a head of a registered family; ValueError: see :func:`family`.
    """
    return family(head_family_of(head).name)
