"""Prompts in, token ids out: chat encoding, stop ids and the benchmark prompt sets, in one place.

Every path that turns a prompt into target token ids goes through here, so the api
(:meth:`selfspec.api.SpeculativeModel.encode`), the bench, ``selfspec tune-tree`` and the post-training
calibration render a conversation the same way and stop on the same ids:

* :func:`encode_prompt` / :func:`encode_messages`: token ids, a string or chat messages -> LongTensor ``[T]``.
* :func:`resolve_eos`: the stop ids of a target (generation config, else tokenizer), plus any extra ones
  (:func:`selfspec.base.target.resolve_eos`, the one reader, used by training too).
* :func:`load_prompts`: benchmark questions from an MT-bench / Spec-Bench JSONL file, or the held-out
  ShareGPT split (:func:`heldout_prompts`) of the run that trained the heads, read from
  ``<heads>/training_record.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.errors import MissingFileError, UserError
from selfspec.base.target import resolve_eos

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

SHAREGPT_HELDOUT = "sharegpt-heldout"
TRAINING_RECORD = "training_record.json"
TRAINING_RECORD_FORMAT = "selfspec-training-record"
TRAINING_RECORD_VERSION = 1

__all__ = ["BenchPrompt", "HeldoutSplit", "encode_messages", "encode_prompt", "load_prompts", "resolve_eos"]

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


# --------------------------------------------------------------------------------------------------
# Encoding and stop ids


def encode_messages(tokenizer: Any, messages: Sequence[Message]) -> torch.Tensor:
    """Render chat messages with the tokenizer's own chat template plus the generation prompt.

    Args:
        tokenizer: a ``transformers`` tokenizer (anything with ``apply_chat_template(messages,
            add_generation_prompt=True, return_dict=True)``).
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.

    Returns:
        LongTensor ``[T]``: the template's token ids, ending with the assistant header.
    """
    enc = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_dict=True)
    return torch.tensor(list(enc["input_ids"]), dtype=torch.long)


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


def encode_prompt(tokenizer: Any | None, prompt: Any) -> torch.Tensor:
    """Token ids for a prompt given in any of the forms ``generate`` accepts.

    Args:
        tokenizer: the target's tokenizer; only needed for strings and chat messages (None otherwise).
        prompt: token ids (a list of int, or a LongTensor ``[T]`` or ``[1, T]``); a string (tokenized as is,
            no special tokens added); or chat messages (a non-empty list of ``{"role", "content"}`` dicts,
            rendered by :func:`encode_messages`).

    Returns:
        LongTensor ``[T]`` on the CPU for strings, messages and lists; a tensor prompt keeps its device.

    Raises:
        ValueError: the prompt is empty, or a string / messages come without a tokenizer.
    """
    if isinstance(prompt, torch.Tensor):
        ids = prompt.reshape(-1).to(torch.long)
    elif isinstance(prompt, str) or _is_messages(prompt):
        if tokenizer is None:
            raise ValueError("text and chat prompts need a tokenizer; pass token ids or load with a tokenizer")
        if isinstance(prompt, str):
            ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
        else:
            ids = encode_messages(tokenizer, prompt)
    else:
        ids = torch.tensor(list(prompt), dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    return ids


# --------------------------------------------------------------------------------------------------
# Benchmark prompts


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question.

    Attributes:
        question_id: as in the prompt file (stringified); the conversation id for ShareGPT prompts.
        category: e.g. ``"writing"``; ``"sharegpt"`` for the held-out ShareGPT prompts.
        turns: the user messages, answered one after another.
        preamble: messages placed before the first turn (e.g. a ShareGPT system message).
    """

    question_id: str
    category: str
    turns: tuple[str, ...]
    preamble: tuple[Message, ...] = ()

    def first_turn_messages(self) -> list[Message]:
        """The preamble plus the first user turn: what a single-turn decode is given."""
        return [*self.preamble, {"role": "user", "content": self.turns[0]}]


def load_jsonl_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read an MT-bench / Spec-Bench question file: one JSON object a line with ``question_id``,
    ``category`` and ``turns`` (list of user messages). Other keys (``reference`` ...) are ignored.

    Raises:
        MissingFileError: no such file (a ``FileNotFoundError``).
        UserError: a line is not JSON or lacks ``turns`` (the message names the line), or the file holds no
            prompt (both ``ValueError``).
    """
    layout = "one JSON object a line with 'turns', a list of user messages (MT-bench layout)"
    if not Path(path).is_file():
        raise MissingFileError(f"no such prompt file: {path}: pass a JSONL file of {layout}, or {SHAREGPT_HELDOUT!r}")
    prompts = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{lineno} is not JSON ({err.msg}, column {err.colno}): write {layout}") from err
        turns = record.get("turns") if isinstance(record, dict) else None
        if not turns or not all(isinstance(t, str) for t in turns):
            raise UserError(
                f"{path}:{lineno} needs 'turns': a non-empty list of strings (MT-bench layout: "
                "question_id, category, turns)"
            )
        qid = record.get("question_id", lineno)
        prompts.append(BenchPrompt(str(qid), str(record.get("category", "default")), tuple(turns)))
    if not prompts:
        raise UserError(f"{path} holds no prompts: write {layout}")
    return prompts


@dataclass(frozen=True)
class HeldoutSplit:
    """Which ShareGPT conversations a training run held out.

    Attributes:
        data: the training data source (``"sharegpt"``, a path or a Hub id), as training read it.
        max_conversations: conversations read from ``data`` before the split (None = all).
        eval_fraction, seed: the split's parameters (:func:`selfspec.train.data.split_conversations`).
        heldout_ids: the held-out conversation ids in split order; None = recompute the split from
            ``eval_fraction`` and ``seed`` (heads without a training record).
        origin: where this came from (the record's path, or ``"TrainConfig defaults"``), for messages.
    """

    data: str
    max_conversations: int | None
    eval_fraction: float
    seed: int
    heldout_ids: tuple[str, ...] | None
    origin: str


def read_training_record(head_dir: str | Path) -> HeldoutSplit | None:
    """The held-out split recorded by the run that trained the heads in ``head_dir``
    (``<head_dir>/training_record.json``, written by training), or None when the heads have no record.

    Raises:
        ValueError: the file is not a version-1 ``selfspec-training-record`` or lacks a field read here.
    """
    path = Path(head_dir) / TRAINING_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON: {err}") from err
    if not isinstance(record, dict) or record.get("format") != TRAINING_RECORD_FORMAT:
        raise ValueError(f"{path} is not a training record (expected format {TRAINING_RECORD_FORMAT!r})")
    if record.get("version") != TRAINING_RECORD_VERSION:
        raise ValueError(
            f"{path} has version {record.get('version')!r}; this selfspec reads version {TRAINING_RECORD_VERSION}"
        )
    missing = [k for k in ("data", "max_conversations", "eval_fraction", "seed", "heldout_ids") if k not in record]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    if not isinstance(record["heldout_ids"], list):
        raise ValueError(f"{path}: heldout_ids must be a list of conversation ids")
    return HeldoutSplit(
        data=str(record["data"]),
        max_conversations=record["max_conversations"],
        eval_fraction=float(record["eval_fraction"]),
        seed=int(record["seed"]),
        heldout_ids=tuple(str(i) for i in record["heldout_ids"]),
        origin=str(path),
    )


def _default_split() -> HeldoutSplit:
    # selfspec.train is imported here, not at module top: only the ShareGPT split needs the training
    # package (its config and data readers), and `import selfspec` (the api imports this module) stays
    # free of it.
    from selfspec.train.config import TrainConfig

    cfg = TrainConfig()
    return HeldoutSplit(cfg.data, cfg.max_conversations, cfg.eval_fraction, cfg.seed, None, "TrainConfig defaults")


def heldout_split(head_dir: str | Path | None) -> HeldoutSplit:
    """The held-out split of the heads in ``head_dir``: from their training record; for heads without
    one (trained before records existed), and for ``head_dir=None``, the split of
    :class:`~selfspec.train.config.TrainConfig`'s defaults (``data``, ``max_conversations``,
    ``eval_fraction``, ``seed``), with a warning for heads since it may not be the split they were trained
    with.

    Raises:
        ValueError: a malformed training record (see :func:`read_training_record`).
    """
    split = read_training_record(head_dir) if head_dir is not None else None
    if split is not None:
        return split
    split = _default_split()
    defaults = (
        f"the held-out split of TrainConfig's defaults (data {split.data}, max_conversations "
        f"{split.max_conversations}, eval_fraction {split.eval_fraction}, seed {split.seed})"
    )
    if head_dir is None:
        logger.info("held-out prompts: %s", defaults)
    else:
        logger.warning(
            "heads %s have no %s: using %s, which may not be the split they were trained with",
            head_dir,
            TRAINING_RECORD,
            defaults,
        )
    return split


def split_prompts(split: HeldoutSplit) -> list[BenchPrompt]:
    """The first user turn (after any system messages) of every conversation in ``split``, in split order.

    Raises:
        ValueError: the data no longer holds every recorded held-out conversation (the data changed since
            training).
    """
    # Local import: see _default_split.
    from selfspec.train.data import load_conversations, prompt_messages, split_conversations

    conversations = load_conversations(split.data, max_conversations=split.max_conversations)
    if split.heldout_ids is None:
        _, heldout = split_conversations(conversations, eval_fraction=split.eval_fraction, seed=split.seed)
    else:
        wanted = set(split.heldout_ids)
        heldout = [c for c in conversations if str(c["id"]) in wanted]  # input order = split order
        lost = wanted - {str(c["id"]) for c in heldout}
        if lost:
            raise ValueError(
                f"{len(lost)} of the {len(wanted)} held-out conversations named in {split.origin} are not among "
                f"the first {split.max_conversations} conversations of {split.data} (e.g. {sorted(lost)[:3]}): the "
                "data changed since training; bench on a JSONL prompt file instead, or retrain."
            )
    prompts = []
    for conv in heldout:
        messages = prompt_messages(conv)
        if not messages or messages[-1]["role"] != "user":
            continue
        prompts.append(BenchPrompt(str(conv["id"]), "sharegpt", (messages[-1]["content"],), tuple(messages[:-1])))
    return prompts


def heldout_prompts(head_dir: str | Path | None = None) -> list[BenchPrompt]:
    """The first user turn of every ShareGPT conversation held out by the run that trained ``head_dir``
    (:func:`heldout_split`; None: the split of the training defaults).

    Raises:
        ValueError: a malformed training record, or data that lost recorded conversations.
    """
    return split_prompts(heldout_split(head_dir))


def load_prompts(
    source: str,
    num_prompts: int | None = None,
    max_turns: int | None = None,
    per_category: int | None = None,
    *,
    head_dirs: Sequence[str | Path] = (),
) -> list[BenchPrompt]:
    """Benchmark questions from a JSONL path or ``"sharegpt-heldout"``.

    Args:
        source: an MT-bench / Spec-Bench JSONL file (:func:`load_jsonl_prompts`) or ``"sharegpt-heldout"``.
        num_prompts: keep the first N after the other filters (None = all).
        max_turns: keep only the first ``max_turns`` turns of each question (1 = first turns only).
        per_category: keep the first N questions of each category, in file order.
        head_dirs: for ``"sharegpt-heldout"``, the head directories being measured: the split is the first
            one's (:func:`heldout_prompts`), less any conversation that another head's training record
            does not hold out (so no head is measured on its training data). Ignored for files.

    Raises:
        MissingFileError: no such prompt file.
        UserError: a malformed or empty prompt file, or no prompt left after the filters.
        ValueError: a malformed training record.
    """
    if source == SHAREGPT_HELDOUT:
        dirs = list(head_dirs)
        prompts = heldout_prompts(dirs[0] if dirs else None)
        for head_dir in dirs[1:]:
            other = read_training_record(head_dir)
            if other is None or other.heldout_ids is None:
                continue
            held = set(other.heldout_ids)
            kept = [p for p in prompts if p.question_id in held]
            if len(kept) < len(prompts):
                logger.info(
                    "held-out prompts: %d of %d dropped, not held out by %s",
                    len(prompts) - len(kept),
                    len(prompts),
                    other.origin,
                )
            prompts = kept
    else:
        prompts = load_jsonl_prompts(source)
    if max_turns is not None:
        prompts = [dataclasses.replace(p, turns=p.turns[:max_turns]) for p in prompts]
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for prompt in prompts:
            seen[prompt.category] = seen.get(prompt.category, 0) + 1
            if seen[prompt.category] <= per_category:
                kept.append(prompt)
        prompts = kept
    prompts = prompts[:num_prompts] if num_prompts is not None else prompts
    if not prompts:
        raise UserError(f"no prompts to run from {source}: ask for at least one (--num-prompts, --per-category)")
    return prompts
