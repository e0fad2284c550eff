"""Continuations from what was served: an n-gram index over the outputs of earlier requests.

Users serve one model on one kind of work, and answers to one kind of work repeat each other (the layout of a
worked solution, code idioms, boilerplate, the answer to a question asked again). SuffixDecoding (Oliaro et al.
2024, arXiv:2411.04975; Arctic Inference ships it in vLLM) drafts from a suffix tree over earlier outputs and
reaches up to 5.3x on repetitive agentic work. :class:`ServedHistory` is that source for selfspec's hybrid drafter
(:class:`~selfspec.decode.drafters.hybrid.HybridDrafter`), where it sits beside the prompt's own n-grams and the
head, each budgeted by the acceptance it shows:

* every finished output is added (:meth:`ServedHistory.add`); the prompt is not (prompt lookup covers the current
  one), so memory follows what the target wrote;
* lookups are those of a :class:`~selfspec.decode.drafters.suffix_index.SuffixIndex` over the outputs held (the
  longest matching suffix n-gram, then the most frequent path), rebuilt on the first lookup after a change (one
  sort per n-gram size: milliseconds for tens of thousands of tokens, once per request);
* memory is bounded by ``max_tokens``: when an output would pass it, the least-used outputs go first (fewest
  lookups that drew on them, then the longest unused), so what keeps paying stays.

Served text stays in the process: the history is never written anywhere unless the caller saves its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.decode.drafters.suffix_index import SuffixIndex

BYTES_PER_TOKEN = 8 + 16 * 5
"""About what one held token costs: the corpus (int32 and int64 copies, the sequence-end table) plus a hash and a
start per n-gram size (5 sizes by default)."""


class ServedHistory:
    """An n-gram continuation source over served outputs, bounded in tokens, least-used evicted (module docstring).

    Args:
        max_tokens: the most output tokens held (memory about :data:`BYTES_PER_TOKEN` each, ~5.8 MB at the
            default 65,536).
        min_ngram, max_ngram, min_support, max_occurrences: the index's matching (see
            :class:`~selfspec.decode.drafters.suffix_index.SuffixIndex`).

    Raises:
        ValueError: ``max_tokens < 1`` or invalid matching options.
    """

    def __init__(
        self,
        max_tokens: int = 65_536,
        *,
        min_ngram: int = 2,
        max_ngram: int = 6,
        min_support: int = 1,
        max_occurrences: int = 256,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._options = {
            "min_ngram": min_ngram,
            "max_ngram": max_ngram,
            "min_support": min_support,
            "max_occurrences": max_occurrences,
        }
        SuffixIndex([], **self._options)  # the options, checked now
        self._outputs: list[list[int]] = []
        self._uses: list[int] = []  # lookups whose match drew on each output
        self._stamp: list[int] = []  # the clock at each output's last add or use
        self._clock = 0
        self._held = 0
        self._index: SuffixIndex | None = None
        self.evicted = 0

    @property
    def num_tokens(self) -> int:
        """Output tokens held."""
        return self._held

    @property
    def num_outputs(self) -> int:
        """Outputs held."""
        return len(self._outputs)

    def __repr__(self) -> str:
        return f"ServedHistory({self.num_outputs} outputs, {self.num_tokens} of {self.max_tokens} tokens)"

    def add(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """Hold one served output (token ids); outputs longer than ``max_tokens`` keep their last ``max_tokens``.

        Raises:
            ValueError: a negative token id.
        """
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        if not ids:
            return
        if min(ids) < 0:
            raise ValueError("token ids must be >= 0")
        ids = ids[-self.max_tokens :]
        while self._held + len(ids) > self.max_tokens:
            self._evict()
        self._clock += 1
        self._outputs.append(ids)
        self._uses.append(0)
        self._stamp.append(self._clock)
        self._held += len(ids)
        self._index = None

    def _evict(self) -> None:
        """Drop the least-used output (fewest uses, then the oldest last use)."""
        i = min(range(len(self._outputs)), key=lambda k: (self._uses[k], self._stamp[k]))
        self._held -= len(self._outputs[i])
        for held in (self._outputs, self._uses, self._stamp):
            del held[i]
        self.evicted += 1
        self._index = None

    def lookup(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """The continuation of the context's longest suffix n-gram found in the served outputs (the
        :meth:`SuffixIndex.lookup <selfspec.decode.drafters.suffix_index.SuffixIndex.lookup>` contract); the outputs
        the match drew on count one use each."""
        if not self._outputs:
            return [], 0
        if self._index is None:
            self._index = SuffixIndex(self._outputs, **self._options)
        tokens, n, sources = self._index.match(context, max_tokens)
        if tokens:
            self._clock += 1
            for i in sources:
                self._uses[i] += 1
                self._stamp[i] = self._clock
        return tokens, n

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse outputs holding ids outside the target's vocabulary (a history kept from another target).

        Raises:
            ValueError: an id ``>= vocab_size``.
        """
        top = max((max(o) for o in self._outputs), default=-1)
        if top >= vocab_size:
            raise ValueError(
                f"the served history holds token id {top}, outside the target's vocabulary of {vocab_size}: it was "
                "served by another target; start a new ServedHistory"
            )
