"""The recipe registry of the training layer: one entry per head family, which the training entry point looks up once.

A recipe's entry says how it trains (``train(run) -> heads directory``) and what self-distillation may keep of
the target's features for it (``capture(cfg, target, budget_bytes)``: a :class:`~selfspec.train.distill_states.
CapturedStates` of the layers its features are made of, or None when it uses none). An entry is keyed by the
family's name (a head family of :mod:`selfspec.heads.families`); the built-in families are registered here, and a new
family registers its recipe with :func:`register_recipe` from its own module: :mod:`selfspec.train.__main__` does not
change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.base.registry import register_once
from selfspec.heads.families import head_family
from selfspec.train.config import TrainConfig
from selfspec.train.dflash import capture_block, train_block
from selfspec.train.dflash import warm_options as block_warm_options
from selfspec.train.distill_states import CapturedStates
from selfspec.train.eagle import train_eagle
from selfspec.train.eagle import warm_options as eagle_warm_options
from selfspec.train.eagle3 import capture_eagle3, train_eagle3
from selfspec.train.eagle3 import warm_options as eagle3_warm_options
from selfspec.train.inputs import RunInputs
from selfspec.train.medusa import train_medusa
from selfspec.train.medusa import warm_options as medusa_warm_options
from selfspec.train.medusa2 import train_medusa2
from selfspec.train.online import OnlineAdapter, OnlineOptions
from selfspec.train.warm_start import WarmOptions, warm_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["RECIPES", "RecipeEntry", "online_adapter", "recipe_for", "register_recipe"]


def capture_last_state(cfg: TrainConfig, target: PreTrainedModel, budget_bytes: int) -> CapturedStates:
    """Medusa-1 and EAGLE-1 train on the target's last hidden state: that is what self-distillation keeps."""
    return CapturedStates(None, budget_bytes)


def capture_nothing(cfg: TrainConfig, target: PreTrainedModel, budget_bytes: int) -> None:
    """Medusa-2 trains its target: features computed before training are not the ones it trains on."""
    return None


@dataclass(frozen=True)
class RecipeEntry:
    """One head family's recipe.

    Attributes:
        train: trains the head on a run's inputs; returns the saved head directory (``<output_dir>/heads``).
        capture: what self-distillation keeps of the target features for this recipe (see the module docstring).
        variant: ``variant(cfg) -> RecipeEntry``: the recipe a config's options choose within the family (Medusa's
            ``medusa.joint`` chooses Medusa-2), or None: this one.
        warm_options: the options saved heads of the family fix for a run that starts from them (``init_heads``,
            :mod:`selfspec.train.warm_start`); None: the family has no warm start.
        online: ``online(head, target, options) -> adapter``: the family's online adapter
            (:class:`~selfspec.train.online.OnlineAdapter` for EAGLE-3), which ``selfspec.load(..., adapt=...)``
            attaches; None: the family adapts offline only (``selfspec adapt``).
    """

    train: Callable[[RunInputs], Path]
    capture: Callable[[TrainConfig, PreTrainedModel, int], CapturedStates | None]
    variant: Callable[[TrainConfig], RecipeEntry] | None = None
    warm_options: WarmOptions | None = None
    online: Callable[[torch.nn.Module, PreTrainedModel, OnlineOptions | None], OnlineAdapter] | None = None


MEDUSA2 = RecipeEntry(train_medusa2, capture_nothing)


def medusa_variant(cfg: TrainConfig) -> RecipeEntry:
    """Medusa-2 (:mod:`selfspec.train.medusa2`) with ``medusa.joint``, else Medusa-1."""
    return MEDUSA2 if cfg.medusa.joint else RECIPES["medusa"]


RECIPES: dict[str, RecipeEntry] = {}


def register_recipe(name: str, entry: RecipeEntry) -> RecipeEntry:
    """Register ``entry`` as the recipe of the head family ``name`` (registering the same entry again is a no-op).

    Returns:
        ``entry``.

    Raises:
        HeadFormatError: ``name`` is no registered head family (register its heads first).
        ValueError: another recipe is registered under ``name``.
    """
    head_family(name)
    return register_once(RECIPES, name, entry, "the recipe of head family")


for _name, _entry in (
    ("medusa", RecipeEntry(train_medusa, capture_last_state, medusa_variant, medusa_warm_options)),
    ("eagle", RecipeEntry(train_eagle, capture_last_state, warm_options=eagle_warm_options)),
    ("eagle3", RecipeEntry(train_eagle3, capture_eagle3, warm_options=eagle3_warm_options, online=OnlineAdapter)),
    ("dflash", RecipeEntry(train_block, capture_block, warm_options=block_warm_options)),
    ("dspark", RecipeEntry(train_block, capture_block, warm_options=block_warm_options)),
):
    register_recipe(_name, _entry)


def warm_started(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the head shape of its ``init_heads`` (:func:`~selfspec.train.warm_start.warm_config`)."""
    return warm_config(cfg, {name: e.warm_options for name, e in RECIPES.items() if e.warm_options is not None})


def recipe_for(cfg: TrainConfig) -> RecipeEntry:
    """The recipe of ``cfg``: its ``head``'s entry, or the variant the entry chooses for ``cfg``.

    Raises:
        ValueError: the family has no training recipe (register one with :func:`register_recipe`).
    """
    entry = RECIPES.get(cfg.head)
    if entry is None:
        raise ValueError(
            f"head family {cfg.head!r} has no training recipe; registered: {sorted(RECIPES)} (a new family registers "
            "one with selfspec.train.recipes.register_recipe)"
        )
    return entry.variant(cfg) if entry.variant is not None else entry


def online_adapter(
    head: torch.nn.Module, target: PreTrainedModel, options: OnlineOptions | None = None
) -> OnlineAdapter:
    """The online adapter the head's family declares (:attr:`RecipeEntry.online`), attached to ``head``.

    Args:
        head: a loaded head module (its ``config.head_type`` names the family).
        target: the target it drafts for.
        options: :class:`~selfspec.train.online.OnlineOptions` (None: the defaults).

    Raises:
        ValueError: the family declares no online adapter (the message names those that do, and ``selfspec adapt``).
    """
    family = str(head.config.head_type)
    entry = RECIPES.get(family)
    if entry is None or entry.online is None:
        online = sorted(name for name, e in RECIPES.items() if e.online is not None)
        raise ValueError(
            f"online adaptation trains {', '.join(online)} heads; these are {family} heads: adapt them offline with "
            "selfspec adapt, or load without adapt="
        )
    return entry.online(head, target, options)
