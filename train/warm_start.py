"""Warm start: a training run that begins from saved heads (``init_heads``) instead of a fresh head.

At small budgets the start matters more than the recipe: the speculators regression tests fine-tune an EAGLE-3
head for one epoch on 5,000 samples and keep per-position acceptance [0.82, 0.65, 0.48] where the same data from
scratch reaches [0.40, 0.10, 0.01]. So adapting a head to a user's work starts from the head the user has.

Two steps, both generic over head families:

1. :func:`warm_config` (before any compute): the heads are read strictly, their family must be the run's
   ``head``, and every option that shapes a head (draft vocabulary size, fused target layers, block size, ...) is
   taken from them (each recipe says which, :attr:`~selfspec.train.recipes.RecipeEntry.warm_options`), so the
   feature store computes the layers the head consumes.
2. :func:`init_head` (in the recipe): the heads again, now attached to the target, whose fingerprint must be
   theirs; the recipe builds its head with the warm head's draft vocabulary (:func:`warm_draft_ids`) and copies
   every tensor (``load_state_dict``, strict: a shape that differs is an error, never a partial start).

The input heads are only read, never written: the run writes its own ``<output_dir>/heads``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from selfspec.heads import load_heads
from selfspec.heads.io import HeadFormatError
from selfspec.train.config import TrainConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

WarmOptions = Callable[[Any], dict[str, Any]]
"""A family's options taken from its saved head: ``head.config -> {"draft_vocab_size": S, "eagle3": {...}}``
(top-level :class:`TrainConfig` fields and nested sections)."""


def head_family(head: torch.nn.Module) -> str:
    """The family name a loaded head's config declares (``config.head_type``)."""
    return str(head.config.head_type)


def warm_config(cfg: TrainConfig, options: Mapping[str, WarmOptions]) -> TrainConfig:
    """``cfg`` with the head-shaping options of the heads in ``cfg.init_heads`` (unchanged without it).

    Args:
        cfg: the run's config.
        options: family name -> that family's :data:`WarmOptions` (the recipe registry's).

    Raises:
        HeadFormatError: the heads are missing, corrupt or not selfspec heads.
        ValueError: the heads are of another family than ``cfg.head`` (the message names the fix), or of a family
            that has no warm start.
    """
    if cfg.init_heads is None:
        return cfg
    head = load_heads(cfg.init_heads)
    family = head_family(head)
    if family != cfg.head:
        raise ValueError(
            f"init_heads {cfg.init_heads} holds {family} heads but this run trains head={cfg.head}: "
            f"set head={family} (or train a fresh {cfg.head} head without init_heads)"
        )
    if family not in options:
        raise ValueError(f"{family} heads cannot start a run yet (no warm start for that family); drop init_heads")
    changes = options[family](head.config)
    top = {k: v for k, v in changes.items() if not isinstance(v, dict)}
    nested = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in changes.items() if isinstance(v, dict)}
    warm = dataclasses.replace(cfg, **top, **nested)
    if warm != cfg:
        logger.info("init_heads %s: head shape taken from the heads (%s)", cfg.init_heads, changes)
    return warm


def init_head(cfg: TrainConfig, target: PreTrainedModel) -> torch.nn.Module | None:
    """The heads of ``cfg.init_heads`` attached to ``target`` in float32, or None without ``init_heads``.

    Raises:
        HeadFormatError: missing or corrupt files, or heads trained on another target (fingerprint); the message
            starts with ``init_heads:``.
    """
    if cfg.init_heads is None:
        return None
    try:
        head = load_heads(cfg.init_heads, target).float()
    except HeadFormatError as e:
        raise HeadFormatError(f"init_heads: {e}") from e
    logger.info("starting from the %s heads in %s", head_family(head), cfg.init_heads)
    return head


def warm_draft_ids(head: torch.nn.Module, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary of a warm head as a recipe takes it: Long ``[S]`` target ids, or None when the head
    drafts the whole vocabulary (S = V)."""
    ids = head.draft_ids.detach().cpu()
    return None if ids.numel() >= vocab_size else ids


def copy_head(into: torch.nn.Module, warm: torch.nn.Module | None) -> None:
    """Copy every tensor of ``warm`` into the freshly built ``into`` (no-op for None).

    Raises:
        ValueError: a missing, unexpected or wrong-shape tensor (``load_state_dict(strict=True)``): the run's options
            give another head shape than the heads have (the message names the fix).
    """
    if warm is None:
        return
    try:
        into.load_state_dict(warm.state_dict())
    except RuntimeError as e:
        raise ValueError(
            f"init_heads: the heads' shape differs from this run's head ({e}); start from heads trained with the "
            "same head options, or drop init_heads"
        ) from e
