"""Where a feature store's rows come from: a tensor in memory, or shard files on disk read row range by row range.

A row is one token's target features (``width`` values of ``dtype``). Every reader answers two questions:
:meth:`FeatureRows.span` (``n`` consecutive rows, a whole sequence) and :meth:`FeatureRows.take` (rows at arbitrary
indices, Medusa's single positions). :class:`ShardRows` reads them from the files with positional reads
(``os.preadv`` into a fresh buffer), so a process holds only the rows it asked for: the bytes of a store on disk
never enter its resident memory (a memory map would count every page it touched as resident until the kernel
reclaims it, so its peak RSS would grow with the store).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class FeatureRows(abc.ABC):
    """Rows ``[N, width]`` of ``dtype``, read by range or by index.

    Attributes:
        width: values per row (the feature width, ``k * D``).
        dtype: the rows' dtype (the target's).
    """

    width: int
    dtype: torch.dtype

    @abc.abstractmethod
    def __len__(self) -> int:
        """Rows held."""

    @abc.abstractmethod
    def span(self, start: int, n: int) -> torch.Tensor:
        """Rows ``start .. start + n - 1`` as ``[n, width]`` (a view where the rows are in memory)."""

    @abc.abstractmethod
    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Rows at ``index`` (Long ``[N]``), ``[N, width]``.

        Raises:
            ValueError: this reader reads whole sequences only (features computed online).
        """

    @abc.abstractmethod
    def concat(self, others: Sequence[FeatureRows]) -> FeatureRows:
        """This reader's rows followed by each of ``others``' (all of this reader's kind, width and dtype).

        Raises:
            ValueError: readers of another kind, width or dtype.
        """


class TensorRows(FeatureRows):
    """Rows held in memory: a ``[N, width]`` tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.width, self.dtype = int(tensor.shape[-1]), tensor.dtype

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def span(self, start: int, n: int) -> torch.Tensor:
        return self.tensor[start : start + n]

    def take(self, index: torch.Tensor) -> torch.Tensor:
        return self.tensor[index]

    def concat(self, others: Sequence[FeatureRows]) -> FeatureRows:
        if not all(isinstance(o, TensorRows) for o in others):
            raise ValueError("in-memory features join only in-memory features")
        return TensorRows(torch.cat([self.tensor, *(o.tensor for o in others)]))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ShardSpan:
    """The rows of one shard file: ``rows`` rows of ``width`` values starting ``offset`` bytes into ``path``."""

    path: str
    offset: int
    rows: int


class ShardRows(FeatureRows):
    """Rows of shard files, concatenated in list order, read from disk on every call (nothing cached).

    Args:
        spans: the shard files' row blocks (:class:`ShardSpan`), in row order.
        width / dtype: of every row.

    File descriptors are opened on first use and kept per process (never pickled: a copy opens its own).
    """

    def __init__(self, spans: Sequence[ShardSpan], width: int, dtype: torch.dtype) -> None:
        self.spans, self.width, self.dtype = tuple(spans), int(width), dtype
        self.row_bytes = self.width * torch.empty(0, dtype=dtype).element_size()
        self.bases = torch.tensor([0, *torch.tensor([s.rows for s in self.spans]).cumsum(0).tolist()], dtype=torch.long)
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return int(self.bases[-1])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}}

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _fd(self, k: int) -> int:
        if k not in self._fds:
            self._fds[k] = os.open(self.spans[k].path, os.O_RDONLY)
        return self._fds[k]

    def _read(self, k: int, first: int, n: int) -> torch.Tensor:
        """``n`` rows of shard ``k`` from its row ``first``: ``[n, width]`` in a fresh buffer."""
        size = n * self.row_bytes
        buf = bytearray(size)
        view, at, done = memoryview(buf), self.spans[k].offset + first * self.row_bytes, 0
        while done < size:
            got = os.preadv(self._fd(k), [view[done:]], at + done)
            if got <= 0:
                raise OSError(f"{self.spans[k].path} ends before its rows (truncated after it was opened?)")
            done += got
        if size == 0:
            return torch.empty(0, self.width, dtype=self.dtype)
        return torch.frombuffer(buf, dtype=self.dtype).view(n, self.width)

    def span(self, start: int, n: int) -> torch.Tensor:
        parts, at, left = [], start, n
        while left > 0:
            k = int(torch.searchsorted(self.bases, torch.tensor(at), right=True)) - 1
            first = at - int(self.bases[k])
            m = min(left, self.spans[k].rows - first)
            parts.append(self._read(k, first, m))
            at, left = at + m, left - m
        if not parts:
            return torch.empty(0, self.width, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def take(self, index: torch.Tensor) -> torch.Tensor:
        flat = index.reshape(-1).long()
        if flat.numel() == 0:
            return torch.empty(*index.shape, self.width, dtype=self.dtype)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        # runs of consecutive rows: one read each
        breaks = (unique[1:] != unique[:-1] + 1).nonzero().flatten() + 1
        starts = torch.cat([breaks.new_zeros(1), breaks]).tolist()
        stops = [*breaks.tolist(), unique.numel()]
        got = torch.cat([self.span(int(unique[a]), b - a) for a, b in zip(starts, stops, strict=True)])
        return got[inverse].view(*index.shape, self.width)

    def concat(self, others: Sequence[FeatureRows]) -> FeatureRows:
        if not all(isinstance(o, ShardRows) and o.width == self.width and o.dtype == self.dtype for o in others):
            raise ValueError("shard features join only shard features of the same width and dtype")
        return ShardRows([*self.spans, *(s for o in others for s in o.spans)], self.width, self.dtype)  # type: ignore[attr-defined]
