"""``accelerate launch -m selfspec.train CONFIG.yaml [key=value ...]``: train draft heads on a frozen target."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed

from selfspec.base.adapter import read_adapter_config
from selfspec.base.errors import UserError, run_command
from selfspec.base.target import load_target
from selfspec.train.chat_format import apply_reasoning, bind_chat_format, read_chat_template
from selfspec.train.config import TrainConfig, load_config
from selfspec.train.data import check_data_source, load_conversations, split_conversations
from selfspec.train.distill_states import CapturedStates
from selfspec.train.features import self_distill
from selfspec.train.inputs import RunInputs
from selfspec.train.recipes import recipe_for, warm_started
from selfspec.train.tracking import accelerator_kwargs

logger = logging.getLogger("selfspec.train")


def run(cfg: TrainConfig) -> Path:
    """Run one training job end to end (data -> optional self-distillation -> features -> heads).

    The recipe comes from the registry (:func:`~selfspec.train.recipes.recipe_for`). Self-distillation runs on each
    process's share of the prompts; every process then holds the whole
    data set, and the recipe's loop shards the batches (:mod:`selfspec.train.loop`). The target features
    self-distillation captures (:func:`capture_for`) go to the recipe's feature store.

    Returns:
        The directory holding the trained heads (``<output_dir>/heads``).
    """
    check_data_source(cfg.data)  # a missing or empty data file stops before anything is written
    cfg = warm_started(cfg)  # init_heads: the head's shape, read before any compute
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.grad_accum_steps,
        **accelerator_kwargs(cfg.report_to, cfg.output_dir),
    )
    set_seed(cfg.seed)
    out_dir = Path(cfg.output_dir)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    t0 = time.perf_counter()
    target, tokenizer = load_target(
        cfg.target, dtype=getattr(torch, cfg.dtype), device=accelerator.device, adapter=cfg.target_adapter
    )
    tokenizer = bind_chat_format(
        tokenizer, cfg.chat_template, cfg.chat_template_kwargs
    )  # chat_template, chat_template_kwargs: checked before any work
    convs = apply_reasoning(load_conversations(cfg.data, max_conversations=cfg.max_conversations), cfg.reasoning)
    train_convs, eval_convs = split_conversations(convs, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    logger.info("%d conversations: %d train, %d held out", len(convs), len(train_convs), len(eval_convs))
    heldout_ids = [c["id"] for c in eval_convs]
    capture = capture_for(cfg, target)
    if cfg.self_distill:
        t1 = time.perf_counter()
        rank, world = accelerator.process_index, accelerator.num_processes
        to_distill, to_distill_eval, written = distill_plan(cfg, train_convs, eval_convs)
        shard_dir = Path(cfg.distill_dir) if cfg.distill_dir else out_dir / "distill"
        distilled = {
            split: self_distill(
                target,
                tokenizer,
                part[rank::world],
                shard_dir / f"{split}{distill_variant(cfg)}-rank{rank}-of{world}.jsonl",
                cfg.distill_max_new_tokens,
                cfg.distill_batch_size,
                max_prompt_tokens=cfg.distill_prompt_cap(),
                disable_progress=not accelerator.is_local_main_process,
                capture=capture,
                turns=cfg.distill_turns,
                temperature=cfg.distill_temperature,
                top_p=cfg.distill_top_p,
                system_prompt=cfg.distill_system_prompt,
                reasoning=cfg.reasoning,
            )
            for split, part in (("train", to_distill), ("eval", to_distill_eval))
        }
        logger.info("self-distillation done in %.1fs", time.perf_counter() - t1)
        if written:
            logger.info("adding %d conversations as written (not regenerated)", len(written))
        # Every process gets the whole regenerated set (in rank order); the recipes shard it again.
        train_convs, eval_convs = gather_object(distilled["train"]) + written, gather_object(distilled["eval"])
    run_inputs = RunInputs(cfg, accelerator, target, tokenizer, train_convs, eval_convs, heldout_ids, capture)
    heads_dir = recipe_for(cfg).train(run_inputs)
    if accelerator.is_main_process:
        logger.info("done in %.1f min: %s", (time.perf_counter() - t0) / 60, heads_dir)
    return heads_dir


def distill_plan(
    cfg: TrainConfig, train_convs: list[dict], eval_convs: list[dict]
) -> tuple[list[dict], list[dict], list[dict]]:
    """Which conversations a self-distilling run regenerates and which it adds as written.

    Returns:
        ``(train to regenerate, held-out to regenerate, train as written)``: the first ``distill_conversations``
        training conversations, the first ``distill_eval_conversations`` held-out ones (default
        ``max(8, distill_conversations // 10)``), and the next ``original_conversations`` training ones.
    """
    start = cfg.distill_conversations
    n = max(8, start // 10) if cfg.distill_eval_conversations is None else cfg.distill_eval_conversations
    return train_convs[:start], eval_convs[:n], train_convs[start : start + cfg.original_conversations]


def distill_variant(cfg: TrainConfig) -> str:
    """The part of a self-distillation cache file's name that tells its answers apart: ``""`` for the first turn,
    greedy, with no system prompt (today's files); else ``"-"`` and 12 hex digits of a hash of the turns, the
    sampling settings and the system prompt, so a run never reads answers written under other settings."""
    settings = (cfg.distill_turns, cfg.distill_temperature, cfg.distill_top_p, cfg.distill_system_prompt)
    if settings == ("first", 0.0, 1.0, None):
        return ""
    return "-" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]


def capture_for(cfg: TrainConfig, target: torch.nn.Module) -> CapturedStates | None:
    """Where self-distillation keeps the target features it computes: None without self-distillation or with
    ``distill_capture_gb`` 0; else what the recipe keeps (:class:`~selfspec.train.recipes.RecipeEntry`: none for
    Medusa-2, whose target is trained, and for EAGLE-3 with ``features: online``; else a store of its layers)."""
    if not cfg.self_distill or cfg.distill_capture_gb == 0:
        return None
    return recipe_for(cfg).capture(cfg, target, int(cfg.distill_capture_gb * 2**30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selfspec train", description=__doc__)
    parser.add_argument("config", nargs="?", help="YAML config (see configs/); omit to use the defaults")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of TrainConfig fields")
    args = parser.parse_args(argv)
    config_path = args.config
    overrides = list(args.overrides)
    if config_path and "=" in config_path and not Path(config_path).exists():
        overrides.insert(0, config_path)
        config_path = None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(config_path, overrides)
        if cfg.target_adapter is not None:  # a missing adapter stops before any compute
            read_adapter_config(cfg.target_adapter)
        if cfg.chat_template is not None:  # so does a missing or unparsable template (rendering: bind_chat_format)
            read_chat_template(cfg.chat_template)
    except UserError:
        raise
    except (ValueError, FileNotFoundError) as err:  # the adapter and template the config names: the user's to fix
        raise UserError(str(err)) from err
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_command("selfspec train", main, sys.argv[1:]))
