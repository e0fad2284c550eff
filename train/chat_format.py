"""How a run renders chats: a chat-template override, the template's keyword arguments, and what becomes of reasoning.

Three settings of :class:`~selfspec.train.config.TrainConfig` act here, and they act on every rendering of the run
alike (the prompts self-distillation answers, the conversations the heads train on and their loss masks, the
calibration prompts), because they are bound into the tokenizer once (:func:`bind_chat_format`) rather than passed
to each call:

* ``chat_template: FILE``: a Jinja chat template that replaces the target's own;
* ``chat_template_kwargs``: template variables such as ``enable_thinking: false`` (Qwen3), written into the bound
  template as top-level ``{% set %}`` statements, so every ``apply_chat_template`` call renders with them;
* ``reasoning: keep | drop`` (:func:`apply_reasoning`, :func:`answer_message`): a reasoning trace, written in a
  message's ``reasoning_content`` or inline as a ``<think> ... </think>`` span, is kept (rendered where the template
  renders it, and in the loss mask, :mod:`selfspec.train.chat_tokens`) or dropped from the data and from the
  target's regenerated answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the thinking span of Qwen3 / DeepSeek-R1 style templates
REASONING = ("keep", "drop")
_THINK_SPAN = re.compile(re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE) + r"\s*", re.DOTALL)
_PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
_MARKER = "\ue001"  # a private-use character: no template writes it


def read_chat_template(path: str | Path) -> str:
    """The text of a chat-template file, parsed once as Jinja.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a Jinja template (the parser's message, with its line).
    """
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no such chat_template file: {file}")
    text = file.read_text(encoding="utf-8-sig")  # a byte-order mark would reach every prompt
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"chat_template {file} is not a Jinja template (line {err.lineno}: {err.message})") from err
    return text


def _literal(value: Any, where: str) -> str:
    """``value`` as a Jinja literal (JSON scalars, lists and mappings of them)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_literal(v, where) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_literal(v, where)}" for k, v in value.items()) + "}"
    raise ValueError(f"{where} must hold JSON values (numbers, strings, booleans, lists, mappings), got {value!r}")


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse ``chat_template_kwargs`` that cannot be template variables.

    Raises:
        ValueError: a name that is not an identifier, or a value that is not JSON-like.
    """
    for name, value in kwargs.items():
        if not str(name).isidentifier():
            raise ValueError(f"chat_template_kwargs names template variables; {name!r} is not an identifier")
        _literal(value, f"chat_template_kwargs.{name}")


def bound_template(template: str, kwargs: Mapping[str, Any]) -> str:
    """``template`` with ``kwargs`` set as top-level variables (``{%- set enable_thinking = false -%}``), which take
    precedence over the same names passed to ``apply_chat_template``."""
    check_template_kwargs(kwargs)
    head = "".join(f"{{%- set {k} = {_literal(v, k)} -%}}" for k, v in kwargs.items())
    return head + template


def bind_chat_format(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None, kwargs: Mapping[str, Any] | None
) -> PreTrainedTokenizerBase:
    """Set a run's chat template on ``tokenizer`` (in place) and check that it renders.

    Args:
        tokenizer: the target's tokenizer.
        chat_template: a template file (``TrainConfig.chat_template``) replacing the tokenizer's own; None: its own.
        kwargs: template variables (``TrainConfig.chat_template_kwargs``) bound into it (:func:`bound_template`).
            Nothing changes when neither is set.

    Returns:
        ``tokenizer`` itself.

    Raises:
        FileNotFoundError / ValueError: the file is missing or not Jinja (:func:`read_chat_template`), the tokenizer
            has no template to bind the kwargs into, or the bound template does not render a user / assistant
            exchange (the template's own error in the message).
    """
    if chat_template is None and not kwargs:
        return tokenizer
    template = read_chat_template(chat_template) if chat_template is not None else tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ValueError("chat_template_kwargs need a chat template: the target has none; set chat_template: FILE")
    tokenizer.chat_template = bound_template(template, kwargs or {})
    source = chat_template or "the target's chat template"
    try:
        tokenizer.apply_chat_template(_PROBE, tokenize=False)
        tokenizer.apply_chat_template(_PROBE[:1], tokenize=False, add_generation_prompt=True)
    except Exception as err:  # a template raises anything (jinja2 errors, raise_exception, type errors)
        raise ValueError(
            f"{source} does not render a user / assistant exchange with chat_template_kwargs {dict(kwargs or {})} "
            f"({type(err).__name__}: {err}): fix the template or the kwargs"
        ) from err
    return tokenizer


def strip_thinking(text: str) -> str:
    """``text`` without its ``<think> ... </think>`` spans (and the blanks after each); an unclosed span from its
    opening tag on (an answer cut at the length cap while thinking)."""
    text = _THINK_SPAN.sub("", text)
    cut = text.find(THINK_OPEN)
    return (text[:cut] if cut >= 0 else text).strip()


def apply_reasoning(conversations: Sequence[dict], reasoning: str) -> list[dict]:
    """Conversations as the run trains on them: with ``"keep"`` unchanged; with ``"drop"`` every message's
    ``reasoning_content`` removed and the thinking spans of assistant contents stripped (:func:`strip_thinking`).

    Raises:
        ValueError: ``reasoning`` not in :data:`REASONING`.
    """
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {REASONING}, got {reasoning!r}")
    if reasoning == "keep":
        return list(conversations)
    out = []
    for conv in conversations:
        messages = []
        for m in conv["messages"]:
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            if m["role"] == "assistant":
                m["content"] = strip_thinking(m["content"])
            messages.append(m)
        out.append({**conv, "messages": messages})
    return out


def renders_reasoning(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's template writes an assistant message's ``reasoning_content`` (rendered once with a
    marker in that field; a template that fails on it does not)."""
    probe = [_PROBE[0], {"role": "assistant", "content": "hello", "reasoning_content": _MARKER}]
    try:
        return _MARKER in tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template raises anything (jinja2 errors, raise_exception)
        return False


def split_reasoning(message: Mapping[str, Any]) -> tuple[str, str]:
    """``(reasoning, content)`` of a message: its ``reasoning_content`` when it has one, else the text inside an
    inline ``<think> ... </think>`` span of its content (the content then being what follows the span); ``("",
    content)`` when it carries no reasoning (an empty span included: the content as written)."""
    content = str(message.get("content") or "")
    field = message.get("reasoning_content")
    if isinstance(field, str) and field.strip():
        return field, content
    if THINK_CLOSE in content:
        before, after = content.split(THINK_CLOSE, 1)
        thought = before.split(THINK_OPEN, 1)[-1].strip()
        if thought:
            return thought, after.strip()
    return "", content


def answer_message(tokenizer: PreTrainedTokenizerBase, answer: str, reasoning: str) -> dict:
    """The assistant message of a regenerated ``answer`` (decoded text).

    With ``"drop"`` its thinking spans are stripped. With ``"keep"``, an answer holding a closed ``<think> ...
    </think>`` span becomes ``{"reasoning_content", "content"}`` when the tokenizer's template renders
    ``reasoning_content`` (as Qwen3's does, so the rendered turn is the template's own layout), else it stays as
    written. An answer without a span is ``{"role": "assistant", "content": answer}`` either way.
    """
    if reasoning == "drop":
        return {"role": "assistant", "content": strip_thinking(answer)}
    thought, content = split_reasoning({"content": answer})
    if not thought or not renders_reasoning(tokenizer):
        return {"role": "assistant", "content": answer}
    return {"role": "assistant", "content": content, "reasoning_content": thought}
