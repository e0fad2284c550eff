"""Head directories on the Hugging Face Hub: where a Hub id is turned into a local head directory, and the
``push_to_hub`` every head family shares.

A head source is a local head directory or a Hub repo id (``"user/repo"``). :func:`resolve_head_dir`
returns a local directory either way: a Hub repo is fetched with ``huggingface_hub``'s
``snapshot_download`` into the Hub cache, in two steps, so a repo that holds no selfspec heads (a target
model, a dataset) is refused after one small file, before any weights are downloaded:

1. ``config.json`` alone; it must name a selfspec ``head_type``;
2. the head files (:data:`HUB_FILES`) at the very commit step 1 read.

The directory is then read by the family's strict loader (:mod:`selfspec.heads.io`: every tensor, every
shape, the checksums, the target fingerprint), so a repo is either loaded whole or refused.

``HF_HUB_OFFLINE=1`` is honoured: a repo already in the Hub cache loads, any other is refused with the fix.
``HF_ENDPOINT`` is read when the call is made (not only when ``huggingface_hub`` is imported).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from selfspec.heads.families import head_families
from selfspec.heads.io import ADAPTATION_NAME, CONFIG_NAME, DRAFT_VOCAB_NAME, WEIGHTS_NAME, HeadFormatError, read_json

__all__ = ["HUB_FILES", "HubMixin", "hub_endpoint", "is_hub_id", "resolve_head_dir"]

# What a head repo holds that loading uses: the head, and the acceptance profile the EAGLE tree budget reads
# (decode/tuning/calibration.py) and the training record the bench reads (train/record.py), when they were pushed.
HUB_FILES = (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DRAFT_VOCAB_NAME,
    "acceptance_profile.json",
    "training_record.json",
    ADAPTATION_NAME,
)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def hub_endpoint() -> str | None:
    """``$HF_ENDPOINT`` now (None: ``huggingface_hub``'s default, https://huggingface.co)."""
    return os.environ.get("HF_ENDPOINT") or None


def is_hub_id(source: str | os.PathLike) -> bool:
    """True for a string of the form ``namespace/name`` (Hub repo id syntax) that is not an existing path."""
    return isinstance(source, str) and bool(_REPO_ID.fullmatch(source)) and not Path(source).exists()


def _download(repo_id: str, revision: str | None, token: str | bool | None, patterns: list[str]) -> Path:
    """``snapshot_download`` of ``patterns``, with every Hub failure turned into a HeadFormatError naming the fix."""
    where = f"Hub repo {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    not_local = f"there is no local directory {repo_id!r} either"
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns, endpoint=hub_endpoint())
        )
    except GatedRepoError as err:
        raise HeadFormatError(
            f"{where} is gated: accept its terms on the Hub, then pass token=... (or run `hf auth login`)"
        ) from err
    except RepositoryNotFoundError as err:
        raise HeadFormatError(
            f"{where} does not exist, or is private and no valid token was given ({not_local}): check the id, "
            "pass token=... (or run `hf auth login`) for a private repo, or pass a local head directory"
        ) from err
    except RevisionNotFoundError as err:
        raise HeadFormatError(f"{where}: no such revision; pass an existing branch, tag or commit") from err
    except LocalEntryNotFoundError as err:
        if constants.HF_HUB_OFFLINE:
            raise HeadFormatError(
                f"{where} is not in the local Hub cache and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to "
                "download it once, or pass a local head directory"
            ) from err
        raise HeadFormatError(
            f"{where} could not be reached and is not in the local Hub cache ({' '.join(str(err).split())}); "
            "check the network or HF_ENDPOINT, or pass a local head directory"
        ) from err
    except (EntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        raise HeadFormatError(f"cannot download {where}: {err}") from err


def resolve_head_dir(
    source: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None
) -> Path:
    """A local head directory for ``source`` (see the module docstring).

    Args:
        source: a local head directory, or a Hub repo id ``"namespace/name"`` (used when no such local path
            exists).
        revision: Hub branch, tag or commit (default: the repo's main branch); only for a Hub id.
        token: Hub token for a private or gated repo (default: ``$HF_TOKEN`` or the saved login).

    Returns:
        The directory: ``source`` itself, or the repo's snapshot in the Hub cache.

    Raises:
        HeadFormatError: no such directory or repo (the message says which was looked for), a revision
            that does not exist, a repo that cannot be reached (or is not cached under ``HF_HUB_OFFLINE``),
            or a repo whose ``config.json`` is missing or names no selfspec head family.
    """
    path = Path(source)
    if not is_hub_id(source):
        if path.is_dir():
            return path
        raise HeadFormatError(
            f"{path} has no {CONFIG_NAME} (it is not a directory): pass the directory written by save_pretrained "
            "(…/heads), or a Hub repo id 'namespace/name' of heads pushed with push_to_hub / `selfspec push`"
        )
    repo_id = str(source)
    snapshot = _download(repo_id, revision, token, [CONFIG_NAME])
    config_path = snapshot / CONFIG_NAME
    if not config_path.is_file():
        raise HeadFormatError(
            f"Hub repo {repo_id!r} has no {CONFIG_NAME}: it holds no selfspec heads; pass a repo made by "
            "push_to_hub / `selfspec push`"
        )
    head_type = read_json(config_path).get("head_type")
    if head_type not in head_families():
        raise HeadFormatError(
            f"Hub repo {repo_id!r} holds no selfspec heads: its {CONFIG_NAME} has head_type {head_type!r}, not one "
            f"of {list(head_families())} (is it a target model? pass it as the target, and the heads' repo as heads). "
            "Heads trained elsewhere are read with `selfspec import`"
        )
    # The snapshot folder is named by the commit it holds: fetch the head files of that very commit.
    return _download(repo_id, snapshot.name, token, list(HUB_FILES))


class HubMixin:
    """``push_to_hub`` for a head module that has ``save_pretrained(directory)`` and a ``config`` with a
    ``head_type`` (every selfspec head family). The upload itself is :func:`selfspec.hub.push_heads`. Also
    ``from_pretrained`` for a family whose ``from_directory(directory, ...)`` loads a local head directory strictly."""

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        *args: Any,
        revision: str | None = None,
        token: str | bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Load heads saved by ``save_pretrained`` from a head directory or a Hub repo id (:func:`resolve_head_dir`,
        with ``revision`` and ``token``): the family's ``from_directory(directory, *args, **kwargs)``, which refuses
        anything that does not match exactly (see it for the other arguments).

        Raises:
            HeadFormatError: what :func:`resolve_head_dir` and the family's ``from_directory`` raise.
        """
        return cls.from_directory(resolve_head_dir(directory, revision=revision, token=token), *args, **kwargs)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
        base_model: str | None = None,
        bench_report: str | os.PathLike | None = None,
        bench_method: str | None = None,
        bench_command: str | None = None,
        dry_run: bool = False,
    ) -> Any:
        """Upload the head to the Hub repo ``repo_id`` (created if missing): the files of
        ``save_pretrained`` and a ``README.md`` model card (:func:`selfspec.card.head_card`).

        Args:
            repo_id: ``"namespace/name"``.
            private: create the repo private (an existing repo keeps its visibility).
            token: Hub token with write access (default: ``$HF_TOKEN`` or the saved login).
            commit_message: the commit's message (default: names the family and target).
            base_model: the target's Hub id for the card (default: the target the head was trained on, when
                that is a Hub id or a known alias).
            bench_report: a ``selfspec bench`` ``report.json`` whose tau and speedup go on the card;
                bench_method: the head's method in it (default: its only selfspec method); bench_command:
                the command that made it (the report does not store it).
            dry_run: build the files and the card, upload nothing.

        Returns:
            :class:`selfspec.hub.HubPush`: what was (or, with ``dry_run=True``, would be) uploaded.

        Raises:
            selfspec.hub.HubError: see :func:`selfspec.hub.push_heads`.
        """
        # The one import above heads/, at call time: the upload builds a model card and reads bench reports, which
        # belong to the API layer (declared in tests/test_layers.py: ALLOWED).
        from selfspec.hub import push_heads

        return push_heads(
            self,
            repo_id,
            private=private,
            token=token,
            commit_message=commit_message,
            base_model=base_model,
            bench_report=bench_report,
            bench_method=bench_method,
            bench_command=bench_command,
            dry_run=dry_run,
        )
