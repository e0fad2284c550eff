"""Target features captured during self-distillation, so the feature pass skips the conversations it regenerated.

Self-distillation (:func:`~selfspec.train.features.self_distill`) runs the frozen target over every token of a
regenerated conversation but one: the prefill over the prompt, then one decode step per answer token. The
feature pass (:func:`~selfspec.train.features.hidden_features`) then ran the same target over the same tokens
again. Here generation keeps the hidden states it computes (:func:`recorded_features`) and feeds
the chat template's end-of-turn tokens after the answer (:class:`TailForcer`), which ``generate`` would never
feed, so every token of the rendered conversation gets its state in the one pass.

The captured states are the feature pass's up to float rounding: left padding with an attention mask and a
KV cache change the order of the sums, not what is summed (``tests/train/test_distill_states.py``: 1e-5 on
tiny fp32 targets of several families, sliding-window layers included). A capture is used only when the
training example's token ids equal the captured ids (:meth:`CapturedStates.take`); any other conversation,
e.g. one whose decoded and stripped answer tokenizes differently, falls back to the feature pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from transformers import LogitsProcessor, StoppingCriteria

from selfspec.decode.kv import backbone

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_MARKER = "\ue000"  # a private-use character: no chat template writes it


@dataclass(frozen=True)
class Capture:
    """One regenerated conversation's tokens and target features.

    Attributes:
        input_ids: LongTensor ``[T]``: prompt, answer and the template's end-of-turn tokens, as generation fed them.
        features: ``[T, F]`` in the target's dtype, on CPU; the layout of
            :func:`~selfspec.train.features.hidden_features` with the same ``layers``.
    """

    input_ids: torch.Tensor
    features: torch.Tensor


class CapturedStates:
    """Features captured during self-distillation, keyed by conversation id, within a memory budget.

    Args:
        layers: the decoder layers whose input states come first (EAGLE-3), or None for the last hidden state
            alone; the same argument as :func:`~selfspec.train.features.hidden_features`'.
        max_bytes: capture stops (the next batches generate as before) once the held features reach this size.

    Raises:
        ValueError: ``max_bytes`` < 0.
    """

    def __init__(self, layers: Sequence[int] | None, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.layers = tuple(layers) if layers else None
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._entries: dict[str, Capture] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def has_room(self) -> bool:
        """Whether another batch may be captured (the held bytes are under ``max_bytes``)."""
        return self.nbytes < self.max_bytes

    def add(self, conv_id: str, input_ids: torch.Tensor, features: torch.Tensor) -> None:
        """Hold ``features`` ``[T, F]`` for ``input_ids`` ``[T]`` of conversation ``conv_id`` (replacing any earlier).

        Raises:
            ValueError: the lengths differ.
        """
        if input_ids.shape[0] != features.shape[0]:
            raise ValueError(f"{input_ids.shape[0]} tokens but {features.shape[0]} feature rows for {conv_id!r}")
        old = self._entries.pop(conv_id, None)
        if old is not None:
            self.nbytes -= old.features.nbytes
        self._entries[conv_id] = Capture(input_ids, features)
        self.nbytes += features.nbytes

    def take(self, example: dict, layers: Sequence[int] | None) -> torch.Tensor | None:
        """The features of ``example`` (``{"id", "input_ids": LongTensor [T]}``) if they were captured, removed
        from the store; None when the conversation was not captured, when its training tokens are not a prefix
        of the tokens generation fed (a template or tokenizer that renders the answer otherwise), or when
        ``layers`` are not the captured ones.

        Returns:
            ``[T, F]`` (the first T captured rows: a conversation truncated for training keeps its prefix).
        """
        if (tuple(layers) if layers else None) != self.layers:
            return None
        entry = self._entries.pop(example["id"], None)
        if entry is None:
            return None
        self.nbytes -= entry.features.nbytes
        ids = example["input_ids"]
        n = int(ids.numel())
        if entry.input_ids.numel() < n or not torch.equal(entry.input_ids[:n], ids.to(entry.input_ids.device)):
            return None
        return entry.features[:n]

    def clear(self) -> None:
        """Drop every held capture."""
        self._entries.clear()
        self.nbytes = 0


def template_tail(tokenizer: PreTrainedTokenizerBase, messages: list[dict], prompt_text: str) -> list[int]:
    """The token ids the chat template writes after an assistant answer (e.g. SmolLM2's ``<|im_end|>``, ``\\n``).

    Renders ``messages`` plus an assistant turn holding a marker character, and tokenizes what follows the marker.

    Args:
        messages: the prompt messages (up to the first assistant turn).
        prompt_text: those messages rendered with ``add_generation_prompt=True``.

    Returns:
        The tail's ids; ``[]`` when the rendered conversation does not start with ``prompt_text`` (a template that
        rewrites the prompt once an answer follows) or drops the marker: such a conversation is not captured.
    """
    full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": _MARKER}], tokenize=False)
    if not full.startswith(prompt_text) or full.count(_MARKER) != 1:
        return []
    return list(tokenizer(full.split(_MARKER, 1)[1], add_special_tokens=False)["input_ids"])


class TailForcer(LogitsProcessor):
    """Greedy ``generate`` that, where it would stop, feeds the chat template's end-of-turn tokens instead.

    As a logits processor (after ``generate``'s own processors, which see the same inputs as without it): row r's
    answer ends at the first step whose greedy token is one of ``eos_ids``, or after ``max_answer_tokens`` tokens,
    exactly where greedy ``generate`` with EOS stopping ends it; from then on the row's scores force ``tails[r]``
    token by token. Row r is done (:meth:`done`, :class:`TailDone`) once the last tail token has been fed (one
    step after it was forced), so its hidden state has been computed. ``generate`` must run greedy, without EOS
    stopping (``eos_token_id=[]``: None would mean the model's own), and with ``max_new_tokens`` at least
    ``max_answer_tokens + max(len(tail)) + 1``.

    Args:
        prompt_width: the padded prompt length P of the batch.
        eos_ids: the target's end-of-sequence ids.
        tails: per row, the tokens to feed after its answer (:func:`template_tail`).
        max_answer_tokens: the answer length cap.

    Attributes:
        answer_tokens: per row, the answer's length once ended (None before).
        stopped_by: per row, the EOS id greedy decoding chose where the answer ended (None: ended at the cap, or
            not yet).
    """

    def __init__(
        self, prompt_width: int, eos_ids: Sequence[int], tails: Sequence[Sequence[int]], max_answer_tokens: int
    ) -> None:
        self.prompt_width = prompt_width
        self.eos_ids = set(int(i) for i in eos_ids)
        self.tails = [list(t) for t in tails]
        self.max_answer_tokens = max_answer_tokens
        self.answer_tokens: list[int | None] = [None] * len(self.tails)
        self.stopped_by: list[int | None] = [None] * len(self.tails)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Scores ``[B, V]`` with each ended row's next tail token forced (every other score -inf)."""
        step = input_ids.shape[1] - self.prompt_width  # tokens generated so far
        greedy = scores.argmax(dim=-1).tolist()
        for r, tail in enumerate(self.tails):
            if self.answer_tokens[r] is None and (step >= self.max_answer_tokens or greedy[r] in self.eos_ids):
                self.answer_tokens[r] = step
                self.stopped_by[r] = greedy[r] if greedy[r] in self.eos_ids else None
            end = self.answer_tokens[r]
            if end is not None and step - end < len(tail):
                scores[r] = float("-inf")
                scores[r, tail[step - end]] = 0.0
        return scores

    def done(self, step: int, device: torch.device) -> torch.Tensor:
        """BoolTensor ``[B]``: rows whose whole tail has been fed."""
        flags = [
            end is not None and step >= end + len(t) + 1 for end, t in zip(self.answer_tokens, self.tails, strict=True)
        ]
        return torch.tensor(flags, dtype=torch.bool, device=device)


class TailDone(StoppingCriteria):
    """The stopping side of a :class:`TailForcer` (``generate`` calls stopping criteria with the sequences only)."""

    def __init__(self, forcer: TailForcer) -> None:
        self.forcer = forcer

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None = None, **kwargs) -> torch.Tensor:  # type: ignore[override]
        return self.forcer.done(input_ids.shape[1] - self.forcer.prompt_width, input_ids.device)


@contextmanager
def recorded_features(model: PreTrainedModel, layers: Sequence[int] | None) -> Iterator[list[torch.Tensor]]:
    """Record the features of every forward of ``model`` while the context is open (forward hooks).

    The hooks keep only what the features need: the hidden states entering decoder layers ``layers`` (a pre-hook
    on ``backbone.layers[i]``; ``transformers``' ``hidden_states[i]``) and the backbone's ``last_hidden_state``
    (after the final norm). ``generate(output_hidden_states=True)`` would hold every layer's states of the whole
    batch until it returns, which on the development CPU slowed self-distillation by about 15 %.

    Yields:
        A list that gets, per forward, one tensor ``[B, t, F]`` (``layers``' states, then the last hidden state;
        :func:`~selfspec.train.features.hidden_features`' layout), in the model dtype, on the model's device.

    Raises:
        ValueError: ``layers`` outside ``[0, L)``, or a target whose backbone has no ``layers`` list.
    """
    net = backbone(model)
    blocks = getattr(net, "layers", None)
    taken = list(layers or ())
    if taken and blocks is None:
        raise ValueError(f"{type(net).__name__} has no `layers` list: capture its features with layers=None")
    if taken and any(not 0 <= i < len(blocks) for i in taken):
        raise ValueError(f"layers must lie in [0, {len(blocks)}), got {taken}")
    entering: dict[int, torch.Tensor] = {}
    steps: list[torch.Tensor] = []

    def before(i: int, module, args, kwargs) -> None:
        entering[i] = args[0] if args else kwargs["hidden_states"]

    def after(module, args, kwargs, output) -> None:
        steps.append(torch.cat([*(entering[i] for i in taken), output.last_hidden_state], dim=-1))
        entering.clear()

    # one hook a layer: a layer may be taken twice (EAGLE-3's default layers of a 2-layer target)
    handles = [blocks[i].register_forward_pre_hook(partial(before, i), with_kwargs=True) for i in sorted(set(taken))]
    handles.append(net.register_forward_hook(after, with_kwargs=True))
    try:
        yield steps
    finally:
        for h in handles:
            h.remove()
