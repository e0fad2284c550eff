"""The feature store on disk: shard files written as the features are computed, and a manifest that says which
are complete and what they were computed from.

One process's store is a directory (:func:`~selfspec.train.feature_store.store_path`)::

    manifest.json            StoreManifest: what the features are of (StoreIdentity), the shards written, complete
    train-00000.safetensors  a shard: index, lengths [E_s]; tokens, loss_mask [ΣT]; features [ΣT, W]
    eval-00000.safetensors   (the held-out split's)

A shard holds whole sequences (``index``: each one's place in its split) and is written to a temporary name,
flushed to disk (``fsync``) and renamed into place; only then is it listed in the manifest (rewritten atomically)
with its size and SHA-256. So a process killed at any moment leaves complete, listed shards and at most a
temporary file or an unlisted shard, which the next run removes: :class:`StoreWriter` keeps the listed shards whose
size and checksum hold and computes only the sequences they lack; :func:`open_store` reads a store only when its
manifest says it is complete, was computed from the same inputs (:class:`StoreIdentity`: target, layers,
``max_length``, conversations, width and dtype) and every shard has its recorded size. A store of other inputs is
never read: it is recomputed in place, with the reason logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from selfspec.base.files import fsync_dir, read_dataclass, read_json, record_dict, write_json
from selfspec.train.feature_rows import ShardRows, ShardSpan

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
HEADER = {"format": "selfspec-feature-store", "version": 1}
SPLITS = ("train", "eval")

# safetensors' dtype names (https://github.com/huggingface/safetensors: the format's header)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoreIdentity:
    """What a store's features are of; a store of another identity is never read.

    Attributes:
        signature: :func:`~selfspec.train.feature_store.feature_signature` (target fingerprint, ``max_length``,
            layers and every conversation of both splits).
        target_fingerprint: the target's (:func:`~selfspec.base.fingerprint.target_fingerprint`).
        layers: the layers taken (``"2,15,27,final_norm"``).
        max_length: tokens per rendered conversation.
        width: features per token; dtype: their dtype (``"float32"``, ``"bfloat16"``).
    """

    signature: str
    target_fingerprint: str
    layers: str
    max_length: int
    width: int
    dtype: str

    def mismatch(self, other: StoreIdentity) -> str | None:
        """Why a store of ``other`` is not this store (None: it is), in words for the log."""
        if other.target_fingerprint != self.target_fingerprint:
            return f"written by another target ({other.target_fingerprint}, now {self.target_fingerprint})"
        if other.layers != self.layers:
            return f"of another layer choice ({other.layers}, now {self.layers})"
        if other.max_length != self.max_length:
            return f"of another max_length ({other.max_length}, now {self.max_length})"
        if (other.width, other.dtype) != (self.width, self.dtype):
            return f"of another width or dtype ({other.width} {other.dtype}, now {self.width} {self.dtype})"
        if other.signature != self.signature:
            return f"computed from other conversations (signature {other.signature}, now {self.signature})"
        return None


@dataclass(frozen=True)
class ShardEntry:
    """One complete shard: its file name, sequences and tokens, size in bytes and SHA-256 (hex)."""

    file: str
    split: str
    sequences: int
    tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class StoreManifest:
    """A store directory's ``manifest.json``: its identity, the complete shards in the order written, the examples
    of each split (sequences under 2 tokens are rendered but never stored) and whether every one is written."""

    identity: StoreIdentity
    examples: tuple[int, int]
    shards: tuple[ShardEntry, ...]
    complete: bool


def read_manifest(directory: Path) -> StoreManifest | None:
    """The manifest of ``directory``; None when there is none or it cannot be read (logged)."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        return read_dataclass(StoreManifest, read_json(path), str(path), header=HEADER)
    except (OSError, ValueError) as err:
        logger.warning("feature store manifest %s is unreadable (%s): its shards are not used", path, err)
        return None


def _write_manifest(directory: Path, manifest: StoreManifest) -> None:
    write_json(directory / MANIFEST, record_dict(manifest, HEADER))
    fsync_dir(directory)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tensor_layout(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """The tensors of a safetensors file from its header alone: ``{name: (dtype, shape, begin, end)}``, begin and
    end in bytes from the file's start.

    Raises:
        ValueError: not a safetensors file (or a dtype this reader does not know).
    """
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a safetensors file: {err}") from err
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which the store does not write")
        begin, end = entry["data_offsets"]
        out[name] = (_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + n + begin, 8 + n + end)
    return out


def _read_tensor(path: Path, layout: tuple[torch.dtype, tuple[int, ...], int, int]) -> torch.Tensor:
    dtype, shape, begin, end = layout
    with path.open("rb") as fh:
        fh.seek(begin)
        buf = bytearray(end - begin)
        if fh.readinto(buf) != len(buf):
            raise ValueError(f"{path} is truncated")
    if not buf:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


@dataclass
class StoreSplit:
    """One split of an open store, sequences in their split's order: ``tokens`` Long / ``loss_mask`` Bool
    ``[ΣT]`` and ``lengths`` Long ``[E]`` in memory, the features in ``rows`` (read from the shards on demand) with
    sequence i's first row at ``starts[i]``."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    rows: ShardRows


def open_store(directory: Path, identity: StoreIdentity) -> tuple[StoreSplit, StoreSplit] | None:
    """Both splits of the complete store in ``directory``, when it is of ``identity``; None otherwise (no store,
    one still being written, one of other inputs, or a shard whose size is not the manifest's: logged).

    Only the shards' token ids, masks and lengths are read; the features stay on disk (:class:`ShardRows`).
    """
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    why = identity.mismatch(manifest.identity)
    if why is not None:
        logger.warning("feature store %s is %s: not read", directory, why)
        return None
    if not manifest.complete:
        logger.info("feature store %s is incomplete (a run stopped while writing it)", directory)
        return None
    dtype = getattr(torch, identity.dtype)
    splits = []
    for k, split in enumerate(SPLITS):
        parts, spans = [], []
        for shard in (s for s in manifest.shards if s.split == split):
            path = directory / shard.file
            size = path.stat().st_size if path.exists() else -1
            if size != shard.bytes:
                logger.warning("feature store shard %s has %d bytes, not %d: not read", path, size, shard.bytes)
                return None
            layout = tensor_layout(path)
            _, shape, begin, _ = layout["features"]
            spans.append(ShardSpan(str(path), begin, int(shape[0])))
            small = ("index", "lengths", "tokens", "loss_mask")
            parts.append({name: _read_tensor(path, layout[name]) for name in small})
        n = sum(int(p["index"].numel()) for p in parts)
        index = torch.cat([p["index"] for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        lengths = torch.cat([p["lengths"] for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        tokens = torch.cat([p["tokens"] for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        mask = torch.cat([p["loss_mask"] for p in parts]) if parts else torch.zeros(0, dtype=torch.bool)
        if index.unique().numel() != n or (n and int(index.max()) >= manifest.examples[k]):
            logger.warning("feature store %s lists a sequence twice or out of its split: not read", directory)
            return None
        rows = ShardRows(spans, identity.width, dtype)
        file_starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]]) if n else lengths
        order = index.argsort()  # the split's order (the examples under 2 tokens are not there)
        lengths, starts = lengths[order], file_starts[order]
        spans_of = [torch.arange(int(s), int(s + t)) for s, t in zip(starts, lengths, strict=True)]
        gather = torch.cat(spans_of) if n else lengths
        splits.append(StoreSplit(tokens[gather], mask[gather].bool(), lengths, starts, rows))
    return splits[0], splits[1]


class StoreWriter:
    """Writes a store's shards as sequences arrive, resuming a store of the same identity that a stopped run left.

    Args:
        directory: the store's directory (created).
        identity: what the features are of; a store there of another identity is removed first (logged).
        examples: rendered examples of each split (``(train, eval)``), for the manifest.
        shard_bytes: a shard is written once its features reach this many bytes (and at :meth:`finish`).

    Attributes:
        kept: ``{split: set of indices}`` already in complete shards (a resumed store), which need no computing.
    """

    def __init__(self, directory: Path, identity: StoreIdentity, examples: tuple[int, int], shard_bytes: int) -> None:
        self.directory, self.identity, self.examples = directory, identity, examples
        self.shard_bytes = max(1, int(shard_bytes))
        directory.mkdir(parents=True, exist_ok=True)
        old = read_manifest(directory)
        shards: list[ShardEntry] = []
        if old is not None:
            why = identity.mismatch(old.identity)
            if why is not None:
                logger.warning("feature store %s is %s: recomputing it", directory, why)
            elif tuple(old.examples) != tuple(examples):
                logger.warning("feature store %s holds other example counts: recomputing it", directory)
            else:
                shards = [s for s in old.shards if self._intact(s)]
                if shards:
                    logger.info("feature store %s: resuming after %d complete shards", directory, len(shards))
        self.shards = shards
        listed = {s.file for s in shards}
        for path in directory.iterdir():  # temporary files, unlisted or broken shards, another store's
            if path.name != MANIFEST and path.name not in listed:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.kept = {split: set() for split in SPLITS}
        for s in shards:
            path = directory / s.file
            self.kept[s.split].update(_read_tensor(path, tensor_layout(path)["index"]).tolist())
        self._next = 1 + max((int(s.file.split("-")[1].split(".")[0]) for s in shards), default=-1)
        self._pending: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {s: [] for s in SPLITS}
        self._write(complete=False)

    def _intact(self, shard: ShardEntry) -> bool:
        path = self.directory / shard.file
        ok = path.exists() and path.stat().st_size == shard.bytes and _sha256(path) == shard.sha256
        if not ok:
            logger.warning("feature store shard %s is not the one its manifest lists: computing it again", path)
        return ok

    def _write(self, complete: bool) -> None:
        _write_manifest(self.directory, StoreManifest(self.identity, self.examples, tuple(self.shards), complete))

    def add(
        self, split: str, index: int, tokens: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor
    ) -> None:
        """Sequence ``index`` of ``split``: ``tokens`` Long ``[T]``, ``loss_mask`` Bool ``[T]``, ``features``
        ``[T, W]`` (written with the next shard of its split)."""
        if features.shape != (tokens.numel(), self.identity.width):
            width = self.identity.width
            raise ValueError(f"features {tuple(features.shape)} for {tokens.numel()} tokens of width {width}")
        pending = self._pending[split]
        pending.append((index, tokens, loss_mask, features))
        if sum(p[3].nbytes for p in pending) >= self.shard_bytes:
            self.flush(split)

    def flush(self, split: str) -> None:
        """Write ``split``'s pending sequences as one shard: temporary file, fsync, rename, then the manifest."""
        pending, self._pending[split] = self._pending[split], []
        if not pending:
            return
        name = f"{split}-{self._next:05d}.safetensors"
        self._next += 1
        path = self.directory / name
        tmp = self.directory / f".{name}.tmp{os.getpid()}"
        tensors = {
            "index": torch.tensor([p[0] for p in pending], dtype=torch.long),
            "lengths": torch.tensor([p[1].numel() for p in pending], dtype=torch.long),
            "tokens": torch.cat([p[1] for p in pending]).long(),
            "loss_mask": torch.cat([p[2] for p in pending]).bool(),
            "features": torch.cat([p[3] for p in pending]).contiguous(),
        }
        save_file(tensors, str(tmp), metadata={"signature": self.identity.signature, "split": split})
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        digest, size = _sha256(tmp), tmp.stat().st_size
        os.replace(tmp, path)
        fsync_dir(self.directory)
        tokens = int(tensors["tokens"].numel())
        self.shards.append(ShardEntry(name, split, len(pending), tokens, size, digest))
        self._write(complete=False)

    def finish(self) -> None:
        """Write what is pending and mark the store complete."""
        for split in SPLITS:
            self.flush(split)
        self._write(complete=True)
