"""``selfspec distill CONFIG [key=value ...]``: the self-distillation stage alone, by the config's engine.

The target writes the answers the heads train on (:mod:`selfspec.train.regenerate`): with ``distill_engine: hf`` its
``generate`` in this process (:func:`selfspec.train.features.self_distill`, as ``selfspec train`` runs it); with
``distill_engine: vllm``, vLLM in its own environment (``python -m selfspec.engine_envs vllm``), through one worker
process of the vLLM venv (:class:`selfspec.engines.worker.EngineWorker` running
:mod:`selfspec.engines.vllm.vllm_worker`, launched as the vLLM bench launches it) that answers each batch of prompts
in one ``LLM.generate``, batched by the engine. The prompts are rendered and tokenized here, with the run's chat
template and kwargs (:mod:`selfspec.train.chat_format`), so vLLM answers exactly the token ids HF ``generate`` would
be given; the sampling settings (``distill_temperature``, ``distill_top_p``, ``distill_max_new_tokens``), the system
prompt and ``distill_turns`` are the config's, ``distill_tensor_parallel_size`` and ``distill_data_parallel_size``
are passed to ``vllm.LLM``. The answers go to one JSONL file per split (conversation ids; appended chunk by chunk, so a
killed run resumes), finished by a ``.done`` marker that ``selfspec train`` waits for
(:func:`selfspec.train.regenerate.engine_answers`). ``selfspec train`` with ``distill_engine: vllm`` runs this stage
first (:func:`train_main`).

A missing or broken vLLM environment is an error naming the command that builds it; nothing falls back to HF.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from selfspec.base.errors import UserError, run_command
from selfspec.base.target import load_target, resolve_eos, resolve_target
from selfspec.engine_envs import env_python, env_works
from selfspec.train.__main__ import command_config, distill_plan, run
from selfspec.train.chat_format import apply_reasoning, bind_chat_format
from selfspec.train.config import TrainConfig
from selfspec.train.data import check_data_source, load_conversations, split_conversations
from selfspec.train.features import distill_split
from selfspec.train.regenerate import answers_file, finished_marker, regenerate_turns

logger = logging.getLogger("selfspec.distill")

VLLM_REQUEST_PROMPTS = 64
"""Prompts per vLLM request (and per chunk written to the answers file): vLLM batches them itself."""


def require_vllm_env() -> Path:
    """The vLLM venv's interpreter.

    Raises:
        UserError: the venv is missing or fails its probe; the message names the command that builds it.
    """
    if not env_works("vllm"):
        raise UserError(
            f"distill_engine: vllm needs vLLM in its own environment ({env_python('vllm').parent.parent}), which is "
            "missing or broken: build it once with `python -m selfspec.engine_envs vllm` (about 2 minutes), or set "
            "distill_engine: hf"
        )
    return env_python("vllm")


def vllm_llm_kwargs(cfg: TrainConfig, target_dir: str, cuda: bool) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments for regeneration: the target in the run's dtype, a context of the prompt cap
    plus the answer cap, the run's seed, eager on a CPU (no compile: minutes on 2 cores), and the parallel sizes
    passed through where above 1."""
    kwargs: dict[str, Any] = {
        "model": target_dir,
        "dtype": cfg.dtype,
        "max_model_len": cfg.distill_prompt_cap() + cfg.distill_max_new_tokens,
        "seed": cfg.seed,
        "enforce_eager": not cuda,
    }
    if cfg.distill_tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = cfg.distill_tensor_parallel_size
    if cfg.distill_data_parallel_size > 1:
        kwargs["data_parallel_size"] = cfg.distill_data_parallel_size
    return kwargs


class VllmAnswerer:
    """Answers batches of prompts with vLLM in its own venv (one worker process for the stage).

    Args:
        cfg: the run's config (sampling settings, caps, seed, parallel sizes).
        target_dir: the target's local directory (vLLM loads it).
        tokenizer: renders and tokenizes the prompts here (vLLM is given token ids).
        log: the file vLLM's own output goes to.

    Raises:
        UserError: no working vLLM venv (:func:`require_vllm_env`).
        RuntimeError: vLLM failed to load, or rejected the sampling settings on a one-token probe (before any
            answer is written; its message and the end of its log).
    """

    def __init__(self, cfg: TrainConfig, target_dir: str, tokenizer: Any, log: Path) -> None:
        import torch

        from selfspec.engines.vllm.bench import WORKER, worker_env
        from selfspec.engines.worker import EngineWorker

        python = require_vllm_env()
        from transformers import GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(target_dir)
        except OSError:  # no generation_config.json: the tokenizer's EOS
            generation = None
        self.stop_ids = resolve_eos(SimpleNamespace(generation_config=generation), tokenizer)
        self.request = {
            "max_tokens": cfg.distill_max_new_tokens,
            "temperature": cfg.distill_temperature,
            "top_p": cfg.distill_top_p,
            "stop_ids": self.stop_ids,
        }
        self.tokenizer = tokenizer
        kwargs = vllm_llm_kwargs(cfg, target_dir, torch.cuda.is_available())
        log.parent.mkdir(parents=True, exist_ok=True)
        # the vLLM bench's way of launching its worker: -I, so the worker's folder (named vllm) shadows nothing
        cmd = [str(python), "-I", str(WORKER), json.dumps({"llm": kwargs})]
        self.worker = EngineWorker(cmd, worker_env(cfg.threads), log, "loading vLLM for self-distillation")
        self.load_s = float(self.worker.ready["load_s"])
        probe = tokenizer("hi", add_special_tokens=False)["input_ids"] or [0]
        self.worker.request({**self.request, "max_tokens": 1, "prompts": [probe]}, "vLLM's check of the sampling")

    def __call__(self, texts: list[str], prompts: list[list[dict]], batch: list[dict]) -> list[list[int]]:
        """The answers' token ids to the rendered ``texts`` (one ``LLM.generate``)."""
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        reply = self.worker.request({**self.request, "prompts": ids}, "vLLM self-distillation")
        return [o["tokens"] for o in reply["outputs"]]

    def close(self) -> None:
        """End the worker."""
        self.worker.close()


def distill(cfg: TrainConfig) -> dict[str, int]:
    """Run the self-distillation stage of ``cfg`` alone (one process), by ``cfg.distill_engine``.

    Returns:
        ``{split: answers written or read back}`` for ``"train"`` and ``"eval"``.

    Raises:
        UserError: ``self_distill`` is off, a data file is missing, or (vLLM) no working venv, or a
            ``target_adapter`` (vLLM is given the base target only).
    """
    if not cfg.self_distill:
        raise UserError("self_distill is false: there is nothing to regenerate (set self_distill: true)")
    check_data_source(cfg.data)
    vllm = cfg.distill_engine == "vllm"
    if vllm and cfg.target_adapter is not None:
        raise UserError(
            "distill_engine: vllm loads the base target only: merge target_adapter into a saved model first"
        )
    if vllm:
        require_vllm_env()  # before anything is loaded
    convs = apply_reasoning(load_conversations(cfg.data, max_conversations=cfg.max_conversations), cfg.reasoning)
    train_convs, eval_convs = split_conversations(convs, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    to_distill, to_distill_eval, _ = distill_plan(cfg, train_convs, eval_convs)
    parts = {"train": to_distill, "eval": to_distill_eval}
    if not vllm:
        import torch

        target, tokenizer = load_target(cfg.target, dtype=getattr(torch, cfg.dtype), adapter=cfg.target_adapter)
        bind_chat_format(tokenizer, cfg.chat_template, cfg.chat_template_kwargs)
        return {split: len(distill_split(cfg, target, tokenizer, split, part)) for split, part in parts.items()}
    from transformers import AutoTokenizer

    target_dir = resolve_target(cfg.target)
    tokenizer = bind_chat_format(AutoTokenizer.from_pretrained(target_dir), cfg.chat_template, cfg.chat_template_kwargs)
    log = answers_file(cfg, "train", 0, 1).parent / "vllm.log"
    answerer = VllmAnswerer(cfg, target_dir, tokenizer, log)
    logger.info("vLLM loaded in %.1fs", answerer.load_s)
    counts = {}
    try:
        for split, part in parts.items():
            path = answers_file(cfg, split, 0, 1)
            out = regenerate_turns(
                answerer, tokenizer, part, path, VLLM_REQUEST_PROMPTS, cfg.distill_prompt_cap(),
                turns=cfg.distill_turns, system_prompt=cfg.distill_system_prompt, reasoning=cfg.reasoning,
                chunk_conversations=VLLM_REQUEST_PROMPTS,
            )  # fmt: skip
            finished_marker(path).write_text(json.dumps({"answers": len(out), "conversations": len(part)}) + "\n")
            counts[split] = len(out)
    finally:
        answerer.close()
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """``selfspec distill CONFIG [key=value ...]``: the answers of the config's self-distillation, nothing else."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    what = "the self-distillation stage of a training config alone: the target writes the answers (HF or vLLM)"
    counts = distill(command_config(list(argv or []), prog="selfspec distill", description=what))
    print(json.dumps(counts))
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """``selfspec train ...``: with ``distill_engine: vllm`` (and ``self_distill``) the vLLM stage first
    (:func:`distill`), then the training run, which reads its answers."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    cfg = command_config(list(argv or []))
    if cfg.self_distill and cfg.distill_engine != "hf":
        distill(cfg)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_command("selfspec distill", main, sys.argv[1:]))
