"""One feature store for every recipe: the frozen target's hidden states over the training data, computed
once, kept on disk in shards and read sequence by sequence, keyed by what they were computed from.

A store holds whole sequences: ``tokens`` ``[ΣT]``, ``loss_mask`` ``[ΣT]`` (True at assistant tokens) and
``lengths`` ``[E]`` in memory (9 bytes a token), and the features ``[ΣT, W]`` (the target's states, in the target's
dtype: ``W`` = 4 D for EAGLE-3, 4.6 KB a token at D = 576) in a :class:`~selfspec.train.feature_rows.FeatureRows`:
the shard files on disk for a trained run (:class:`~selfspec.train.feature_rows.ShardRows`, read per sequence as
batches are built, so a process's memory does not grow with the store), a tensor for a store built in memory, or
the target itself when features are computed online (:mod:`selfspec.train.online_features`). Each recipe derives its
own training rows from it (Medusa: one row per position, :func:`selfspec.train.medusa.position_index`; EAGLE: shifted
pairs packed into rows, :mod:`selfspec.train.eagle_data`; DFlash: anchored blocks, :mod:`selfspec.train.dflash`).

Process r of w computes the conversations ``r::w`` into its own store directory,
``<output_dir>/features/rank{r}-of{w}/`` (:mod:`selfspec.train.store_shards`: shards written as they are computed,
a manifest, resumed after a kill); then every process opens all w stores (ids, masks and lengths only) and
interleaves them back into the conversations' order, and the ``DataLoader`` that ``accelerate`` prepares gives each
process its own batches, whose features only it reads. A store of other inputs (:class:`~selfspec.train.
store_shards.StoreIdentity`: target fingerprint, every conversation, ``max_length``, the layers taken, width and
dtype) is recomputed, never reused, whichever head family wrote it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from selfspec.base.fingerprint import target_fingerprint
from selfspec.base.target_shards import sync_forwards
from selfspec.train.chat_tokens import build_training_examples
from selfspec.train.config import TrainConfig
from selfspec.train.distill_states import CapturedStates
from selfspec.train.feature_rows import FeatureRows, TensorRows
from selfspec.train.features import hidden_features, length_batches
from selfspec.train.inputs import RunInputs
from selfspec.train.store_shards import SPLITS, StoreIdentity, StoreSplit, StoreWriter, open_store, read_manifest

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


logger = logging.getLogger(__name__)

LAYERS = "final_norm"
"""The layers a store takes: the last decoder layer's output after the final norm (the lm_head input)."""


class FeatureStore:
    """Concatenated sequences: ``tokens`` Long ``[ΣT]``, ``loss_mask`` Bool ``[ΣT]``, ``lengths`` Long ``[E]``
    (``offsets`` ``[E]``: where each sequence starts in them) and their features, ``width`` values a token, in
    ``rows`` (sequence i's first at row ``starts[i]``; ``starts`` defaults to ``offsets``).

    Args:
        tokens / loss_mask / lengths: as above.
        features: ``[ΣT, W]`` in sequence order, or a :class:`~selfspec.train.feature_rows.FeatureRows` reader.
        starts: Long ``[E]``, each sequence's first row in ``features`` (default: ``offsets``).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor | FeatureRows,
        loss_mask: torch.Tensor,
        lengths: torch.Tensor,
        starts: torch.Tensor | None = None,
    ) -> None:
        self.tokens, self.loss_mask, self.lengths = tokens, loss_mask.bool(), lengths.long()
        self.rows = features if isinstance(features, FeatureRows) else TensorRows(features)
        offsets = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)[:-1]])
        self.offsets = offsets if self.lengths.numel() else self.lengths
        self.starts = self.offsets if starts is None else starts.long()
        self._in_order = isinstance(self.rows, TensorRows) and torch.equal(self.starts, self.offsets)

    @classmethod
    def from_examples(cls, examples: list[dict], feats: list[torch.Tensor], hidden_size: int) -> FeatureStore:
        """Examples (``input_ids`` Long ``[T]``, ``loss_mask`` Bool ``[T]``) with their features ``[T, D]``, in
        memory; sequences under 2 tokens are dropped (no next-token pair in them)."""
        keep = [(e, f) for e, f in zip(examples, feats, strict=True) if e["input_ids"].numel() >= 2]
        if not keep:
            return cls.empty(hidden_size)
        return cls(
            torch.cat([e["input_ids"] for e, _ in keep]),
            torch.cat([f for _, f in keep]),
            torch.cat([e["loss_mask"] for e, _ in keep]),
            torch.tensor([e["input_ids"].numel() for e, _ in keep]),
        )

    @classmethod
    def from_split(cls, split: StoreSplit) -> FeatureStore:
        """One split of a store on disk (:func:`~selfspec.train.store_shards.open_store`), its features read from
        the shards on demand."""
        return cls(split.tokens, split.rows, split.loss_mask, split.lengths, split.starts)

    @classmethod
    def empty(cls, hidden_size: int, dtype: torch.dtype = torch.float32) -> FeatureStore:
        """A store of no sequence (features ``[0, hidden_size]`` of ``dtype``)."""
        z = torch.zeros(0, dtype=torch.long)
        return cls(z, torch.zeros(0, hidden_size, dtype=dtype), z.bool(), z)

    @classmethod
    def cat(cls, stores: list[FeatureStore]) -> FeatureStore:
        """The stores' sequences one after another (in list order; their features of one kind of reader).

        Raises:
            ValueError: stores whose features are held in different kinds of reader (memory and disk).
        """
        if len(stores) == 1:
            s = stores[0]
            return cls(s.tokens, s.rows, s.loss_mask, s.lengths, s.starts)
        bases = torch.tensor([0, *[len(s.rows) for s in stores]]).cumsum(0)[:-1].tolist()
        return cls(
            torch.cat([s.tokens for s in stores]),
            stores[0].rows.concat([s.rows for s in stores[1:]]),
            torch.cat([s.loss_mask for s in stores]),
            torch.cat([s.lengths for s in stores]),
            torch.cat([s.starts + b for s, b in zip(stores, bases, strict=True)]),
        )

    @classmethod
    def interleave(cls, shards: list[FeatureStore]) -> FeatureStore:
        """The sequences of ``shards`` taken round robin (shard 0's first, shard 1's first, ..., shard 0's
        second, ...): process r of w holds conversations ``r::w``, so this is the conversations' own order,
        and a run on w processes trains on the same data order as one process. No feature is read."""
        if len(shards) == 1:
            return cls.cat(shards)
        whole = cls.cat(shards)
        starts = [0, *torch.tensor([len(s) for s in shards]).cumsum(0).tolist()[:-1]]
        order = [starts[r] + i for i in range(max(len(s) for s in shards)) for r, s in enumerate(shards) if i < len(s)]
        idx = torch.cat([torch.arange(int(whole.offsets[j]), int(whole.offsets[j] + whole.lengths[j])) for j in order])
        return cls(whole.tokens[idx], whole.rows, whole.loss_mask[idx], whole.lengths[order], whole.starts[order])

    @property
    def features(self) -> torch.Tensor:
        """All features ``[ΣT, W]`` in sequence order: the tensor itself for a store in memory, else every row read
        (a whole store on disk in memory: for small stores and tests; recipes read :meth:`sequence`)."""
        if self._in_order:
            return self.rows.tensor  # type: ignore[attr-defined]
        if not len(self):
            return torch.zeros(0, self.width, dtype=self.dtype)
        return torch.cat([self.sequence(i)[1] for i in range(len(self))])

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The four tensors by name (``prefix + "tokens"``, ``"features"``, ``"loss_mask"``, ``"lengths"``)."""
        return {
            prefix + "tokens": self.tokens,
            prefix + "features": self.features.contiguous(),
            prefix + "loss_mask": self.loss_mask,
            prefix + "lengths": self.lengths,
        }

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str = "") -> FeatureStore:
        """The inverse of :meth:`tensors` (in memory)."""
        return cls(t[prefix + "tokens"], t[prefix + "features"], t[prefix + "loss_mask"], t[prefix + "lengths"])

    def __len__(self) -> int:
        return int(self.lengths.numel())

    @property
    def width(self) -> int:
        """Feature width per token."""
        return self.rows.width

    @property
    def dtype(self) -> torch.dtype:
        """The features' dtype."""
        return self.rows.dtype

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [T], features [T, W], loss_mask [T])`` of sequence i (its features read now)."""
        o, T = int(self.offsets[i]), int(self.lengths[i])
        return self.tokens[o : o + T], self.rows.span(int(self.starts[i]), T), self.loss_mask[o : o + T]

    def feature_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The features at token ``positions`` (Long, any shape, into ``tokens``), ``[*positions.shape, W]``.

        Raises:
            ValueError: features computed online (they are read by whole sequence).
        """
        flat = positions.reshape(-1).long()
        seq = torch.searchsorted(self.offsets, flat, right=True) - 1
        rows = self.starts[seq] + flat - self.offsets[seq] if flat.numel() else flat
        return self.rows.take(rows).view(*positions.shape, self.width)


def feature_signature(
    target: PreTrainedModel, train_convs: list[dict], eval_convs: list[dict], max_length: int, layers: str = LAYERS
) -> str:
    """What a feature cache is computed from, as 16 hex digits: the target's fingerprint, ``max_length``,
    the layers taken, and every conversation of both splits (ids and text, in order)."""
    h = hashlib.sha256(f"{target_fingerprint(target)}|{max_length}|{layers}".encode())
    for conv in [*train_convs, None, *eval_convs]:
        h.update(b"\0" if conv is None else json.dumps(conv, sort_keys=True).encode())
    return h.hexdigest()[:16]


def store_path(output_dir: str | Path, rank: int = 0, world: int = 1) -> Path:
    """The store directory of process ``rank`` of ``world`` (:mod:`~selfspec.train.store_shards`)."""
    return Path(output_dir) / "features" / f"rank{rank}-of{world}"


def taken_layers(layers: Sequence[int] | None) -> str:
    """The layers a store of ``layers`` takes, as its identity names them: ``"final_norm"``, or the decoder layers
    first (``"2,15,27,final_norm"``)."""
    return LAYERS if not layers else ",".join(str(i) for i in layers) + "," + LAYERS


def store_identity(
    target: PreTrainedModel,
    train_convs: list[dict],
    eval_convs: list[dict],
    max_length: int,
    layers: Sequence[int] | None = None,
) -> StoreIdentity:
    """What a store of ``target``'s features over both splits at ``max_length`` with ``layers`` is of (its
    :func:`feature_signature`, the target's fingerprint, the layers, the width ``(len(layers) + 1) * D`` and the
    target's dtype)."""
    taken = taken_layers(layers)
    width = target.config.hidden_size * (len(layers) + 1 if layers else 1)
    return StoreIdentity(
        signature=feature_signature(target, train_convs, eval_convs, max_length, taken),
        target_fingerprint=target_fingerprint(target),
        layers=taken,
        max_length=int(max_length),
        width=int(width),
        dtype=str(next(target.parameters()).dtype).removeprefix("torch."),
    )


def save_features(
    path: Path, train: FeatureStore, held: FeatureStore, identity: StoreIdentity, shard_bytes: int = 1 << 28
) -> None:
    """Write both splits (sequences in their order) as a complete store of ``identity`` in ``path``.

    Raises:
        ValueError: features of another width than ``identity``'s.
    """
    writer = StoreWriter(path, identity, (len(train), len(held)), shard_bytes)
    for split, store in zip(SPLITS, (train, held), strict=True):
        for i in range(len(store)):
            if i not in writer.kept[split]:
                writer.add(split, i, *_stored(store.sequence(i), identity))
    writer.finish()


def _stored(seq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], identity: StoreIdentity) -> tuple:
    tokens, feats, mask = seq
    return tokens, mask, feats.to(getattr(torch, identity.dtype))


def has_features(path: Path, identity: StoreIdentity) -> bool:
    """Whether ``path`` holds a complete store of ``identity`` (reads the manifest only)."""
    manifest = read_manifest(path)
    return manifest is not None and manifest.complete and identity.mismatch(manifest.identity) is None


def training_examples(
    cfg: TrainConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, convs: list[dict]
) -> list[dict]:
    """``convs`` rendered for training (:func:`~selfspec.train.chat_tokens.build_training_examples`) at
    ``cfg.max_length``, or at the target's ``max_position_embeddings`` when that is shorter (logged)."""
    length = cfg.max_length
    context = getattr(target.config, "max_position_embeddings", None)
    if context and context < length:
        logger.info("conversations truncated to the target's context, %d tokens (max_length %d)", context, length)
        length = int(context)
    return build_training_examples(tokenizer, convs, length)


def load_features(path: Path, identity: StoreIdentity) -> tuple[FeatureStore, FeatureStore] | None:
    """``(train, held_out)`` of the complete store of ``identity`` in ``path``, its features left on disk; None
    when there is none (a store of other inputs, or one a stopped run left unfinished, is logged)."""
    opened = open_store(path, identity)
    if opened is None:
        return None
    train, held = (FeatureStore.from_split(s) for s in opened)
    logger.info("opened the feature store %s (%d train / %d held-out sequences)", path, len(train), len(held))
    return train, held


def write_features(
    path: Path,
    identity: StoreIdentity,
    target: PreTrainedModel,
    splits: tuple[list[dict], list[dict]],
    captured: CapturedStates | None,
    layers: Sequence[int] | None,
    batch_tokens: int,
    shard_bytes: int,
    quiet: bool = False,
) -> int:
    """Compute the target's features of both splits' examples into the store of ``identity`` at ``path``, shard by
    shard, resuming what a stopped run left there (:class:`~selfspec.train.store_shards.StoreWriter`).

    Examples whose states self-distillation captured for the same tokens (``captured``, :meth:`~selfspec.train.
    distill_states.CapturedStates.take`) are stored from the capture; the others run through the target in the
    batches :func:`~selfspec.train.features.hidden_features` forms (:func:`~selfspec.train.features.length_batches`
    of ``batch_tokens``), one batch at a time, so a shard is written as soon as its bytes are computed and at most a
    shard and a batch of features are in memory. The features are those of one :func:`hidden_features` call over
    all the examples, bit for bit.

    Returns:
        Tokens run through the target (or taken from the capture) by this call.
    """
    writer = StoreWriter(path, identity, (len(splits[0]), len(splits[1])), shard_bytes)
    dtype = getattr(torch, identity.dtype)
    done = 0
    for split, examples in zip(SPLITS, splits, strict=True):
        left = [i for i in range(len(examples)) if i not in writer.kept[split]]
        todo = []
        reused = 0
        for i in left:
            feats = captured.take(examples[i], layers) if captured else None
            if feats is None:
                todo.append(i)
            elif examples[i]["input_ids"].numel() >= 2:
                writer.add(split, i, examples[i]["input_ids"], examples[i]["loss_mask"], feats.to(dtype))
                reused += 1
                done += int(feats.shape[0])
        if captured is not None:
            logger.info(
                "target features (%s): %d of %d sequences captured during self-distillation", split, reused, len(left)
            )
        if len(left) < len(examples):
            stored = len(examples) - len(left)
            logger.info("target features (%s): %d sequences stored before, %d to compute", split, stored, len(todo))
        plan = length_batches([int(examples[i]["input_ids"].numel()) for i in todo], batch_tokens)
        with tqdm(total=len(todo), desc=f"target features ({split})", disable=quiet) as bar:
            for batch in plan:
                rows = [examples[todo[j]] for j in batch]
                for j, feats in zip(batch, hidden_features(target, rows, True, layers, batch_tokens), strict=True):
                    ex = examples[todo[j]]
                    if ex["input_ids"].numel() >= 2:
                        writer.add(split, todo[j], ex["input_ids"], ex["loss_mask"], feats)
                    done += int(feats.shape[0])
                bar.update(len(batch))
    writer.finish()
    return done


def target_features(run: RunInputs, layers: Sequence[int] | None = None) -> tuple[FeatureStore, FeatureStore, str]:
    """Target features of ``run``'s two splits (the same on every process), from the store or computed into it.

    With ``layers`` (EAGLE-3, DFlash), each position's features are the hidden states entering those decoder layers
    followed by the last hidden state (``[ΣT, (len(layers) + 1) * D]``, :func:`~selfspec.train.features.
    hidden_features`), and the store's identity names them (``"2,15,27,final_norm"``).

    Process r computes (or finds complete in its store, or resumes) the conversations ``r::w`` of each split,
    rendered with :func:`training_examples`, into shards of ``cfg.feature_shard_mb``; then every process opens all w
    stores and interleaves them back into the conversations' order (:meth:`FeatureStore.interleave`). Conversations
    whose features self-distillation captured (``run.captured``, :mod:`~selfspec.train.distill_states`) are not run
    through the target again; the capture is emptied either way.

    Returns:
        ``(train, held_out, signature)``: the stores (features read from disk per sequence) and their
        :func:`feature_signature`.

    Raises:
        ValueError: the store of another process is not complete or not of this run's inputs (processes were
            given different data).
    """
    cfg, accelerator, target, captured = run.cfg, run.accelerator, run.target, run.captured
    rank, world = accelerator.process_index, accelerator.num_processes
    identity = store_identity(target, run.train_convs, run.eval_convs, cfg.max_length, layers)
    mine = store_path(cfg.output_dir, rank, world)
    legacy = mine.with_name(mine.name + ".safetensors")
    if legacy.is_file():  # the single-file store of earlier versions
        size = legacy.stat().st_size / 2**30
        logger.warning("%s is a feature store of an earlier layout, not read: remove it to free %.2f GiB", legacy, size)
    own = load_features(mine, identity)
    if own is None:
        t0 = time.perf_counter()
        splits = tuple(
            training_examples(cfg, target, run.tokenizer, convs[rank::world])
            for convs in (run.train_convs, run.eval_convs)
        )
        shard_bytes = int(cfg.feature_shard_mb * 2**20)
        quiet = not accelerator.is_local_main_process
        batch_tokens = cfg.feature_batch_tokens
        n_tok = write_features(mine, identity, target, splits, captured, layers, batch_tokens, shard_bytes, quiet)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        logger.info("target features: %d tokens in %.1fs (%.0f tokens/s)", n_tok, dt, n_tok / max(dt, 1e-9))
        own = load_features(mine, identity)
        if own is None:
            raise RuntimeError(f"the feature store {mine} just written cannot be read")
    sync_forwards(target)  # a sharded target: a process done (or resumed complete) waits for the others' forwards
    if captured is not None:
        captured.clear()
    if world == 1:
        return own[0], own[1], identity.signature
    accelerator.wait_for_everyone()
    shards = []
    for r in range(world):
        loaded = own if r == rank else load_features(store_path(cfg.output_dir, r, world), identity)
        if loaded is None:
            raise ValueError(f"process {r} stored features of other data than process {rank}")
        shards.append(loaded)
    train = FeatureStore.interleave([s[0] for s in shards])
    return train, FeatureStore.interleave([s[1] for s in shards]), identity.signature
