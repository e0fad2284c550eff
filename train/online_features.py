"""Target features computed online, sequence by sequence as batches are built, instead of read from the store;
and the choice between the two for a run (``features: auto | store | online``).

The store (:func:`~selfspec.train.feature_store.target_features`) costs one target forward per data token, once,
plus ``width * itemsize`` bytes per token of disk: EAGLE-3 keeps four D-wide states a token (the three fused layers
and the last), 9.2 KB a token for SmolLM2 in fp32, 1.9 GB for round 7's 204,000 tokens; it is read back per
sequence, so its size costs disk, not memory (while it fits in the page cache, the reads cost no disk either).
Online features cost one target forward per token *visited*, every time it is visited, and no disk. So:

* the store wins when the run reads its data more than once (many epochs, frequent held-out evaluation);
* online wins when the run visits fewer tokens than the data holds (a step budget under one epoch, e.g. a large
  corpus at a small budget) or when the store would not fit on the disk.

:func:`feature_source` makes that choice from the run's config, the data's token counts, the free disk and
memory (a complete store with the run's inputs is free, so it is always used). Both sources give the same
features, bit for bit: they are one function (:func:`~selfspec.train.features.hidden_features`) over the same
examples, so a head trained online equals the head trained from the store (``tests/train/test_online_features.py``,
every family that can train online: EAGLE, EAGLE-3, DFlash, DSpark; Medusa draws single positions from the whole
store and trains from the store only).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.train.config import TrainConfig
from selfspec.train.feature_rows import FeatureRows
from selfspec.train.feature_store import (
    FeatureStore,
    has_features,
    store_identity,
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

DISK_SHARE = 0.8
"""``auto`` computes features online when a store would take more than this share of the free disk."""


class OnlineRows(FeatureRows):
    """Features computed by the frozen target each time a sequence's rows are read.

    Args:
        tokens: Long ``[ΣT]``, the sequences' ids one after another (row i is token i's features).
        target: the frozen target; its forward runs under ``torch.inference_mode`` on its own device.
        layers: the decoder layers whose input states come first (EAGLE-3, DFlash), None for the last state only.

    Attributes:
        computed_tokens: tokens forwarded so far.
    """

    def __init__(self, tokens: torch.Tensor, target: PreTrainedModel, layers: Sequence[int] | None) -> None:
        self.tokens, self.target, self.layers = tokens, target, tuple(layers) if layers else None
        self.width = target.config.hidden_size * (len(self.layers) + 1 if self.layers else 1)
        self.dtype = next(target.parameters()).dtype
        self.computed_tokens = 0

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def span(self, start: int, n: int) -> torch.Tensor:
        """The features of the sequence ``tokens[start : start + n]``, computed now (a regular tensor on CPU in
        the target's dtype, so it can enter autograd)."""
        ids = self.tokens[start : start + n]
        self.computed_tokens += n
        return hidden_features(self.target, [{"input_ids": ids}], True, self.layers)[0].clone()

    def take(self, index: torch.Tensor) -> torch.Tensor:
        raise ValueError("features computed online are read by whole sequence: train this head with features: store")

    def concat(self, others: Sequence[FeatureRows]) -> FeatureRows:
        raise ValueError("features computed online are not joined: each split is computed on its own")


def online_store(examples: list[dict], target: PreTrainedModel, layers: Sequence[int] | None) -> FeatureStore:
    """A store of ``examples`` (sequences under 2 tokens dropped, as the store drops them) whose features the
    target computes whenever a sequence is read (:class:`OnlineRows`)."""
    keep = [e for e in examples if e["input_ids"].numel() >= 2]
    z = torch.zeros(0, dtype=torch.long)
    tokens = torch.cat([e["input_ids"] for e in keep]) if keep else z
    mask = torch.cat([e["loss_mask"] for e in keep]) if keep else z.bool()
    lengths = torch.tensor([e["input_ids"].numel() for e in keep], dtype=torch.long) if keep else z
    return FeatureStore(tokens, OnlineRows(tokens, target, layers), mask, lengths)


def is_online(store: FeatureStore) -> bool:
    """Whether ``store``'s features are computed online."""
    return isinstance(store.rows, OnlineRows)


def memory_bytes() -> int:
    """The machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds ``path`` (its nearest existing parent; 0 where unknown)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return int(shutil.disk_usage(p).free)
    except OSError:
        return 0


def feature_source(
    cfg: TrainConfig,
    batch_tokens: int,
    train_tokens: int,
    held_tokens: int,
    width: int,
    itemsize: int,
    cached: bool,
    memory: int | None = None,
    disk: int | None = None,
) -> tuple[str, str]:
    """Where a run's target features come from: ``cfg.features`` when it is ``"store"`` or ``"online"``; for
    ``"auto"``, the store when the target is sharded (``target_parallel``) or a complete one exists, else online
    when the store would not fit on the disk, else the cheaper of the two for this run (module docstring).

    Args:
        cfg: the run (``max_steps``, ``epochs``, ``eval_every``, ``grad_accum_steps``, ``features``).
        batch_tokens: tokens per optimiser step of the family (``eagle3.batch_tokens``, ``block.batch_tokens``).
        train_tokens / held_tokens: tokens of the training and held-out sequences.
        width: feature width per token (``4 * D`` for EAGLE-3); itemsize: bytes per element (4 in fp32).
        cached: a complete store of this run's inputs exists (reading it costs no target forward).
        memory: the machine's memory in bytes (default :func:`memory_bytes`), for the log: a store within it is read
            from the page cache after its first epoch.
        disk: free bytes where the store goes (default :func:`free_disk_bytes` of ``cfg.output_dir``).

    Returns:
        ``(source, reason)``: ``"store"`` or ``"online"`` and one sentence with the figures, for the log.

    Raises:
        ValueError: ``cfg.features`` is none of :data:`SOURCES`.
    """
    mode = cfg.features
    if mode not in SOURCES:
        raise ValueError(f"features must be one of {SOURCES}, got {mode!r}")
    if mode != "auto":
        return mode, f"features: {mode}"
    if cfg.target_parallel != "none":  # online, the main process's evaluation would run the sharded target alone
        return "store", f"target_parallel: {cfg.target_parallel} reads the target's features from the store"
    if cached:
        return "store", "a complete store of this run's inputs exists (no target forward needed)"
    store_bytes = (train_tokens + held_tokens) * width * itemsize
    memory = memory_bytes() if memory is None else memory
    disk = free_disk_bytes(cfg.output_dir) if disk is None else disk
    sizes = f"a store would take {store_bytes / 2**30:.2f} GiB ({disk / 2**30:.1f} GiB free on disk, "
    sizes += f"{memory / 2**30:.1f} GiB of memory)"
    if disk and store_bytes > DISK_SHARE * disk:
        return "online", f"{sizes}: over {DISK_SHARE:.0%} of the free disk"
    if cfg.max_steps is not None:
        steps = cfg.max_steps
        visited = steps * batch_tokens * cfg.grad_accum_steps
    else:  # a clock budget: assume the configured epochs are read
        steps = None
        visited = cfg.epochs * train_tokens
    evals = 1 + (steps // cfg.eval_every if steps is not None and cfg.eval_every > 0 else cfg.epochs)
    online = min(visited, cfg.epochs * train_tokens) + evals * held_tokens
    stored = train_tokens + held_tokens
    source = "online" if online < stored else "store"
    return source, f"{sizes}; online: ~{online:,} target tokens forwarded over the run, store: {stored:,} once"


def feature_stores(
    run: RunInputs, layers: Sequence[int] | None, batch_tokens: int
) -> tuple[FeatureStore, FeatureStore, str, str]:
    """Both splits' features for a run of a family that can train online (EAGLE, EAGLE-3, DFlash, DSpark), from the
    store or online as :func:`feature_source` chooses (said in the log).

    Features self-distillation captured (``run.captured``) go into the store; online, they are dropped (the
    capture is emptied).

    Args:
        layers: the decoder layers whose input states come first (None: the last state only).
        batch_tokens: the family's tokens per optimiser step (for ``auto``'s estimate).

    Returns:
        ``(train, held_out, signature, source)``: the stores (features computed online, :func:`is_online`, or read
        from disk), the feature signature (the same for both sources: the features are the same) and ``"store"`` /
        ``"online"``.
    """
    cfg, target, tokenizer = run.cfg, run.target, run.tokenizer
    identity = store_identity(target, run.train_convs, run.eval_convs, cfg.max_length, layers)
    world = run.accelerator.num_processes
    cached = cfg.features == "auto" and all(
        has_features(store_path(cfg.output_dir, r, world), identity) for r in range(world)
    )
    counted = not cached and cfg.features != "store"  # the store's own path renders the conversations
    split = [training_examples(cfg, target, tokenizer, c) for c in (run.train_convs, run.eval_convs)] if counted else []
    itemsize = next(target.parameters()).element_size()
    n_train, n_held = (sum(int(e["input_ids"].numel()) for e in ex) for ex in split) if split else (0, 0)
    source, reason = feature_source(cfg, batch_tokens, n_train, n_held, identity.width, itemsize, cached)
    logger.info("target features %s: %s", source, reason)
    if source == "store":
        train, held, signature = target_features(run, layers)
        return train, held, signature, source
    if run.captured is not None:
        run.captured.clear()
    train, held = (online_store(ex, target, layers) for ex in split)
    return train, held, identity.signature, source
