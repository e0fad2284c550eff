"""Target features computed online, sequence by sequence as batches are built, instead of read from a stored cache;
and the choice between the two for a run (``eagle3.features: auto | store | online``).

A stored cache (:func:`~selfspec.train.feature_store.target_features`) costs one target forward per data token,
once, plus ``width * itemsize`` bytes per token of memory and disk: EAGLE-3 keeps four D-wide states a token
(the three fused layers and the last), 9.2 KB a token for SmolLM2 in fp32, 1.9 GB for round 7's 204,000 tokens.
Online features cost one target forward per token *visited*, every time it is visited, and no memory. So:

* the store wins when the run reads its data more than once (many epochs, frequent held-out evaluation);
* online wins when the run visits fewer tokens than the data holds (a step budget under one epoch, e.g. a large
  corpus at a small budget) or when the store would not fit in memory.

:func:`feature_source` makes that choice from the run's config and the data's token counts (an existing cache
with the run's signature is free, so it is always used). Both sources give the same features, bit for bit: they
are one function (:func:`~selfspec.train.features.hidden_features`) over the same examples, so a head trained
online equals the head trained from the store (``tests/train/test_online_features.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from selfspec.train.config import TrainConfig
from selfspec.train.eagle_data import PairStore
from selfspec.train.feature_store import (
    LAYERS,
    FeatureStore,
    feature_signature,
    has_features,
    store_path,
    target_features,
    training_examples,
)
from selfspec.train.features import hidden_features
from selfspec.train.inputs import RunInputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel


logger = logging.getLogger(__name__)

SOURCES = ("auto", "store", "online")

STORE_MEMORY_SHARE = 0.5
"""``auto`` computes features online when a store would take more than this share of the machine's memory."""


class OnlineFeatures(PairStore):
    """A :class:`~selfspec.train.eagle_data.PairStore` that holds tokens, masks and lengths only and computes a
    sequence's features with the frozen target each time the sequence is read (:meth:`sequence`).

    Args:
        store: the sequences (its ``features`` are ignored; a ``[ΣT, 0]`` store is typical).
        target: the frozen target; its forward runs under ``torch.inference_mode`` on its own device.
        layers: the decoder layers whose input states come first (EAGLE-3), None for the last state only.

    ``features`` is a ``[ΣT, 0]`` tensor; :attr:`width` is the width the features would have:
    ``(len(layers) + 1) * D`` (or D).
    """

    def __init__(self, store: FeatureStore, target: PreTrainedModel, layers: Sequence[int] | None) -> None:
        dtype = next(target.parameters()).dtype
        empty = torch.zeros(store.tokens.numel(), 0, dtype=dtype)
        super().__init__(store.tokens, empty, store.loss_mask, store.lengths)
        self.target, self.layers = target, tuple(layers) if layers else None
        self._width = target.config.hidden_size * (len(self.layers) + 1 if self.layers else 1)
        self.computed_tokens = 0

    @property
    def width(self) -> int:
        return self._width

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [T], features [T, width], loss_mask [T])`` of sequence i; the features are computed now (a
        regular tensor on CPU in the target's dtype, so it can enter autograd)."""
        o, T = int(self.offsets[i]), int(self.lengths[i])
        tokens, mask = self.tokens[o : o + T], self.loss_mask[o : o + T]
        feats = hidden_features(self.target, [{"input_ids": tokens}], True, self.layers)[0].clone()
        self.computed_tokens += T
        return tokens, feats, mask


def memory_bytes() -> int:
    """The machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def feature_source(
    cfg: TrainConfig,
    train_tokens: int,
    held_tokens: int,
    width: int,
    itemsize: int,
    cached: bool,
    memory: int | None = None,
) -> tuple[str, str]:
    """Where a run's target features come from: ``cfg.eagle3.features`` when it is ``"store"`` or ``"online"``;
    for ``"auto"``, the cheaper of the two for this run (module docstring).

    Args:
        cfg: the run (``max_steps``, ``epochs``, ``eval_every``, ``eagle3.batch_tokens``, ``grad_accum_steps``).
        train_tokens / held_tokens: tokens of the training and held-out sequences.
        width: feature width per token (``4 * D`` for EAGLE-3); itemsize: bytes per element (4 in fp32).
        cached: a cache file with this run's signature exists (reading it costs no target forward).
        memory: the machine's memory in bytes (default :func:`memory_bytes`).

    Returns:
        ``(source, reason)``: ``"store"`` or ``"online"`` and one sentence with the figures, for the log.

    Raises:
        ValueError: ``cfg.eagle3.features`` is none of :data:`SOURCES`.
    """
    mode = cfg.eagle3.features
    if mode not in SOURCES:
        raise ValueError(f"eagle3.features must be one of {SOURCES}, got {mode!r}")
    if mode != "auto":
        return mode, f"eagle3.features: {mode}"
    if cached:
        return "store", "a cache with this run's signature exists (no target forward needed)"
    store_bytes = (train_tokens + held_tokens) * width * itemsize
    memory = memory_bytes() if memory is None else memory
    if memory and store_bytes > STORE_MEMORY_SHARE * memory:
        return "online", (
            f"a store would take {store_bytes / 2**30:.1f} GiB, over {STORE_MEMORY_SHARE:.0%} of "
            f"{memory / 2**30:.1f} GiB of memory"
        )
    if cfg.max_steps is not None:
        steps = cfg.max_steps
        visited = steps * cfg.eagle3.batch_tokens * cfg.grad_accum_steps
    else:  # a clock budget: assume the configured epochs are read
        steps = None
        visited = cfg.epochs * train_tokens
    evals = 1 + (steps // cfg.eval_every if steps is not None and cfg.eval_every > 0 else cfg.epochs)
    online = min(visited, cfg.epochs * train_tokens) + evals * held_tokens
    stored = train_tokens + held_tokens
    source = "online" if online < stored else "store"
    return source, (
        f"online: ~{online:,} target tokens forwarded over the run, store: {stored:,} once "
        f"({store_bytes / 2**20:,.0f} MiB)"
    )


def eagle3_feature_stores(run: RunInputs, layers: Sequence[int]) -> tuple[FeatureStore, FeatureStore, str, str]:
    """Both splits' features for an EAGLE-3 run, from the store or online as :func:`feature_source` chooses.

    Features self-distillation captured (``run.captured``) go into the store; online, they are dropped (the
    capture is emptied).

    Returns:
        ``(train, held_out, signature, source)``: stores (:class:`OnlineFeatures` when online), the feature
        signature (the same for both sources: the features are the same) and ``"store"`` / ``"online"``.
    """
    cfg, target, tokenizer = run.cfg, run.target, run.tokenizer
    taken = ",".join(str(i) for i in layers) + "," + LAYERS
    signature = feature_signature(target, run.train_convs, run.eval_convs, cfg.max_length, taken)
    world = run.accelerator.num_processes
    cached = cfg.eagle3.features == "auto" and all(
        has_features(store_path(cfg.output_dir, r, world), signature) for r in range(world)
    )
    counted = not cached and cfg.eagle3.features != "store"  # the store's own path renders the conversations
    split = [training_examples(cfg, target, tokenizer, c) for c in (run.train_convs, run.eval_convs)] if counted else []
    width = target.config.hidden_size * (len(layers) + 1)
    itemsize = next(target.parameters()).element_size()
    n_train, n_held = (sum(int(e["input_ids"].numel()) for e in ex) for ex in split) if split else (0, 0)
    source, reason = feature_source(cfg, n_train, n_held, width, itemsize, cached)
    logger.info("target features %s: %s", source, reason)
    if source == "store":
        train, held, signature = target_features(run, layers)
        return train, held, signature, source
    if run.captured is not None:
        run.captured.clear()
    stores = []
    for ex in split:
        no_features = [torch.zeros(e["input_ids"].numel(), 0) for e in ex]
        stores.append(OnlineFeatures(FeatureStore.from_examples(ex, no_features, 0), target, layers))
    return stores[0], stores[1], signature, source
