"""Draft heads (nn.Modules only): Medusa-1, EAGLE-1/2.

``load_heads(directory)`` reads ``config.json`` and dispatches on its ``head_type``.
"""

from __future__ import annotations

from pathlib import Path

from selfspec.heads.config import HeadFormatError, read_json


def load_heads(directory: str | Path, target=None):
    """Load a head directory written by ``save_pretrained`` (strict: nothing is half-loaded).

    Args:
        directory: folder with ``config.json`` and ``model.safetensors``.
        target: the frozen target; when given, its fingerprint must match and its lm_head / embeddings
            are attached.

    Raises:
        HeadFormatError: unknown ``head_type``, missing or corrupt files, mismatched tensors, other target.
    """
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise HeadFormatError(f"{d} has no config.json: pass the directory written by save_pretrained (…/heads)")
    head_type = read_json(d / "config.json").get("head_type")
    fingerprint = None
    if target is not None:
        from selfspec.heads.fingerprint import target_fingerprint

        fingerprint = target_fingerprint(target)
    if head_type == "medusa":
        from selfspec.heads.medusa import MedusaHeads

        lm_head = target.get_output_embeddings().weight if target is not None else None
        return MedusaHeads.from_pretrained(d, target_lm_head=lm_head, target_fingerprint=fingerprint)
    if head_type == "eagle":
        from selfspec.heads.eagle import EagleHead

        return EagleHead.from_pretrained(d, target=target, target_fingerprint=fingerprint)
    raise HeadFormatError(f"{d / 'config.json'} has head_type {head_type!r}; expected 'medusa' or 'eagle'")
