"""Conversations rendered with the target tokenizer's own chat template, with the assistant tokens that
the draft heads learn from marked (``loss_mask``).

:func:`tokenize_conversation` finds each assistant message in the rendered text by rendering growing
prefixes of the conversation (or, when a template rewrites earlier turns, by searching for the message
text) and maps those character spans to tokens with the tokenizer's offsets;
:func:`build_training_examples` does it for a list of conversations (:func:`selfspec.train.data.
load_conversations`), dropping those left without assistant tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from selfspec.train.chat_format import THINK_OPEN, split_reasoning
from selfspec.train.data import Message

logger = logging.getLogger(__name__)


class ChatTemplateMismatchError(ValueError):
    """Raised when the assistant messages cannot be located in a conversation rendered by its chat template."""


def _render(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _special_strings(tokenizer) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return sorted((s for s in specials if s), key=len, reverse=True)  # longest match first


def _end_of_turn(text: str, end: int, limit: int, specials: list[str]) -> int:
    """End of the special token (e.g. ``<|im_end|>``) that directly follows an assistant content, if any."""
    for special in specials:
        if text.startswith(special, end) and end + len(special) <= limit:
            return end + len(special)
    return end


def _find_content(text: str, content: str, start: int, stop: int) -> tuple[int, int] | None:
    # Templates may trim the content (Llama 3's `| trim`): try it as is, then stripped.
    for candidate in (content, content.strip()):
        found = text.find(candidate, start, stop)
        if found >= 0:
            return found, found + len(candidate)
    return None


def _reasoning_start(text: str, reasoning: str, lo: int, content_start: int) -> int:
    """Where a kept reasoning trace starts in ``text[lo:content_start]``: at the thinking tag before it (``<think>``,
    which the target writes too), else at the trace; ``content_start`` when the template did not render it."""
    found = text.find(reasoning.strip(), lo, content_start)
    if found < 0:
        return content_start
    tag = text.rfind(THINK_OPEN, lo, found)
    return tag if tag >= 0 else found


def _spans_by_prefix(
    tokenizer, messages: Sequence[Message], text: str, specials: list[str]
) -> list[tuple[int, int]] | None:
    """Assistant character spans found by rendering the conversation prefix by prefix.

    The assistant message i lies between the render of ``messages[:i]`` with the generation prompt and the
    render of ``messages[:i + 1]``. Returns ``None`` when some prefix render is not a prefix of the full
    text (templates that render earlier turns differently once later ones exist).
    """
    from jinja2 import TemplateError

    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            before = _render(tokenizer, messages[:i], add_generation_prompt=True)
            if not text.startswith(before):
                before = _render(tokenizer, messages[:i])
            through = _render(tokenizer, messages[: i + 1])
        except TemplateError:
            return None
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            return None
        reasoning, content = split_reasoning(message)
        found = _find_content(text, content, len(before), len(through))
        if found is None:
            return None
        start = _reasoning_start(text, reasoning, len(before), found[0]) if reasoning else found[0]
        spans.append((start, _end_of_turn(text, found[1], len(through), specials)))
    return spans


def _assistant_header(tokenizer, messages: Sequence[Message], i: int) -> str:
    """The text the generation prompt adds before assistant message i (``<|im_start|>assistant\n``), or ''."""
    from jinja2 import TemplateError

    try:
        plain = _render(tokenizer, messages[:i])
        prompted = _render(tokenizer, messages[:i], add_generation_prompt=True)
    except TemplateError:
        return ""
    return prompted[len(plain) :] if prompted.startswith(plain) else ""


def _spans_by_search(tokenizer, messages: Sequence[Message], text: str, specials: list[str]) -> list[tuple[int, int]]:
    """Assistant character spans found by searching each message's content in order through the full text.

    Before an assistant message the cursor first skips its role header, so a content equal to the role
    name (or to a substring of the header) is not matched inside the header.
    """
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            header = _assistant_header(tokenizer, messages, i)
            found_header = text.find(header, cursor) if header else -1
            if found_header >= 0:
                cursor = found_header + len(header)
        reasoning, content = split_reasoning(message) if message["role"] == "assistant" else ("", message["content"])
        found = _find_content(text, content, cursor, len(text))
        if found is None:
            if message["role"] == "assistant":
                raise ChatTemplateMismatchError(f"cannot find assistant message {i} in the rendered chat template")
            continue  # the template rewrote a system / user message; it is not trained on anyway
        end = found[1]
        if message["role"] == "assistant":
            end = _end_of_turn(text, end, len(text), specials)
            spans.append((_reasoning_start(text, reasoning, cursor, found[0]) if reasoning else found[0], end))
        cursor = end
    return spans


def tokenize_conversation(tokenizer, messages: Sequence[Message], max_length: int) -> dict[str, torch.Tensor]:
    """Tokenize a conversation with the tokenizer's own chat template and mark the assistant tokens.

    Works with any template, with or without ``{% generation %}`` markers: the conversation is tokenized
    by ``apply_chat_template`` itself, with character offsets (fast tokenizers); the character span of each
    assistant message is located by rendering the conversation prefix by prefix (falling back to an
    in-order search of each message's content when the template renders earlier turns differently); a token
    belongs to the loss when any of its characters lies in such a span. A token that straddles the start of a
    content also carries template text: ``"assistant: Hi"`` tokenizes to ``" Hi"``, and in ChatML a content
    that opens with blanks merges them with the header's newline (``"\n "``); such tokens count as assistant
    tokens, so the masked tokens decode to the contents exactly unless a content starts at such a merge.

    A kept reasoning trace (a ``reasoning_content`` the template renders, or an inline ``<think> ... </think>``
    span, :func:`selfspec.train.chat_format.split_reasoning`) is in the span too, from its thinking tag on: the target
    writes it before the answer. A trace the template leaves out (earlier turns, in Qwen3's) is not.

    The span of an assistant message is its content plus the special token that directly follows it in the
    rendered text, i.e. the end-of-turn token (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama 3): the
    draft must learn to predict where the target stops. The role header before the content
    (``<|im_start|>assistant\\n``) and the newline after ``<|im_end|>`` are template tokens, not loss tokens.

    Args:
        tokenizer: a fast Hugging Face tokenizer with a ``chat_template``.
        messages: ``[{"role", "content"}, ...]`` with roles ``system`` / ``user`` / ``assistant``.
        max_length: keep the first ``max_length`` tokens (right truncation).

    Returns:
        ``{"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}`` with ``T <= max_length``.
        ``loss_mask[t]`` is True when token ``t`` is an assistant token (a label to be predicted from
        position ``t - 1``); ``input_ids`` equal ``apply_chat_template(messages, tokenize=True)`` truncated.

    Raises:
        ValueError: ``max_length < 1``, the tokenizer has no chat template or is not a fast tokenizer.
        ChatTemplateMismatchError: the offsets do not fit the rendered text (a non-deterministic template)
            or an assistant message cannot be located in it.
        jinja2.TemplateError: the template itself rejects the conversation (e.g. non-alternating roles).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat_template: use an instruct/chat target's tokenizer")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("tokenize_conversation needs a fast tokenizer (character offsets): load it with use_fast=True")
    messages = list(messages)
    text = _render(tokenizer, messages)
    # Tokenize through apply_chat_template itself, so the ids are its ids by construction, and ask it for
    # the character offsets into the same rendered text.
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, tokenizer_kwargs={"return_offsets_mapping": True}
    )
    ids = list(encoded["input_ids"])
    offsets = encoded["offset_mapping"]
    last_end = offsets[-1][1] if offsets else 0
    if len(offsets) != len(ids) or last_end > len(text):
        raise ChatTemplateMismatchError(
            f"apply_chat_template offsets ({len(offsets)} tokens, ending at character {last_end}) do not fit "
            f"the rendered text ({len(text)} characters): is the template deterministic?"
        )
    specials = _special_strings(tokenizer)
    spans = _spans_by_prefix(tokenizer, messages, text, specials)
    if spans is None:
        spans = _spans_by_search(tokenizer, messages, text, specials)
    bounds = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)  # (T, 2) character [start, end)
    loss_mask = torch.zeros(len(ids), dtype=torch.bool)
    for span_start, span_end in spans:
        loss_mask |= (bounds[:, 0] < span_end) & (bounds[:, 1] > span_start)
    return {
        "input_ids": torch.tensor(ids[:max_length], dtype=torch.long),
        "loss_mask": loss_mask[:max_length],
    }


def build_training_examples(
    tokenizer, conversations: Iterable[dict], max_length: int, min_assistant_tokens: int = 1
) -> list[dict]:
    """Tokenize conversations for training, dropping those with too few loss tokens after truncation.

    Args:
        tokenizer: see :func:`tokenize_conversation`.
        conversations: normalised conversations (:func:`load_conversations`).
        max_length: tokens kept per conversation (right truncation).
        min_assistant_tokens: drop an example whose ``loss_mask`` has fewer True entries.

    Returns:
        ``[{"id": str, "input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}, ...]``. Conversations the
        chat template rejects (``jinja2.TemplateError``, e.g. roles that do not alternate) are skipped;
        the numbers dropped are logged.

    Raises:
        ValueError / ChatTemplateMismatchError: as :func:`tokenize_conversation`.
    """
    from jinja2 import TemplateError

    examples: list[dict] = []
    rejected = too_short = 0
    for conversation in conversations:
        try:
            example = tokenize_conversation(tokenizer, conversation["messages"], max_length)
        except TemplateError:
            rejected += 1
            continue
        if int(example["loss_mask"].sum()) < min_assistant_tokens:
            too_short += 1
            continue
        examples.append({"id": conversation["id"], **example})
    logger.info(
        "built %d training examples (max_length %d); dropped %d with fewer than %d assistant tokens "
        "and %d the chat template rejected",
        len(examples),
        max_length,
        too_short,
        min_assistant_tokens,
        rejected,
    )
    return examples
