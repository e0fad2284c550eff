"""Strict reading and atomic writing of head directories, shared by every head family.

A head directory holds the head alone, never target weights::

    config.json                 the family's config (``head_type`` names the family)
    model.safetensors           the head's tensors
    draft_vocab.safetensors     optional: ``draft_ids`` [S] of a reduced draft vocabulary
    acceptance_profile.json     optional, written by calibration beside the head
    training_record.json        optional, written by training beside the head

Writing (:func:`write_head_dir`) builds the whole directory in a temporary sibling, fsyncs every file and
the directory, then puts it in place with :func:`selfspec.base.files.replace_dir`: an existing directory is
swapped with the new one only once the new one is complete, so the path always holds a whole head. Files of the
old directory that are not head files (:data:`HEAD_FILES`; e.g. the acceptance profile and the training record) are
carried over unchanged. Every safetensors file carries a SHA-256 of its tensors in its metadata
(``selfspec_sha256``), so flipped bytes that keep the file well formed are refused too; files written
before the checksum existed load without that check.

Reading refuses, with one :class:`HeadFormatError` that names the fix: a missing, truncated or corrupt
file, a checksum mismatch, missing / unexpected / wrong-shape tensors (all listed at once), and a head
trained on another target (:func:`check_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from selfspec.base import files
from selfspec.base.errors import UserError
from selfspec.base.files import fsync_dir, replace_dir, staging_dir
from selfspec.base.fingerprint import fingerprint_as_stored, fingerprint_version, mismatch_hint

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"
HEAD_FILES = (CONFIG_NAME, WEIGHTS_NAME, DRAFT_VOCAB_NAME)
ADAPTATION_NAME = "adaptation.json"
"""Beside adapted heads: how they were adapted (``selfspec adapt``, online adaptation); counts and hashes, no text."""
CHECKSUM_KEY = "selfspec_sha256"
FIX = "re-export the heads with save_pretrained (or retrain them)"


class HeadFormatError(UserError):
    """Raised when a head directory or config is wrong, incomplete or made for another target."""


# ---------------------------------------------------------------------------------------------- reading
def read_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON object.

    Raises:
        HeadFormatError: the file is missing, is not JSON, or holds something other than an object.
    """
    try:
        data = files.read_json(path)
    except (OSError, ValueError) as err:
        raise HeadFormatError(f"cannot read {path}: {err}; {FIX}") from err
    if not isinstance(data, dict):
        raise HeadFormatError(f"{path} must hold a JSON object, holds {type(data).__name__}; {FIX}")
    return data


def read_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a head directory.

    Raises:
        HeadFormatError: ``directory`` has no ``config.json`` (the message says which directory to pass),
            or it is not a JSON object.
    """
    d = Path(directory)
    if not (d / CONFIG_NAME).is_file():
        raise HeadFormatError(f"{d} has no {CONFIG_NAME}: pass the directory written by save_pretrained (…/heads)")
    return read_json(d / CONFIG_NAME)


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of named tensors: names, dtypes, shapes and bytes, in name order. Independent of the
    file layout, so it is computed before writing and again after loading."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def open_safetensors(
    path: str | Path, fix: str = FIX, what: str = "", error: type[ValueError] = HeadFormatError
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of a safetensors file, the tensors on the CPU.

    Args:
        path: the file.
        fix: what the message tells the user to do.
        what: the kind of file the message names (``"suffix index"``: ``cannot read suffix index PATH``).
        error: the ValueError raised.

    Raises:
        error: the file is missing, truncated or malformed (safetensors checks that the header covers the file
            exactly).
    """
    p = Path(path)
    name = f"{what} {p}" if what else str(p)
    if not p.is_file():
        raise error(f"cannot read {name}: the file is missing; {fix}")
    try:
        with safe_open(str(p), framework="pt") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as err:
        raise error(f"cannot read {name}: {err} (truncated or corrupt); {fix}") from err


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU.

    Raises:
        HeadFormatError: the file is missing, truncated or malformed (:func:`open_safetensors`), or its tensors do
            not match the ``selfspec_sha256`` checksum stored in its metadata.
    """
    p = Path(path)
    metadata, state = open_safetensors(p)
    stored = metadata.get(CHECKSUM_KEY)
    if stored is not None and stored != tensor_digest(state):
        raise HeadFormatError(f"cannot read {p}: its tensors do not match their checksum (corrupt file); {FIX}")
    return state


def check_state(path: str | Path, state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Refuse a loaded state dict that does not match a module's exactly.

    Args:
        path: the file the state came from (named in the message).
        state: the loaded tensors.
        expected: the module's ``state_dict()`` (only names and shapes are compared).

    Raises:
        HeadFormatError: listing, in one message, every missing, unexpected and wrong-shape tensor
            (with both shapes).
    """
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = {
        k: (tuple(state[k].shape), tuple(expected[k].shape))
        for k in sorted(set(expected) & set(state))
        if state[k].shape != expected[k].shape
    }
    if missing or unexpected or wrong:
        shapes = ", ".join(f"{k}: file {f} vs config {e}" for k, (f, e) in wrong.items())
        raise HeadFormatError(
            f"{path} does not match its config: missing={missing} unexpected={unexpected} wrong_shape=[{shapes}]; {FIX}"
        )


def check_draft_ids(draft_ids: torch.Tensor, size: int, vocab_size: int, where: str) -> None:
    """Refuse a draft vocabulary map that is not ``size`` distinct target ids.

    Args:
        draft_ids: the loaded map, expected LongTensor ``[S]`` with values in ``[0, V)``.
        size: S, the draft vocabulary size of the config.
        vocab_size: V, the target vocabulary size of the config.
        where: the file it came from (named in the message).

    Raises:
        HeadFormatError: wrong dtype or shape, an id outside ``[0, V)``, or a duplicate id.
    """
    if draft_ids.dtype != torch.long or draft_ids.shape != (size,):
        raise HeadFormatError(
            f"{where}: draft_ids must be int64 of shape [{size}], got {draft_ids.dtype} {tuple(draft_ids.shape)}; {FIX}"
        )
    if size and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab_size):
        raise HeadFormatError(f"{where}: draft_ids must lie in [0, {vocab_size}); {FIX}")
    if torch.unique(draft_ids).numel() != size:
        raise HeadFormatError(f"{where}: draft_ids contain duplicates; {FIX}")


def load_state(module: torch.nn.Module, path: str | Path, state: Mapping[str, torch.Tensor]) -> None:
    """:func:`check_state` against ``module.state_dict()``, then a strict ``load_state_dict``.

    Raises:
        HeadFormatError: see :func:`check_state`; the module is left untouched then.
    """
    check_state(path, state, module.state_dict())
    module.load_state_dict(dict(state), strict=True)


def check_fingerprint(
    where: str | Path, stored: str, given: str | None, trained_on: str = "", *, unrecorded_warning: bool = True
) -> None:
    """Refuse heads trained on another target: the one check of the target fingerprint recorded with a head against
    the fingerprint of the target at hand, for selfspec's head directories and the engines' layouts it imports.

    Args:
        where: the head directory or config file (named in the message).
        stored: the fingerprint recorded with the heads (``""``: none recorded, nothing to check).
        given: :func:`selfspec.base.fingerprint.target_fingerprint` of the target at hand; None = no check.
        trained_on: the target name recorded with the heads (named in the message).
        unrecorded_warning: log a warning when none is recorded (selfspec's own heads always record one; a
            published checkpoint in an engine's layout never does: False there).

    Raises:
        HeadFormatError: both fingerprints are known and differ; the message says which target to load them with.
    """
    if not given:
        return
    if not stored:
        if unrecorded_warning:
            logger.warning("heads in %s carry no target fingerprint; cannot check they belong to this target", where)
        return
    ours = fingerprint_as_stored(stored, given)
    if stored != ours:
        name = f"target {trained_on!r}" if trained_on else "another target"
        raise HeadFormatError(
            f"heads in {where} were trained on {name} (fingerprint {stored}), not on the target given (fingerprint "
            f"{ours}); load them with their own target, or retrain." + mismatch_hint(stored, ours)
        )
    if ours is not given:
        logger.warning(
            "heads in %s carry a version-%d target fingerprint (sizes and embedding rows only): checked the old "
            "way, which tells neither a fine-tuned decoder nor a dtype apart; save them again (or retrain) to store "
            "today's",
            where,
            fingerprint_version(stored),
        )


# ---------------------------------------------------------------------------------------------- writing
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_head_dir(
    directory: str | Path,
    config: Mapping[str, Any],
    tensor_files: Mapping[str, Mapping[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a head directory atomically (see the module docstring).

    Args:
        directory: the head directory; created with its parents, or replaced as a whole.
        config: written as ``config.json`` (indented JSON; values JSON cannot hold are written as strings).
        tensor_files: file name -> named tensors, e.g. ``{"model.safetensors": state}``; tensors are
            copied to the CPU and made contiguous. Head files of an existing directory that are not
            listed here (e.g. a ``draft_vocab.safetensors`` the head no longer has) are not carried over.
        metadata: string metadata stored in every safetensors file (besides ``format: pt`` and the
            checksum).

    Returns:
        ``directory`` as a Path.

    Raises:
        HeadFormatError: ``directory`` exists and is not a directory, or a file name is not a plain name.
        OSError: the disk refused a write; the existing directory is then left as it was.
    """
    out = Path(directory).resolve()
    if out.exists() and not out.is_dir():
        raise HeadFormatError(f"{out} exists and is not a directory; pass a directory for the heads")
    names = [CONFIG_NAME, *tensor_files]
    if any(Path(n).name != n or n in ("", ".", "..") for n in names) or len(set(names)) != len(names):
        raise HeadFormatError(f"head file names must be distinct plain names, got {names}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(out)
    try:
        tmp.mkdir()
        for name, tensors in tensor_files.items():
            state = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
            meta = {"format": "pt", **(metadata or {}), CHECKSUM_KEY: tensor_digest(state)}
            (tmp / name).write_bytes(safetensors_bytes(state, metadata=meta))
        (tmp / CONFIG_NAME).write_text(json.dumps(dict(config), indent=2, default=str))
        if out.is_dir():
            for entry in out.iterdir():
                if entry.name in HEAD_FILES or entry.name in tensor_files:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, tmp / entry.name, symlinks=True)
                else:
                    shutil.copy2(entry, tmp / entry.name, follow_symlinks=False)
        for entry in tmp.iterdir():
            if entry.is_file() and not entry.is_symlink():
                _fsync_file(entry)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return replace_dir(tmp, out)
