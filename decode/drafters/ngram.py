"""The one n-gram search of the context, shared by prompt lookup and the hybrid drafter.

Prompt lookup decoding (Saxena 2023): where the context's last n tokens occurred before, the tokens that
followed them there are a draft of what follows now. Longer matches are tried first; among the matches of
one length the latest wins when it is followed by a whole draft, else the one followed by the most tokens (a
match that overlaps the end of a repetition is followed by only a token or two).
"""

from __future__ import annotations

from collections.abc import Sequence


def lookup_chain(context: Sequence[int], max_ngram: int, min_ngram: int, max_tokens: int) -> tuple[list[int], int]:
    """The continuation of an earlier occurrence of the context's last n-gram (see the module docstring).

    Args:
        context: the token ids so far (the root last).
        max_ngram, min_ngram: the match lengths tried, longest first (``1 <= min_ngram <= max_ngram``).
        max_tokens: the longest continuation returned (0 returns no match).

    Returns:
        ``(tokens, n)``: up to ``max_tokens`` ids and the length of the match they follow; ``([], 0)`` when
        nothing matches.
    """
    if max_tokens <= 0:
        return [], 0
    context = list(context)
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        best: list[int] = []
        for start in range(len(context) - n - 1, -1, -1):  # latest match first
            if context[start : start + n] == tail:
                chain = context[start + n : start + n + max_tokens]
                if len(chain) > len(best):
                    best = chain
                if len(best) == max_tokens:
                    break
        if best:
            return best, n
    return [], 0
