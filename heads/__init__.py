"""Draft heads (nn.Modules only): Medusa-1, EAGLE-1/2, EAGLE-3.

``load_heads(directory)`` reads ``config.json`` and dispatches on its ``head_type``; every family reads and
writes its directory through :mod:`selfspec.heads.io`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.heads.fingerprint import target_fingerprint
from selfspec.heads.io import CONFIG_NAME, HeadFormatError, read_config
from selfspec.heads.medusa import MedusaHeads

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Eagle3Head", "EagleHead", "HeadFormatError", "MedusaHeads", "load_heads"]

HEAD_TYPES = ("medusa", "eagle", "eagle3")


def load_heads(directory: str | Path, target: PreTrainedModel | None = None) -> MedusaHeads | EagleHead | Eagle3Head:
    """Load a head directory written by ``save_pretrained`` (strict: nothing is half-loaded).

    Args:
        directory: folder with ``config.json`` and ``model.safetensors``.
        target: the frozen target; when given, its fingerprint must match and its lm_head / embeddings
            are attached.

    Raises:
        HeadFormatError: unknown ``head_type``, missing or corrupt files, mismatched tensors, other target.
    """
    d = Path(directory)
    head_type = read_config(d).get("head_type")
    fingerprint = target_fingerprint(target) if target is not None else None
    if head_type == "medusa":
        lm_head = target.get_output_embeddings().weight if target is not None else None
        return MedusaHeads.from_pretrained(d, target_lm_head=lm_head, target_fingerprint=fingerprint)
    if head_type == "eagle":
        return EagleHead.from_pretrained(d, target=target, target_fingerprint=fingerprint)
    if head_type == "eagle3":
        return Eagle3Head.from_pretrained(d, target=target, target_fingerprint=fingerprint)
    raise HeadFormatError(f"{d / CONFIG_NAME} has head_type {head_type!r}; expected one of {list(HEAD_TYPES)}")
