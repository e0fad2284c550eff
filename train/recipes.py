"""The recipe registry: one entry per head family, which the training entry point looks up once.

A recipe's entry says how it trains (``train(run) -> heads directory``) and what self-distillation may keep of
the target's features for it (``capture(cfg, target, budget_bytes)``: a :class:`~selfspec.train.distill_states.
CapturedStates` of the layers its features are made of, or None when it uses none). A new head family is a
new entry here; :mod:`selfspec.train.__main__` does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.train.config import TrainConfig
from selfspec.train.dflash import capture_block, train_block
from selfspec.train.distill_states import CapturedStates
from selfspec.train.eagle import train_eagle
from selfspec.train.eagle3 import capture_eagle3, train_eagle3
from selfspec.train.inputs import RunInputs
from selfspec.train.medusa import train_medusa
from selfspec.train.medusa2 import train_medusa2

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["RECIPES", "RecipeEntry", "recipe_for"]


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
    """

    train: Callable[[RunInputs], Path]
    capture: Callable[[TrainConfig, PreTrainedModel, int], CapturedStates | None]


RECIPES: dict[str, RecipeEntry] = {
    "medusa": RecipeEntry(train_medusa, capture_last_state),
    "medusa2": RecipeEntry(train_medusa2, capture_nothing),
    "eagle": RecipeEntry(train_eagle, capture_last_state),
    "eagle3": RecipeEntry(train_eagle3, capture_eagle3),
    "dflash": RecipeEntry(train_block, capture_block),
    "dspark": RecipeEntry(train_block, capture_block),
}


def recipe_for(cfg: TrainConfig) -> RecipeEntry:
    """The recipe of ``cfg``: its ``head``, with ``medusa.joint`` naming Medusa-2."""
    return RECIPES["medusa2" if cfg.head == "medusa" and cfg.medusa.joint else cfg.head]
