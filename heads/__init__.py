"""Draft heads (nn.Modules only): Medusa-1, EAGLE-1/2, EAGLE-3, and the block drafters DFlash and DSpark.

``load_heads(directory)`` reads ``config.json`` and dispatches on its ``head_type``; every family reads and
writes its directory through :mod:`selfspec.heads.io`, and takes a Hub repo id for the directory and pushes
to the Hub through :mod:`selfspec.heads.hub`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.dflash import BLOCK_HEAD_TYPES, BlockHead
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.heads.hub import HEAD_TYPES, resolve_head_dir
from selfspec.heads.io import CONFIG_NAME, HeadFormatError, read_config
from selfspec.heads.medusa import MedusaHeads

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["HEAD_TYPES", "BlockHead", "Eagle3Head", "EagleHead", "HeadFormatError", "MedusaHeads", "load_heads"]


def load_heads(
    directory: str | Path,
    target: PreTrainedModel | None = None,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
) -> MedusaHeads | EagleHead | Eagle3Head | BlockHead:
    """Load a head directory written by ``save_pretrained`` (strict: nothing is half-loaded).

    Args:
        directory: folder with ``config.json`` and ``model.safetensors``, or a Hub repo id of heads pushed
            with ``push_to_hub`` (downloaded by :func:`selfspec.heads.hub.resolve_head_dir`).
        target: the frozen target; when given, its fingerprint must match and its lm_head / embeddings
            are attached.
        revision, token: Hub revision and token, for a Hub repo id.

    Raises:
        HeadFormatError: unknown ``head_type``, missing or corrupt files, mismatched tensors, other target;
            a Hub id that does not exist, cannot be reached, or holds no selfspec heads.
    """
    d = resolve_head_dir(directory, revision=revision, token=token)
    head_type = read_config(d).get("head_type")
    fingerprint = target_fingerprint(target) if target is not None else None
    if head_type == "medusa":
        lm_head = target.get_output_embeddings().weight if target is not None else None
        return MedusaHeads.from_pretrained(d, target_lm_head=lm_head, target_fingerprint=fingerprint)
    if head_type == "eagle":
        return EagleHead.from_pretrained(d, target=target, target_fingerprint=fingerprint)
    if head_type == "eagle3":
        return Eagle3Head.from_pretrained(d, target=target, target_fingerprint=fingerprint)
    if head_type in BLOCK_HEAD_TYPES:
        return BlockHead.from_pretrained(d, target=target, target_fingerprint=fingerprint)
    raise HeadFormatError(f"{d / CONFIG_NAME} has head_type {head_type!r}; expected one of {list(HEAD_TYPES)}")
