"""What the frozen target contributes to training: self-distilled answers and hidden-state features.

Both run under ``torch.inference_mode`` on the frozen target; nothing here can update it.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, StoppingCriteriaList

from selfspec.base.target import resolve_eos
from selfspec.decode.kv import backbone
from selfspec.decode.verifier import layer_states
from selfspec.train.data import prompt_messages
from selfspec.train.distill_states import (
    CapturedStates,
    TailDone,
    TailForcer,
    recorded_features,
    template_tail,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@torch.inference_mode()
def self_distill(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[dict],
    cache_file: str | Path,
    max_new_tokens: int = 160,
    batch_size: int = 16,
    max_prompt_tokens: int = 352,
    disable_progress: bool = False,
    capture: CapturedStates | None = None,
) -> list[dict]:
    """Regenerate each conversation's first assistant answer with the target (greedy, batched).

    The prompt is the conversation up to its first assistant turn, rendered with the target's chat
    template. Results are appended to ``cache_file`` (JSONL) batch by batch, so a killed run resumes
    where it stopped and a finished one is reused.

    Args:
        model: frozen target (any dtype).
        tokenizer: its tokenizer (left padding is used for batching).
        conversations: ``[{"id", "messages"}]``.
        cache_file: JSONL path for the regenerated conversations.
        max_new_tokens: answer length cap, in tokens.
        batch_size: prompts per ``generate`` call.
        max_prompt_tokens: prompts longer than this are skipped (counted in a log line): one long
            prompt would pad its whole batch.
        capture: when given (and while it has room), each generated conversation's target features are kept in
            it (:mod:`selfspec.train.distill_states`): generation also feeds the template's end-of-turn tokens
            and forward hooks keep the states of ``capture.layers``, so the feature pass can skip the conversation.
            The answers are the same with and without it. Answers read from ``cache_file`` are not captured.

    Returns:
        ``[{"id", "messages"}]`` with the prompt messages and the target's own answer.
    """
    cache_file = Path(cache_file)
    done: dict[str, dict] = {}
    if cache_file.exists():
        for line in cache_file.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a kill: regenerate from here
            done[rec["id"]] = rec
    todo = []
    too_long = 0
    for conv in conversations:
        if conv["id"] in done:
            continue
        msgs = prompt_messages(conv)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > max_prompt_tokens:
            too_long += 1
            continue
        todo.append((n, conv, msgs, text))
    todo.sort(key=lambda item: item[0])  # similar lengths share a batch: little padding
    logger.info(
        "self-distillation: %d cached, %d to generate, %d skipped (prompt over %d tokens)",
        len(done),
        len(todo),
        too_long,
        max_prompt_tokens,
    )
    pad_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        with cache_file.open("a") as fh:
            for start in tqdm(range(0, len(todo), batch_size), desc="self-distill", disable=disable_progress):
                batch = [item[1] for item in todo[start : start + batch_size]]
                prompts = [item[2] for item in todo[start : start + batch_size]]
                texts = [item[3] for item in todo[start : start + batch_size]]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
                if capture is not None and capture.has_room():
                    tails = [template_tail(tokenizer, m, t) for m, t in zip(prompts, texts, strict=True)]
                    pad = tokenizer.pad_token_id
                    answers = _generate_capturing(model, enc, max_new_tokens, pad, tails, capture, batch)
                else:
                    out = model.generate(
                        **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                    )
                    answers = list(out[:, enc["input_ids"].shape[1] :])
                for conv, msgs, row in zip(batch, prompts, answers, strict=True):
                    answer = tokenizer.decode(row, skip_special_tokens=True).strip()
                    rec = {"id": conv["id"], "messages": msgs + [{"role": "assistant", "content": answer}]}
                    done[conv["id"]] = rec
                    fh.write(json.dumps(rec) + "\n")
                fh.flush()
    finally:
        tokenizer.padding_side = pad_side
    return [done[c["id"]] for c in conversations if c["id"] in done]


def _generate_capturing(
    model: PreTrainedModel,
    enc,
    max_new_tokens: int,
    pad_token_id: int,
    tails: list[list[int]],
    capture: CapturedStates,
    batch: list[dict],
) -> list[torch.Tensor]:
    """One greedy batch of :func:`self_distill` that also captures each row's features into ``capture``.

    Returns:
        Per row, the tokens plain ``generate`` with EOS stopping gives up to and including its EOS (LongTensor
        ``[n]`` or ``[n + 1]``; the padding after it is left out, which decoding skips as a special token anyway).
    """
    width = enc["input_ids"].shape[1]
    forcer = TailForcer(width, resolve_eos(model, None), tails, max_new_tokens)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # no EOS stop (None would mean "the model's"): the forcer ends answers where EOS would
    config.max_new_tokens = max_new_tokens + max(len(t) for t in tails) + 1
    config.do_sample = False
    config.pad_token_id = pad_token_id
    with recorded_features(model, capture.layers) as steps:
        sequences = model.generate(
            **enc,
            generation_config=config,
            logits_processor=LogitsProcessorList([forcer]),
            stopping_criteria=StoppingCriteriaList([TailDone(forcer)]),
        )
    feats = torch.cat(steps, dim=1)  # [B, P + N - 1, F]: the i-th token fed at position i
    prompt_lengths = enc["attention_mask"].sum(dim=1).tolist()
    answers = []
    for r, conv in enumerate(batch):
        n = forcer.answer_tokens[r]
        if n is None:  # generate stopped first: cannot happen with the max_new_tokens above
            raise RuntimeError("self-distillation stopped before an answer ended")
        eos = forcer.stopped_by[r]
        answer = sequences[r, width : width + n]
        answers.append(answer if eos is None else torch.cat([answer, answer.new_tensor([eos])]))
        if tails[r]:
            start, stop = width - int(prompt_lengths[r]), width + n + len(tails[r])
            capture.add(conv["id"], sequences[r, start:stop].cpu(), feats[r, start:stop].cpu().clone())
    return answers


@torch.inference_mode()
def hidden_features(
    model: PreTrainedModel,
    examples: Iterable[dict],
    disable_progress: bool = False,
    layers: Sequence[int] | None = None,
    batch_tokens: int = 0,
) -> list[torch.Tensor]:
    """Target last hidden states (after the final norm) for each tokenized example.

    With ``batch_tokens`` > 1 the examples are sorted by length and run in batches of at most
    ``batch_tokens`` padded tokens (rows right-padded with token 0, no attention mask). A causal target's
    states at a row's real positions never see the padding after them, so each example gets the states it
    gets alone, up to float rounding of the larger matmuls (float32, on SmolLM2's three EAGLE-3 layers and last
    state: at most 6e-4 absolute). On the 2-core AVX2 CPU this forwards sequences of ~200 tokens 1.12x faster
    than one at a time, and the ~300-token training mix about as fast (docs/journal/round-11.md). An example longer
    than ``batch_tokens`` runs alone.

    Args:
        model: frozen, causal target.
        examples: dicts with ``input_ids`` LongTensor ``[T]``.
        layers: optional decoder layers whose input hidden states come first
            (:func:`selfspec.decode.verifier.layer_states`, EAGLE-3).
        batch_tokens: padded tokens per forward; 0 or 1 runs one example at a time, in order (no padding,
            bit-identical to a single forward).

    Returns:
        One tensor ``[T, D]`` per example, in the order of ``examples`` (``[T, (len(layers) + 1) * D]`` with
        ``layers``: those layers, then the last hidden state), in the model dtype, on CPU.
    """
    examples = list(examples)
    lengths = [int(ex["input_ids"].numel()) for ex in examples]
    if batch_tokens <= 1:
        batches = [[i] for i in range(len(examples))]
    else:
        batches, current = [], []
        for i in sorted(range(len(examples)), key=lengths.__getitem__):
            if current and (len(current) + 1) * lengths[i] > batch_tokens:  # sorted: row i is the longest
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    feats: list[torch.Tensor | None] = [None] * len(examples)
    net = backbone(model)
    with tqdm(total=len(examples), desc="target features", disable=disable_progress) as bar:
        for rows in batches:
            width = max(lengths[i] for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, : lengths[i]] = examples[i]["input_ids"]
            out = net(input_ids=ids.to(model.device), use_cache=False, output_hidden_states=bool(layers))
            for r, i in enumerate(rows):
                n = lengths[i]
                last = out.last_hidden_state[r, :n]
                if layers:
                    last = torch.cat([layer_states(out, layers, row=r)[:n], last], dim=-1)
                feats[i] = last.cpu()  # a view keeps its batch alive: every row of it is kept anyway
            bar.update(len(rows))
    return feats  # type: ignore[return-value]


def features_reusing(
    model: PreTrainedModel,
    examples: Sequence[dict],
    captured: CapturedStates | None,
    disable_progress: bool = False,
    layers: Sequence[int] | None = None,
    batch_tokens: int = 0,
) -> list[torch.Tensor]:
    """:func:`hidden_features` of ``examples``, taking those self-distillation captured from ``captured``.

    Each example whose features ``captured`` holds for the same token ids (:meth:`CapturedStates.take`, which
    removes them) gets those; the others are computed in one :func:`hidden_features` call. The reuse is logged.

    Returns:
        One tensor ``[T, F]`` per example, in the order of ``examples``, as :func:`hidden_features` returns.
    """
    feats: list[torch.Tensor | None] = [captured.take(e, layers) if captured else None for e in examples]
    todo = [i for i, f in enumerate(feats) if f is None]
    if captured is not None:
        reused = [f for f in feats if f is not None]
        logger.info(
            "target features: %d of %d sequences (%d tokens) captured during self-distillation",
            len(reused),
            len(feats),
            sum(f.shape[0] for f in reused),
        )
    computed = hidden_features(model, [examples[i] for i in todo], disable_progress, layers, batch_tokens)
    for i, f in zip(todo, computed, strict=True):
        feats[i] = f
    return feats  # type: ignore[return-value]
