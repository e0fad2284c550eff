"""The one entry point that loads a head directory of any family: :func:`load_heads`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.families import head_family
from selfspec.heads.hub import resolve_head_dir
from selfspec.heads.io import read_config

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

__all__ = ["load_heads"]


def load_heads(
    directory: str | Path,
    target: PreTrainedModel | None = None,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
) -> nn.Module:
    """Load a head directory written by ``save_pretrained`` (strict: nothing is half-loaded).

    Args:
        directory: folder with ``config.json`` and ``model.safetensors``, or a Hub repo id of heads pushed
            with ``push_to_hub`` (downloaded by :func:`selfspec.heads.hub.resolve_head_dir`).
        target: the frozen target; when given, its fingerprint must match and its lm_head / embeddings
            are attached.
        revision, token: Hub revision and token, for a Hub repo id.

    Returns:
        The head module of the family its ``config.json`` names (``MedusaHeads``, ``EagleHead``, ``Eagle3Head``,
        ``BlockHead``, or a registered family's).

    Raises:
        HeadFormatError: a ``head_type`` no registered family has, missing or corrupt files, mismatched tensors,
            another target; a Hub id that does not exist, cannot be reached, or holds no selfspec heads.
    """
    d = resolve_head_dir(directory, revision=revision, token=token)
    family = head_family(read_config(d).get("head_type"))
    return family.load(d, target, target_fingerprint(target) if target is not None else None)
