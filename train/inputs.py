"""The inputs of one training run, as one value: what the entry point hands a recipe, and a recipe its features."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from selfspec.train.config import TrainConfig
    from selfspec.train.distill_states import CapturedStates


@dataclass(frozen=True)
class RunInputs:
    """What a training run trains from.

    Attributes:
        cfg: the run's configuration.
        accelerator: the ``accelerate`` state (device, processes, mixed precision, accumulation).
        target: the frozen target.
        tokenizer: its tokenizer (None where the conversations are already token ids, or nothing is decoded).
        train_convs, eval_convs: the whole training and held-out splits, the same on every process.
        heldout_ids: the held-out conversation ids for the training record, in split order (None: the ids of
            ``eval_convs``; a self-distilling run passes the split's ids before regeneration).
        captured: target features self-distillation computed, reused instead of running the target again
            (:mod:`selfspec.train.distill_states`); None: none.
    """

    cfg: TrainConfig
    accelerator: Accelerator
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    train_convs: list[dict]
    eval_convs: list[dict]
    heldout_ids: list[str] | None = None
    captured: CapturedStates | None = None

    def heldout(self) -> list[str]:
        """The held-out ids the training record names: ``heldout_ids``, else the ids of ``eval_convs``."""
        return [c["id"] for c in self.eval_convs] if self.heldout_ids is None else list(self.heldout_ids)
