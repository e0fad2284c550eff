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
from selfspec.train.chat_format import REASONING, answer_message
from selfspec.train.data import prompt_messages
from selfspec.train.distill_states import (
    CapturedStates,
    TailDone,
    TailForcer,
    recorded_features,
    template_tail,
)
from selfspec.train.regenerate import (
    answers_file,
    check_regeneration,
    engine_answers,
    regenerate_turns,
    with_system_prompt,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from selfspec.train.config import TrainConfig

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
    *,
    turns: str = "first",
    temperature: float = 0.0,
    top_p: float = 1.0,
    system_prompt: str | None = None,
    reasoning: str = "keep",
) -> list[dict]:
    """Regenerate each conversation's assistant answers with the target (batched ``generate``; greedy by default).

    With ``turns="first"`` the prompt is the conversation up to its first assistant turn, rendered with the
    target's chat template, and the target's answer replaces that turn (the rest is dropped). With ``turns="all"``
    every assistant turn is regenerated on the regenerated history (:func:`regenerate_all_turns`: the user turns as
    written, each earlier answer the target's own). Results are appended to ``cache_file`` (JSONL, one record per
    conversation with its id) batch by batch, so a killed run resumes where it stopped and a finished one is reused.

    Args:
        model: frozen target (any dtype).
        tokenizer: its tokenizer (left padding is used for batching).
        conversations: ``[{"id", "messages"}]``.
        cache_file: JSONL path for the regenerated conversations.
        max_new_tokens: answer length cap, in tokens.
        batch_size: prompts per ``generate`` call.
        max_prompt_tokens: prompts longer than this are skipped (counted in a log line): one long
            prompt would pad its whole batch. With ``turns="all"`` a conversation ends at the first turn whose
            history is longer (it is skipped when that is the first turn).
        capture: when given (and while it has room), each generated conversation's target features are kept in
            it (:mod:`selfspec.train.distill_states`): generation also feeds the template's end-of-turn tokens
            and forward hooks keep the states of ``capture.layers``, so the feature pass can skip the conversation.
            The answers are the same with and without it. Answers read from ``cache_file`` are not captured, nor
            are sampled ones (the capture follows greedy decoding).
        turns: ``"first"`` or ``"all"`` (see above).
        temperature: 0 decodes greedily; above 0 samples at this temperature (``generate``'s ``do_sample``).
        top_p: nucleus sampling's mass when sampling (1: the whole distribution); the target's own ``top_k`` is
            turned off, so only these two settings shape the sampled distribution.
        system_prompt: prepended as a system message to every conversation that has none (the answers are then
            the target's under that system prompt, and the records keep it).
        reasoning: ``"keep"`` or ``"drop"`` the thinking span of each answer
            (:func:`selfspec.train.chat_format.answer_message`). The prompts render with the tokenizer's template as
            it is: bind a run's template and its kwargs first (:func:`selfspec.train.chat_format.bind_chat_format`).

    Returns:
        ``[{"id", "messages"}]`` with the prompt messages and the target's own answers.

    Raises:
        ValueError: an unknown ``turns``, sampling settings out of range, or ``turns="all"`` on conversations of
            which none has an assistant turn (before anything is generated).
    """
    check_regeneration(conversations, turns, temperature, top_p)
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {REASONING}, got {reasoning!r}")
    sampling = sampling_kwargs(temperature, top_p)
    if turns == "all":
        return regenerate_all_turns(
            model, tokenizer, conversations, cache_file, max_new_tokens, batch_size, max_prompt_tokens,
            disable_progress, capture, sampling, system_prompt, reasoning,
        )  # fmt: skip
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
        msgs = with_system_prompt(prompt_messages(conv), system_prompt)
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
                answers = _generate(model, tokenizer, enc, max_new_tokens, sampling, capture, prompts, texts, batch)
                for conv, msgs, row in zip(batch, prompts, answers, strict=True):
                    answer = tokenizer.decode(row, skip_special_tokens=True).strip()
                    rec = {"id": conv["id"], "messages": msgs + [answer_message(tokenizer, answer, reasoning)]}
                    done[conv["id"]] = rec
                    fh.write(json.dumps(rec) + "\n")
                fh.flush()
    finally:
        tokenizer.padding_side = pad_side
    return [done[c["id"]] for c in conversations if c["id"] in done]


def distill_split(
    cfg: TrainConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    split: str,
    part: list[dict],
    rank: int = 0,
    world: int = 1,
    capture: CapturedStates | None = None,
    quiet: bool = False,
) -> list[dict]:
    """One split's self-distillation as ``cfg`` says (process ``rank`` of ``world``, ``part`` its share): with
    ``distill_engine: hf`` :func:`self_distill` into :func:`~selfspec.train.regenerate.answers_file`; with another
    engine the answers it wrote (:func:`~selfspec.train.regenerate.engine_answers`, which refuses unfinished ones).

    Returns:
        ``[{"id", "messages"}]``, in ``part``'s order.
    """
    if cfg.distill_engine != "hf":
        return engine_answers(cfg, split, part)
    return self_distill(
        model,
        tokenizer,
        part,
        answers_file(cfg, split, rank, world),
        cfg.distill_max_new_tokens,
        cfg.distill_batch_size,
        max_prompt_tokens=cfg.distill_prompt_cap(),
        disable_progress=quiet,
        capture=capture,
        turns=cfg.distill_turns,
        temperature=cfg.distill_temperature,
        top_p=cfg.distill_top_p,
        system_prompt=cfg.distill_system_prompt,
        reasoning=cfg.reasoning,
    )


def sampling_kwargs(temperature: float, top_p: float) -> dict:
    """``generate`` keyword arguments of the sampling settings: greedy at temperature 0; else sampling at
    ``temperature`` and ``top_p``, with the target's ``top_k`` turned off (``top_k=0``)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": 0}


def _generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    enc,
    max_new_tokens: int,
    sampling: dict,
    capture: CapturedStates | None,
    prompts: list[list[dict]],
    texts: list[str],
    batch: list[dict],
) -> list[torch.Tensor]:
    """One batch of answers: per row the generated tokens (LongTensor ``[n]``, padding after EOS possible), with the
    features captured into ``capture`` when it has room and decoding is greedy."""
    if capture is not None and capture.has_room() and not sampling["do_sample"]:
        tails = [template_tail(tokenizer, m, t) for m, t in zip(prompts, texts, strict=True)]
        pad = tokenizer.pad_token_id
        return _generate_capturing(model, enc, max_new_tokens, pad, tails, capture, batch)
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, synced_gpus=False, **sampling
    )  # synced_gpus: a sharded target's forwards are in lockstep already (selfspec.base.target_shards)
    return list(out[:, enc["input_ids"].shape[1] :])


def regenerate_all_turns(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[dict],
    cache_file: str | Path,
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    disable_progress: bool,
    capture: CapturedStates | None,
    sampling: dict,
    system_prompt: str | None,
    reasoning: str = "keep",
) -> list[dict]:
    """:func:`self_distill` with ``turns="all"``: :func:`~selfspec.train.regenerate.regenerate_turns` answering with
    the target's ``generate`` (left-padded batches; with ``capture``, greedy only, each round's capture replaces the
    previous one, so the last round holds the whole regenerated conversation).

    Returns:
        ``[{"id", "messages"}]``: the conversations' messages up to their last regenerated answer, in input order.
    """

    def answer(texts: list[str], prompts: list[list[dict]], batch: list[dict]) -> list[torch.Tensor]:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        return _generate(model, tokenizer, enc, max_new_tokens, sampling, capture, prompts, texts, batch)

    pad_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        return regenerate_turns(
            answer, tokenizer, conversations, cache_file, batch_size, max_prompt_tokens,
            turns="all", system_prompt=system_prompt, reasoning=reasoning, disable_progress=disable_progress,
        )  # fmt: skip
    finally:
        tokenizer.padding_side = pad_side


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
            synced_gpus=False,
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


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """The batches :func:`hidden_features` runs: indices into ``lengths`` sorted by length (stable) and cut greedily
    so that a batch's rows times its longest length stay within ``batch_tokens`` (a longer example alone); with
    ``batch_tokens`` 0 or 1, one example per batch in order. The feature store runs the same batches one by one."""
    if batch_tokens <= 1:
        return [[i] for i in range(len(lengths))]
    batches, current = [], []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and (len(current) + 1) * lengths[i] > batch_tokens:  # sorted: row i is the longest
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


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
    batches = length_batches(lengths, batch_tokens)
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
