"""An n-gram index of training answers: continuations for the hybrid drafter beyond the prompt's own text.

Prompt lookup (Saxena 2023) only finds text the prompt or the answer so far already holds. Answers to
similar requests repeat each other across a training set (boilerplate, code idioms, list layouts), so
SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975) also draws continuations from a suffix structure
over earlier outputs, following the most frequent path after the longest match. :class:`SuffixIndex` does
the same over the assistant answers of training conversations, with plain torch tensors instead of a
suffix tree:

* the corpus is one int32 token tensor ``[T]`` (the answers end to end) with their lengths;
* for each n in ``[min_ngram, max_ngram]``, every n-gram that has at least one continuation token in its
  own answer gets a 62-bit rolling hash (two polynomial hashes modulo 31-bit primes, so no product
  overflows int64); hashes are sorted, with the n-gram's start position beside each;
* a lookup hashes the context's last n tokens, finds the equal hashes with :func:`torch.searchsorted`,
  and keeps only the candidates whose tokens equal the tail (a hash collision costs time, never a wrong
  match);
* of the first ``max_occurrences`` true occurrences of the longest matching n, the continuation is built
  greedily: at each depth the most frequent next token among the occurrences that still agree with the
  path (smallest id on a tie), stopping when fewer than ``min_support`` agree or every agreeing answer
  has ended. A continuation never crosses from one answer into the next.

Memory: the hash tables hold 16 bytes per corpus token per n-gram size (``max_ngram - min_ngram + 1``
sizes); they are rebuilt from the tokens on :meth:`SuffixIndex.load`, so a saved file holds only the
tokens (4 bytes each) and the lengths.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from selfspec.heads.io import open_safetensors, tensor_digest

FORMAT = "selfspec-suffix-index"
FORMAT_VERSION = "1"
_P1, _P2, _BASE = 2_147_483_647, 2_147_483_629, 1_000_003  # 31-bit primes and the polynomial base
_FIX = "rebuild it: SuffixIndex.from_jsonl(tokenizer, CONVERSATIONS_JSONL).save(PATH)"
_ASSISTANT_ROLES = ("assistant", "gpt", "chatgpt", "model")  # ShareGPT's "from" names for the assistant


def ngram_hashes(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """The rolling hash of every n-gram window of a token sequence.

    Args:
        tokens: int64 ``[T]`` token ids (``>= 0``).
        n: window length, ``1 <= n``.

    Returns:
        int64 ``[max(T - n + 1, 0)]``: entry i hashes ``tokens[i : i + n]``, as
        ``h1 * 2**31 + h2`` with ``h_k = sum_j (tokens[i + j] + 1) * BASE**(n - 1 - j) mod P_k``.
    """
    count = tokens.numel() - n + 1
    if count <= 0:
        return torch.zeros(0, dtype=torch.int64)
    h1 = torch.zeros(count, dtype=torch.int64)
    h2 = torch.zeros(count, dtype=torch.int64)
    for j in range(n):
        window = tokens[j : j + count] + 1
        h1 = (h1 * _BASE + window) % _P1
        h2 = (h2 * _BASE + window) % _P2
    return h1 * 2**31 + h2


class SuffixIndex:
    """Longest-match, most-frequent-path continuations from a corpus of token sequences (module docstring).

    Args:
        sequences: the corpus, each a list of token ids (an assistant answer); empty ones are dropped.
        min_ngram, max_ngram: the match lengths tried, longest first.
        max_occurrences: at most this many occurrences of the match vote on the continuation (the first
            ones in corpus order).
        min_support: a continuation token needs at least this many agreeing occurrences.

    Attributes:
        tokens: int32 ``[T]``, the sequences end to end.
        lengths: int64 ``[num sequences]``, each ``>= 1``, summing to ``T``.

    Raises:
        ValueError: ``1 <= min_ngram <= max_ngram``, ``max_occurrences >= 1`` or ``min_support >= 1`` not
            met, a negative token id, or a corpus of ``2**31`` tokens or more.
    """

    def __init__(
        self,
        sequences: Iterable[Sequence[int]],
        *,
        min_ngram: int = 2,
        max_ngram: int = 6,
        max_occurrences: int = 256,
        min_support: int = 1,
    ) -> None:
        kept = [list(s) for s in sequences if len(s)]
        tokens = torch.tensor([t for s in kept for t in s], dtype=torch.int64)
        lengths = torch.tensor([len(s) for s in kept], dtype=torch.int64)
        self._setup(tokens, lengths, min_ngram, max_ngram, max_occurrences, min_support)

    def _setup(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        min_ngram: int,
        max_ngram: int,
        max_occurrences: int,
        min_support: int,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_occurrences < 1 or min_support < 1:
            raise ValueError(f"need max_occurrences >= 1 and min_support >= 1, got {max_occurrences}, {min_support}")
        if tokens.numel() >= 2**31:
            raise ValueError(f"a suffix index holds under 2**31 tokens, got {tokens.numel()}: index a subset")
        if tokens.numel() and int(tokens.min()) < 0:
            raise ValueError("token ids must be >= 0")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.max_occurrences, self.min_support = max_occurrences, min_support
        self.tokens = tokens.to(torch.int32)
        self.lengths = lengths
        self._tokens = tokens  # int64 [T], for gathers
        ends = torch.cumsum(lengths, 0)
        self._end = torch.repeat_interleave(ends, lengths)  # int64 [T]: where each token's sequence ends
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        positions = torch.arange(tokens.numel(), dtype=torch.int64)
        for n in range(min_ngram, max_ngram + 1):
            hashes = ngram_hashes(tokens, n)
            starts = positions[: hashes.numel()]
            keep = starts + n < self._end[: hashes.numel()]  # inside one sequence, with a continuation token
            hashes, starts = hashes[keep], starts[keep]
            order = torch.argsort(hashes, stable=True)  # equal hashes stay in corpus order
            self._tables[n] = (hashes[order], starts[order])

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def __repr__(self) -> str:
        return (
            f"SuffixIndex({self.lengths.numel()} sequences, {self.num_tokens} tokens, "
            f"n-grams {self.min_ngram}..{self.max_ngram})"
        )

    def _occurrences(self, tail: list[int]) -> torch.Tensor:
        """Continuation positions (int64, corpus order) of up to ``max_occurrences`` true matches of ``tail``."""
        n = len(tail)
        hashes, starts = self._tables[n]
        key = ngram_hashes(torch.tensor(tail, dtype=torch.int64), n)
        lo = int(torch.searchsorted(hashes, key, right=False))
        hi = int(torch.searchsorted(hashes, key, right=True))
        want = torch.tensor(tail, dtype=torch.int64)
        offsets = torch.arange(n, dtype=torch.int64)
        found: list[torch.Tensor] = []
        have = 0
        for a in range(lo, hi, self.max_occurrences):  # candidates in chunks, until enough true matches
            cand = starts[a : min(hi, a + self.max_occurrences)]
            same = (self._tokens[cand[:, None] + offsets] == want).all(dim=1)  # token by token: no collision passes
            match = cand[same]
            found.append(match[: self.max_occurrences - have] + n)
            have += min(match.numel(), self.max_occurrences - have)
            if have >= self.max_occurrences:
                break
        return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)

    def _follow(self, at: torch.Tensor, max_tokens: int) -> list[int]:
        """The greedy most-frequent path from continuation positions ``at`` (int64 ``[M]``)."""
        path: list[int] = []
        end = self._end[at]
        for depth in range(max_tokens):
            alive = at + depth < end
            at, end = at[alive], end[alive]
            if at.numel() < self.min_support:
                break
            nxt = self._tokens[at + depth]
            values, counts = torch.unique(nxt, return_counts=True)  # sorted: argmax takes the smallest id on ties
            best = int(torch.argmax(counts))
            if int(counts[best]) < self.min_support:
                break
            tok = int(values[best])
            path.append(tok)
            agree = nxt == tok
            at, end = at[agree], end[agree]
        return path

    def lookup(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """The continuation of the context's longest matching suffix n-gram.

        Args:
            context: token ids, the last ones matched (a list, or anything ``list()`` takes).
            max_tokens: longest continuation returned.

        Returns:
            ``(tokens, n)``: up to ``max_tokens`` ids and the match length ``n``, for the longest ``n`` in
            ``[min_ngram, max_ngram]`` (and ``<= len(context)``) whose last-n-gram occurs in the corpus with
            a continuation of at least ``min_support`` agreeing occurrences; ``([], 0)`` when none does.
        """
        tokens, n, _ = self.match(context, max_tokens)
        return tokens, n

    def match(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int, list[int]]:
        """:meth:`lookup` and the sequences its match drew on.

        Returns:
            ``(tokens, n, sources)``: as :meth:`lookup`, plus the indices (in corpus order, distinct, ascending) of
            the sequences holding the occurrences of the matched n-gram that voted; ``[]`` when nothing matched.
        """
        if max_tokens < 1 or not self.num_tokens:
            return [], 0, []
        context = list(context)
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            at = self._occurrences(context[-n:])
            if at.numel():
                path = self._follow(at, max_tokens)
                if path:
                    ends = torch.cumsum(self.lengths, 0)
                    sources = torch.unique(torch.searchsorted(ends, at, right=True)).tolist()
                    return path, n, sources
        return [], 0, []

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse an index holding token ids ``>= vocab_size`` (built with another tokenizer).

        Raises:
            ValueError: a token id outside the target's vocabulary; the message names the fix.
        """
        if self.num_tokens and int(self.tokens.max()) >= vocab_size:
            raise ValueError(
                f"the suffix index holds token id {int(self.tokens.max())}, outside the target's vocabulary of "
                f"{vocab_size}: it was built with another tokenizer; {_FIX} with the target's tokenizer"
            )

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_conversations(cls, tokenizer: Any, conversations: Iterable[dict], **options: Any) -> SuffixIndex:
        """An index over the assistant turns of chat conversations.

        Args:
            tokenizer: the target's tokenizer; each assistant message is ``tokenizer.encode(content,
                add_special_tokens=False)``, the plain encoding of the text the target decodes.
            conversations: ``{"id", "messages": [{"role", "content"}, ...]}`` records (the form of
                :func:`selfspec.train.data.load_conversations`), or ShareGPT's ``{"conversations": [{"from",
                "value"}, ...]}``.
            options: :class:`SuffixIndex` keywords (``min_ngram``, ``max_ngram``, ...).

        Raises:
            ValueError: a record in neither layout (the message says which keys are expected).
        """
        sequences = []
        for i, record in enumerate(conversations):
            for text in _assistant_texts(record, i):
                sequences.append(tokenizer.encode(text, add_special_tokens=False))
        return cls(sequences, **options)

    @classmethod
    def from_jsonl(cls, tokenizer: Any, path: str | os.PathLike, **options: Any) -> SuffixIndex:
        """:meth:`from_conversations` over a JSONL file of conversation records, one per line.

        Raises:
            FileNotFoundError: no such file.
            ValueError: a line that is not a JSON object in one of the two layouts (line number given).
        """
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no such conversations file: {p}")
        records = []
        with p.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{p}:{number} is not JSON ({err}): one conversation record per line") from err
        return cls.from_conversations(tokenizer, records, **options)

    @classmethod
    def open(cls, source: str | os.PathLike | SuffixIndex, tokenizer: Any = None, **options: Any) -> SuffixIndex:
        """An index from what a user passes: an index (returned as is), a saved ``.safetensors`` file
        (:meth:`load`), or a JSONL file of conversations (:meth:`from_jsonl`, which needs ``tokenizer``).

        Raises:
            ValueError: a JSONL source without a tokenizer, or see :meth:`load` / :meth:`from_jsonl`.
        """
        if isinstance(source, SuffixIndex):
            return source
        if str(source).endswith(".safetensors"):
            return cls.load(source, **options)
        if tokenizer is None:
            raise ValueError(
                f"building a suffix index from the conversations in {source} needs the target's tokenizer: "
                "pass tokenizer=..., or a saved index (.safetensors)"
            )
        return cls.from_jsonl(tokenizer, source, **options)

    # ----------------------------------------------------------------------------------------------- files
    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokens`` (int32 ``[T]``) and ``lengths`` (int64) as safetensors, atomically (a temporary
        file in the same directory, renamed into place). Metadata: format, version, n-gram range and a
        SHA-256 of the tensors. Returns the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"tokens": self.tokens.contiguous(), "lengths": self.lengths.contiguous()}
        metadata = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "min_ngram": str(self.min_ngram),
            "max_ngram": str(self.max_ngram),
            "sha256": tensor_digest(tensors),
        }
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, p)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike, *, max_occurrences: int = 256, min_support: int = 1) -> SuffixIndex:
        """Read a file written by :meth:`save`, every part checked before anything is built.

        Args:
            path: the ``.safetensors`` file.
            max_occurrences, min_support: as for :class:`SuffixIndex` (the n-gram range is the saved one).

        Raises:
            ValueError: a missing, truncated or corrupt file, another format or version, wrong tensors
                (names, dtypes, shapes, lengths that do not cover the tokens), or a checksum mismatch;
                the message names the fix.
        """
        p = Path(path)
        metadata, tensors = open_safetensors(p, _FIX, "suffix index", ValueError)
        bad = f"{p} is not a selfspec suffix index of format version {FORMAT_VERSION}"
        if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
            found = f"{metadata.get('format')!r} version {metadata.get('format_version')!r}"
            raise ValueError(f"{bad} (found format {found}); {_FIX}")
        if set(tensors) != {"tokens", "lengths"}:
            raise ValueError(f"{bad}: expected tensors ['lengths', 'tokens'], found {sorted(tensors)}; {_FIX}")
        tokens, lengths = tensors["tokens"], tensors["lengths"]
        if tokens.dtype != torch.int32 or tokens.dim() != 1 or lengths.dtype != torch.int64 or lengths.dim() != 1:
            raise ValueError(f"{bad}: tokens must be int32 [T] and lengths int64 [sequences]; {_FIX}")
        if metadata.get("sha256") != tensor_digest(tensors):
            raise ValueError(f"cannot read suffix index {p}: its tensors do not match their checksum (corrupt); {_FIX}")
        if (lengths.numel() and int(lengths.min()) < 1) or int(lengths.sum()) != tokens.numel():
            raise ValueError(f"{bad}: the lengths do not cover the tokens; {_FIX}")
        try:
            min_ngram, max_ngram = int(metadata["min_ngram"]), int(metadata["max_ngram"])
        except (KeyError, ValueError) as err:
            raise ValueError(f"{bad}: no n-gram range in its metadata; {_FIX}") from err
        index = cls.__new__(cls)
        index._setup(tokens.to(torch.int64), lengths, min_ngram, max_ngram, max_occurrences, min_support)
        return index


def _assistant_texts(record: Any, number: int) -> list[str]:
    """The assistant messages of one conversation record, in order."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        turns = [(m.get("role"), m.get("content")) for m in record["messages"] if isinstance(m, dict)]
    elif isinstance(record, dict) and isinstance(record.get("conversations"), list):
        turns = [(m.get("from"), m.get("value")) for m in record["conversations"] if isinstance(m, dict)]
    else:
        raise ValueError(
            f"conversation record {number} has neither a 'messages' list of {{'role', 'content'}} turns nor a "
            "'conversations' list of {'from', 'value'} turns"
        )
    return [text for role, text in turns if role in _ASSISTANT_ROLES and isinstance(text, str) and text]
