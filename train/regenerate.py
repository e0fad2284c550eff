"""Regeneration of conversations by the target, whatever engine writes the answers, and where the answers are kept.

:func:`regenerate_turns` drives it turn by turn: it renders each prompt with the tokenizer's (bound) chat template,
skips prompts over the cap, hands length-sorted batches to an engine's answerer (the target's ``generate`` in
:func:`selfspec.train.features.self_distill`; vLLM in :mod:`selfspec.distill`) and appends each finished
conversation to a JSONL cache, so a killed run resumes. :func:`answers_file` names the cache of a run's settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from selfspec.train.chat_format import answer_message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from selfspec.train.config import TrainConfig

logger = logging.getLogger(__name__)

Answerer = Callable[[list[str], list[list[dict]], list[dict]], Sequence[Any]]
"""``answer(texts, prompts, batch)`` -> per row the answer's token ids (a list or a LongTensor ``[n]``)."""

ENGINES = ("hf", "vllm")
"""What writes the answers: ``hf`` (the target's ``generate`` in the training process), ``vllm`` (vLLM in its own
environment, :mod:`selfspec.distill`)."""


def distill_variant(cfg: TrainConfig) -> str:
    """The part of a self-distillation cache file's name that tells its answers apart: ``""`` for the first turn,
    greedy, with no system prompt (today's files); else ``"-"`` and 12 hex digits of a hash of the turns, the
    sampling settings and the system prompt, so a run never reads answers written under other settings."""
    settings = (cfg.distill_turns, cfg.distill_temperature, cfg.distill_top_p, cfg.distill_system_prompt)
    if settings == ("first", 0.0, 1.0, None):
        return ""
    return "-" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]


def answers_file(cfg: TrainConfig, split: str, rank: int, world: int) -> Path:
    """The JSONL cache of process ``rank`` of ``world``'s answers for ``split`` (``"train"`` / ``"eval"``) under
    ``distill_dir`` (default ``<output_dir>/distill``). vLLM writes one file for all processes (rank 0 of 1)."""
    shard_dir = Path(cfg.distill_dir) if cfg.distill_dir else Path(cfg.output_dir) / "distill"
    return shard_dir / f"{split}{distill_variant(cfg)}-rank{rank}-of{world}.jsonl"


def finished_marker(path: Path) -> Path:
    """The file whose presence says the answers of ``path`` are all written (``<path>.done``)."""
    return path.with_name(path.name + ".done")


def read_answers(path: Path, repair: bool = False) -> dict[str, dict]:
    """The records of an answers file by id, up to a line cut by a kill; with ``repair`` the file is cut back to
    those records (so what is appended next starts on a line of its own)."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    kept = 0
    with path.open("rb") as fh:
        for line in fh:
            try:
                rec = json.loads(line) if line.endswith(b"\n") else None
            except json.JSONDecodeError:
                rec = None
            if rec is None:
                break  # a line cut by a kill: regenerated from here
            done[rec["id"]] = rec
            kept += len(line)
    if repair and kept < path.stat().st_size:
        with path.open("r+b") as fh:
            fh.truncate(kept)
    return done


def engine_answers(cfg: TrainConfig, split: str, part: Sequence[dict]) -> list[dict]:
    """The answers an engine outside the training processes wrote for ``part`` (``selfspec distill`` with
    ``distill_engine: vllm``: one file for every process, :func:`answers_file` of rank 0 of 1), in ``part``'s order;
    conversations it skipped (prompts over the cap) are left out.

    Raises:
        ValueError: the file is not finished (:func:`finished_marker`): the message names the command that writes it.
    """
    path = answers_file(cfg, split, 0, 1)
    if not finished_marker(path).exists():
        raise ValueError(
            f"distill_engine: {cfg.distill_engine}: the {split} answers are not all written ({path}): run "
            "`selfspec distill CONFIG [key=value ...]` first (or `selfspec train`, which runs it), then train"
        )
    done = read_answers(path)
    return [done[c["id"]] for c in part if c["id"] in done]


TURNS = ("first", "all")


def check_regeneration(conversations: Sequence[dict], turns: str, temperature: float, top_p: float) -> None:
    """Refuse regeneration settings before any answer is written.

    Raises:
        ValueError: ``turns`` not in :data:`TURNS`, ``temperature`` < 0, ``top_p`` outside (0, 1], or
            ``turns="all"`` where no conversation has an assistant turn (prompts only: nothing to regenerate
            turn by turn).
    """
    if turns not in TURNS:
        raise ValueError(f"self-distillation turns must be one of {TURNS}, got {turns!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"self-distillation needs temperature >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    if turns == "all" and conversations and not any(_assistant_turns(c["messages"]) for c in conversations):
        raise ValueError(
            f"distill_turns: all regenerates every assistant turn, but none of the {len(conversations)} "
            "conversations has one (prompts only): use distill_turns: first, or data with assistant turns"
        )


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """``messages`` with ``system_prompt`` as a first system message, unless they already open with one (or it is
    None)."""
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _assistant_turns(messages: Sequence[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def regenerate_turns(
    answer: Answerer,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[dict],
    cache_file: str | Path,
    batch_size: int,
    max_prompt_tokens: int,
    *,
    turns: str = "all",
    system_prompt: str | None = None,
    reasoning: str = "keep",
    disable_progress: bool = False,
    chunk_conversations: int = 0,
) -> list[dict]:
    """Regenerate conversations turn by turn with any engine: ``answer`` writes each batch's answers.

    With ``turns="all"`` every assistant turn is regenerated on the regenerated history; with ``"first"`` only the
    first (a conversation without an assistant turn, a prompt, is answered once). Conversations go in chunks
    (``chunk_conversations``, default ``8 * batch_size``); within a chunk, round k
    answers the k-th assistant turn of every conversation that has one, in length-sorted batches of
    ``batch_size``, the prompt being the messages before that turn with every earlier answer replaced by the
    target's. A conversation whose next prompt exceeds ``max_prompt_tokens`` ends with the turns before it (none:
    skipped). A chunk's records (``{"id", "messages"}``, JSONL) are appended to ``cache_file`` once all its rounds
    are done: a killed run loses at most one chunk, and a finished one is read back.

    Args:
        answer: ``answer(texts, prompts, batch)`` -> per row the answer's token ids (decoded with
            ``skip_special_tokens``): ``texts`` the rendered prompts (generation prompt added), ``prompts`` their
            messages, ``batch`` the conversations.
        tokenizer: renders (its chat template as bound, :func:`~selfspec.train.chat_format.bind_chat_format`),
            counts and decodes.

    Returns:
        ``[{"id", "messages"}]``: the conversations' messages up to their last regenerated answer, in input order.
    """
    cache_file = Path(cache_file)
    done = read_answers(cache_file, repair=True)
    first = turns == "first"
    todo = [c for c in conversations if c["id"] not in done and (first or _assistant_turns(c["messages"]))]
    chunk = chunk_conversations or 8 * batch_size
    logger.info("self-distillation (%s turns): %d cached, %d to generate", turns, len(done), len(todo))
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    skipped = 0
    with cache_file.open("a") as fh:
        for start in tqdm(range(0, len(todo), chunk), desc="self-distill (turns)", disable=disable_progress):
            part = todo[start : start + chunk]
            history: dict[str, list[dict]] = {c["id"]: [] for c in part}
            cursor = {c["id"]: 0 for c in part}  # next original message to copy
            answered = {c["id"]: 0 for c in part}
            live = list(part)
            while live:
                rows = []
                for conv in live:
                    msgs, i = conv["messages"], cursor[conv["id"]]
                    turn = next((j for j in _assistant_turns(msgs) if j >= i), len(msgs))
                    prompt = with_system_prompt(history[conv["id"]] + [dict(m) for m in msgs[i:turn]], system_prompt)
                    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
                    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
                    if n <= max_prompt_tokens:
                        rows.append((n, conv, prompt, text, turn))
                rows.sort(key=lambda item: item[0])
                for b in range(0, len(rows), batch_size):
                    group = rows[b : b + batch_size]
                    texts = [r[3] for r in group]
                    prompts = [r[2] for r in group]
                    batch = [r[1] for r in group]
                    answers = answer(texts, prompts, batch)
                    for (_, conv, prompt, _, turn), row in zip(group, answers, strict=True):
                        said = tokenizer.decode(row, skip_special_tokens=True).strip()
                        history[conv["id"]] = prompt + [answer_message(tokenizer, said, reasoning)]
                        cursor[conv["id"]] = turn + 1
                        answered[conv["id"]] += 1
                advanced = {r[1]["id"] for r in rows}
                live = [
                    c
                    for c in live
                    if not first
                    and c["id"] in advanced
                    and any(j >= cursor[c["id"]] for j in _assistant_turns(c["messages"]))
                ]
            for conv in part:
                if answered[conv["id"]] == 0:
                    skipped += 1
                    continue
                rec = {"id": conv["id"], "messages": history[conv["id"]]}
                done[conv["id"]] = rec
                fh.write(json.dumps(rec) + "\n")
            fh.flush()
    if skipped:
        logger.info("self-distillation: %d skipped (first prompt over %d tokens)", skipped, max_prompt_tokens)
    return [done[c["id"]] for c in conversations if c["id"] in done]
