"""When a decode stops: EOS ids, stop strings and ``max_new_tokens``, checked one accepted token at a time, so
the output ends exactly where plain ``generate`` would end it, whatever number of tokens a step accepted."""

from __future__ import annotations

from collections.abc import Sequence


class Stopper:
    """Exact stopping: EOS ids, stop strings and ``max_new_tokens``, checked token by token.

    Args:
        eos_ids: token ids that end the output right after they are produced.
        stop_strings: texts that end the output at the token that completes one of them.
        tokenizer: decodes the output's tail for ``stop_strings`` (needed only with them).
        max_new_tokens: hard cap on the output's length.

    Raises:
        ValueError: ``stop_strings`` without a tokenizer.
    """

    def __init__(self, eos_ids: Sequence[int], stop_strings: Sequence[str], tokenizer, max_new_tokens: int) -> None:
        self.eos = set(int(e) for e in eos_ids)
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer=... to generate")
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self._window = max((len(s) for s in self.stop_strings), default=0)

    def push(self, out: list[int], new: list[int]) -> str | None:
        """Append ``new`` to ``out`` one token at a time; return a finish reason as soon as one holds."""
        for tok in new:
            if len(out) >= self.max_new_tokens:
                return "length"
            out.append(tok)
            if tok in self.eos:
                return "stop"
            if self.stop_strings:
                # Decode only the tail: enough tokens to hold the longest stop string plus this token.
                tail_text = self.tokenizer.decode(out[-(self._window + 1) :], skip_special_tokens=False)
                prev_text = self.tokenizer.decode(out[-(self._window + 1) : -1], skip_special_tokens=False)
                for s in self.stop_strings:
                    if s in tail_text and not (s in prev_text and len(out) > 1):
                        return "stop"
        return "length" if len(out) >= self.max_new_tokens else None
