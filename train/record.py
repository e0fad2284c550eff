"""``<heads>/training_record.json``: what a head was trained on, so later tools (the bench's held-out
prompts) read the run's own split instead of assuming defaults.

Layout (version 1)::

    {"format": "selfspec-training-record", "version": 1, "head": "eagle" | "medusa", "target": str,
     "target_adapter": str | null, "target_fingerprint": str, "data": str, "max_conversations": int | null,
     "eval_fraction": float, "seed": int, "max_length": int, "heldout_ids": [str, ...], "calibration_ids": [str, ...]}

``heldout_ids`` are the conversation ids (``conv["id"]`` of :func:`selfspec.train.data.load_conversations`)
of the held-out split in split order (:func:`selfspec.train.data.split_conversations`); ``calibration_ids``
those the post-training calibration decoded (empty when it did not run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from selfspec.base.fingerprint import target_fingerprint
from selfspec.train.config import TrainConfig
from selfspec.train.data import prompt_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RECORD_FORMAT = "selfspec-training-record"
RECORD_VERSION = 1
RECORD_FILE = "training_record.json"


def training_record(
    cfg: TrainConfig, head: str, target: PreTrainedModel, heldout_ids: list[str], calibration_ids: list[str]
) -> dict[str, Any]:
    """The record of a run with ``cfg`` training a ``head`` family head on ``target`` (layout: module docstring)."""
    return {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "head": head,
        "target": cfg.target,
        "target_adapter": cfg.target_adapter,
        "target_fingerprint": target_fingerprint(target),
        "data": cfg.data,
        "max_conversations": cfg.max_conversations,
        "eval_fraction": cfg.eval_fraction,
        "seed": cfg.seed,
        "max_length": cfg.max_length,
        "heldout_ids": [str(i) for i in heldout_ids],
        "calibration_ids": [str(i) for i in calibration_ids],
    }


def calibration_ids(cfg: TrainConfig, eval_convs: list[dict]) -> list[str]:
    """Ids of the held-out conversations :func:`selfspec.train.calibrate.calibrate_head` decodes: the last
    ``cfg.calibrate_prompts`` that have a prompt (none when it is 0)."""
    if cfg.calibrate_prompts <= 0:
        return []
    return [c["id"] for c in eval_convs if prompt_messages(c)][-cfg.calibrate_prompts :]
