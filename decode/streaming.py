"""Text as it is decided: a generation run as a Python iterator of text pieces.

:func:`speculative_generate` feeds any ``transformers`` streamer (``BaseStreamer``: ``put`` / ``end``) the
way ``generate`` does: the prompt first, then each step's accepted tokens, then ``end()``. Only tokens that
are part of the output are sent (stopping is decided token by token before anything is sent, so a stop
string never makes a sent token go back).

:func:`iterate_text` runs a generation in a worker thread with a ``TextIteratorStreamer`` and yields its
text pieces; the streamer holds back text until a word (or a CJK character, or a line) is complete, so a
character spread over several byte-level tokens is never sent half decoded. An error in the worker is
raised in the caller once the pieces before it are consumed. Leaving the loop early (``break``, or the
iterator dropped) stops the generation at its next step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


def iterate_text(
    run: Callable[[Any], Any],
    tokenizer: Any,
    *,
    skip_prompt: bool = True,
    timeout_s: float | None = None,
    **decode_kwargs: Any,
) -> Iterator[str]:
    """Yield the text of a generation as it is decided.

    Args:
        run: starts the generation given a streamer, e.g.
            ``lambda s: model.generate(prompt, streamer=s)``; called once, in a worker thread.
        tokenizer: the target's tokenizer (decodes the tokens).
        skip_prompt: leave the prompt's text out (as ``TextIteratorStreamer(skip_prompt=True)``).
        timeout_s: seconds to wait for the next piece before ``queue.Empty`` is raised (None: no limit).
        decode_kwargs: passed to ``tokenizer.decode`` (e.g. ``skip_special_tokens=True``).

    Yields:
        str pieces; joined, they are the decoding of the new tokens (``tokenizer.decode(tokens,
        **decode_kwargs)``).

    Raises:
        Whatever ``run`` raised, after the pieces sent before the error.
    """
    from transformers import TextIteratorStreamer  # transformers' streamers import the tokenizer machinery

    class Streamer(TextIteratorStreamer):
        cancelled = False

        def put(self, value: Any) -> None:
            if self.cancelled:  # the consumer left: end the generation at this step
                raise _Cancelled
            super().put(value)

    streamer = Streamer(tokenizer, skip_prompt=skip_prompt, timeout=timeout_s, **decode_kwargs)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            run(streamer)
        except _Cancelled:
            pass
        except BaseException as err:  # handed to the consumer below, which re-raises it
            failure.append(err)
            streamer.end()  # wakes the consumer; a second end() after generate's own is harmless

    worker = threading.Thread(target=work, name="selfspec-generate", daemon=True)
    worker.start()
    finished = False
    try:
        yield from streamer
        finished = True
    finally:
        streamer.cancelled = not finished
        worker.join()
    if failure:
        raise failure[0]


class _Cancelled(Exception):
    """Raised inside the worker's generation when the consumer of :func:`iterate_text` has left."""


class _CallbackStreamer:
    """A plain callable as a streamer: called with each step's new token ids (the prompt is not sent)."""

    def __init__(self, fn: Callable[[list[int]], None]) -> None:
        self.fn, self.prompt_sent = fn, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_sent:
            self.prompt_sent = True
            return
        self.fn(value.tolist())

    def end(self) -> None:
        pass


def as_streamer(streamer: Any) -> Any:
    """``streamer`` as an object with ``put`` / ``end``: a ``transformers`` ``BaseStreamer`` as it is, a plain
    callable wrapped (called with each step's new token ids), None as None.

    Raises:
        ValueError: neither a streamer nor a callable.
    """
    if streamer is None:
        return None
    if callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None)):
        return streamer
    if callable(streamer):
        return _CallbackStreamer(streamer)
    raise ValueError(f"streamer must be a transformers BaseStreamer (put / end) or a callable, got {streamer!r}")
