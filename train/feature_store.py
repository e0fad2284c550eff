"""One feature store for every recipe: the frozen target's hidden states over the training data, computed
once and cached, keyed by what they were computed from.

A store holds whole sequences, concatenated: ``tokens`` ``[ΣT]``, ``features`` ``[ΣT, D]`` (the target's
last hidden states after the final norm, in the target's dtype), ``loss_mask`` ``[ΣT]`` (True at assistant
tokens) and ``lengths`` ``[E]``. Each recipe derives its own training rows from it (Medusa: one row per
position, :func:`selfspec.train.medusa.position_table`; EAGLE: shifted pairs packed into rows,
:mod:`selfspec.train.eagle_data`).

Cache files are ``<output_dir>/features/rank{r}-of{w}.safetensors``: process r of w computes the
conversations ``r::w`` and every process then reads all w files, so each holds the whole data set and the
``DataLoader`` that ``accelerate`` prepares shards the batches. Every file carries the signature of its
inputs (:func:`feature_signature`: target fingerprint, every conversation, ``max_length``, the layers
taken); a file with another signature is recomputed, never reused, whichever head family wrote it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from selfspec.base.fingerprint import target_fingerprint
from selfspec.train.chat_tokens import build_training_examples
from selfspec.train.config import TrainConfig
from selfspec.train.features import features_reusing
from selfspec.train.inputs import RunInputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


logger = logging.getLogger(__name__)

LAYERS = "final_norm"
"""The layers a store takes: the last decoder layer's output after the final norm (the lm_head input)."""


class FeatureStore:
    """Concatenated sequences: ``tokens`` Long ``[ΣT]``, ``features`` ``[ΣT, D]``, ``loss_mask`` Bool ``[ΣT]``,
    ``lengths`` Long ``[E]`` (``offsets`` ``[E]``: where each sequence starts)."""

    def __init__(
        self, tokens: torch.Tensor, features: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor
    ) -> None:
        self.tokens, self.features, self.loss_mask, self.lengths = tokens, features, loss_mask.bool(), lengths.long()
        starts = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)[:-1]])
        self.offsets = starts if self.lengths.numel() else self.lengths

    @classmethod
    def from_examples(cls, examples: list[dict], feats: list[torch.Tensor], hidden_size: int) -> FeatureStore:
        """Examples (``input_ids`` Long ``[T]``, ``loss_mask`` Bool ``[T]``) with their features ``[T, D]``;
        sequences under 2 tokens are dropped (no next-token pair in them)."""
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
    def empty(cls, hidden_size: int, dtype: torch.dtype = torch.float32) -> FeatureStore:
        """A store of no sequence (features ``[0, hidden_size]`` of ``dtype``)."""
        z = torch.zeros(0, dtype=torch.long)
        return cls(z, torch.zeros(0, hidden_size, dtype=dtype), z.bool(), z)

    @classmethod
    def cat(cls, stores: list[FeatureStore]) -> FeatureStore:
        """The stores' sequences one after another (in list order)."""
        if len(stores) == 1:
            return cls(stores[0].tokens, stores[0].features, stores[0].loss_mask, stores[0].lengths)
        return cls(
            *(torch.cat([getattr(s, name) for s in stores]) for name in ("tokens", "features", "loss_mask", "lengths"))
        )

    @classmethod
    def interleave(cls, shards: list[FeatureStore]) -> FeatureStore:
        """The sequences of ``shards`` taken round robin (shard 0's first, shard 1's first, ..., shard 0's
        second, ...): process r of w holds conversations ``r::w``, so this is the conversations' own order,
        and a run on w processes trains on the same data order as one process."""
        if len(shards) == 1:
            return cls.cat(shards)
        whole = cls.cat(shards)
        starts = [0, *torch.tensor([len(s) for s in shards]).cumsum(0).tolist()[:-1]]
        order = [starts[r] + i for i in range(max(len(s) for s in shards)) for r, s in enumerate(shards) if i < len(s)]
        idx = torch.cat([torch.arange(int(whole.offsets[j]), int(whole.offsets[j] + whole.lengths[j])) for j in order])
        return cls(whole.tokens[idx], whole.features[idx], whole.loss_mask[idx], whole.lengths[order])

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The four tensors by name (``prefix + "tokens"``, ...), as :func:`save_features` writes them."""
        return {
            prefix + "tokens": self.tokens,
            prefix + "features": self.features.contiguous(),
            prefix + "loss_mask": self.loss_mask,
            prefix + "lengths": self.lengths,
        }

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str = "") -> FeatureStore:
        """The inverse of :meth:`tensors`."""
        return cls(t[prefix + "tokens"], t[prefix + "features"], t[prefix + "loss_mask"], t[prefix + "lengths"])

    def __len__(self) -> int:
        return int(self.lengths.numel())

    @property
    def width(self) -> int:
        """Feature width per token (``features.shape[-1]``)."""
        return int(self.features.shape[-1])

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [T], features [T, D], loss_mask [T])`` of sequence i."""
        o, T = int(self.offsets[i]), int(self.lengths[i])
        return self.tokens[o : o + T], self.features[o : o + T], self.loss_mask[o : o + T]


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
    """The cache file of process ``rank`` of ``world``."""
    return Path(output_dir) / "features" / f"rank{rank}-of{world}.safetensors"


def save_features(path: Path, train: FeatureStore, held: FeatureStore, signature: str, layers: str = LAYERS) -> None:
    """Write both splits to ``path`` atomically (a temporary file renamed), with ``signature`` and ``layers``
    in the metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(
        {**train.tensors(), **held.tensors("eval_")}, str(tmp), metadata={"signature": signature, "layers": layers}
    )
    os.replace(tmp, path)


def has_features(path: Path, signature: str) -> bool:
    """Whether ``path`` exists and carries ``signature`` (reads the metadata only)."""
    if not path.exists():
        return False
    with safe_open(str(path), "pt") as fh:
        return (fh.metadata() or {}).get("signature") == signature


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


def load_features(path: Path, signature: str) -> tuple[FeatureStore, FeatureStore] | None:
    """``(train, held_out)`` from ``path`` when it exists and carries ``signature``; None otherwise (a
    mismatch is logged as a warning: the cache came from other data, target, length or layers)."""
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as fh:
        cached = (fh.metadata() or {}).get("signature")
    if cached != signature:
        logger.warning(
            "cached features %s were computed from other inputs (signature %s, now %s): recomputing",
            path,
            cached,
            signature,
        )
        return None
    t = load_file(str(path))
    train, held = FeatureStore.from_tensors(t), FeatureStore.from_tensors(t, "eval_")
    logger.info("loaded cached features %s (%d train / %d held-out sequences)", path, len(train), len(held))
    return train, held


def target_features(run: RunInputs, layers: Sequence[int] | None = None) -> tuple[FeatureStore, FeatureStore, str]:
    """Target features of ``run``'s two splits (the same on every process), from the cache or computed.

    With ``layers`` (EAGLE-3), each position's features are the hidden states entering those decoder layers
    followed by the last hidden state (``[ΣT, (len(layers) + 1) * D]``, :func:`~selfspec.train.features.
    hidden_features`), and the signature names them (``"2,15,27,final_norm"``).

    Process r computes (or finds in its cache file) the conversations ``r::w`` of each split, rendered
    with :func:`training_examples`; then every process
    reads all w files and interleaves them back into the conversations' order (:meth:`FeatureStore.interleave`).
    Conversations whose features self-distillation captured (``run.captured``,
    :mod:`~selfspec.train.distill_states`) are not run through the target again; the capture is emptied either way.

    Returns:
        ``(train, held_out, signature)``: the stores and their :func:`feature_signature`.

    Raises:
        ValueError: a cache file of another process does not carry this run's signature (processes were
            given different data).
    """
    cfg, accelerator, target, captured = run.cfg, run.accelerator, run.target, run.captured
    train_convs, eval_convs = run.train_convs, run.eval_convs
    rank, world = accelerator.process_index, accelerator.num_processes
    taken = LAYERS if not layers else ",".join(str(i) for i in layers) + "," + LAYERS
    signature = feature_signature(target, train_convs, eval_convs, cfg.max_length, taken)
    mine = store_path(cfg.output_dir, rank, world)
    own = load_features(mine, signature)
    if own is None:
        quiet = not accelerator.is_local_main_process
        t0 = time.perf_counter()
        D = target.config.hidden_size
        parts = []
        for convs in (train_convs[rank::world], eval_convs[rank::world]):
            ex = training_examples(cfg, target, run.tokenizer, convs)
            feats = features_reusing(target, ex, captured, quiet, layers, cfg.feature_batch_tokens)
            parts.append(FeatureStore.from_examples(ex, feats, D * (len(layers) + 1 if layers else 1)))
        own = (parts[0], parts[1])
        n_tok = int(own[0].lengths.sum() + own[1].lengths.sum())
        dt = time.perf_counter() - t0
        logger.info("target features: %d tokens in %.1fs (%.0f tokens/s)", n_tok, dt, n_tok / max(dt, 1e-9))
        save_features(mine, *own, signature, taken)
    if captured is not None:
        captured.clear()
    if world == 1:
        return own[0], own[1], signature
    accelerator.wait_for_everyone()
    shards = []
    for r in range(world):
        loaded = own if r == rank else load_features(store_path(cfg.output_dir, r, world), signature)
        if loaded is None:
            raise ValueError(f"process {r} cached features of other data than process {rank}")
        shards.append(loaded)
    return FeatureStore.interleave([s[0] for s in shards]), FeatureStore.interleave([s[1] for s in shards]), signature
