"""``accelerate launch -m selfspec.train CONFIG.yaml [key=value ...]``: train draft heads on a frozen target."""

from __future__ import annotations

import argparse
import dataclasses
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
from selfspec.base.target import load_target, resolve_target
from selfspec.base.target_shards import shard_target, sync_forwards
from selfspec.train.chat_format import apply_reasoning, bind_chat_format, read_chat_template
from selfspec.train.config import TrainConfig, load_config
from selfspec.train.data import check_data_source, load_conversations, split_conversations
from selfspec.train.distill_states import CapturedStates
from selfspec.train.features import distill_split
from selfspec.train.inputs import RunInputs
from selfspec.train.recipes import recipe_for, warm_started
from selfspec.train.tracking import accelerator_kwargs

logger = logging.getLogger("selfspec.train")


def run(cfg: TrainConfig) -> Path:
    """Run one training job end to end (data -> optional self-distillation -> features -> heads).

    With ``target_parallel: fsdp`` and several processes, the target's decoder layers are sharded across them
    (:func:`~selfspec.base.target_shards.shard_target`) and every stage that runs it ends in lockstep
    (:func:`~selfspec.base.target_shards.sync_forwards`).

    The recipe comes from the registry (:func:`~selfspec.train.recipes.recipe_for`). Self-distillation runs on each
    process's share of the prompts; every process then holds the whole
    data set, and the recipe's loop shards the batches (:mod:`selfspec.train.loop`). The target features
    self-distillation captures (:func:`capture_for`) go to the recipe's feature store.

    Returns:
        The directory holding the trained heads (``<output_dir>/heads``).
    """
    check_data_source(cfg.data)  # a missing or empty data file stops before anything is written
    resolve_target(cfg.target)  # so does an unknown target (an alias is converted here, once, as load_target would)
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
    sharded = cfg.target_parallel == "fsdp" and accelerator.num_processes > 1
    if cfg.target_parallel == "fsdp" and not sharded:
        logger.warning(
            "target_parallel: fsdp with one process: the whole target is held (start with accelerate launch)"
        )
    target, tokenizer = load_target(
        cfg.target,
        dtype=getattr(torch, cfg.dtype),
        device="cpu" if sharded else accelerator.device,  # sharded, each process moves only its shards
        adapter=cfg.target_adapter,
    )
    if sharded:
        shard_target(target, accelerator.device)
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
        quiet = not accelerator.is_local_main_process
        distilled = {}
        for split, part in (("train", to_distill), ("eval", to_distill_eval)):
            distilled[split] = distill_split(
                cfg, target, tokenizer, split, part[rank::world], rank, world, capture, quiet
            )
            sync_forwards(target)  # a sharded target: the processes that are done wait for the others' forwards
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


def capture_for(cfg: TrainConfig, target: torch.nn.Module) -> CapturedStates | None:
    """Where self-distillation keeps the target features it computes: None without self-distillation or with
    ``distill_capture_gb`` 0; else what the recipe keeps (:class:`~selfspec.train.recipes.RecipeEntry`: none for
    Medusa-2, whose target is trained, and for EAGLE-3 with ``features: online``; else a store of its layers)."""
    if not cfg.self_distill or cfg.distill_capture_gb == 0:
        return None
    return recipe_for(cfg).capture(cfg, target, int(cfg.distill_capture_gb * 2**30))


def main(argv: list[str] | None = None) -> int:
    run(command_config(argv))
    return 0


def command_config(argv: list[str] | None, prog: str = "selfspec train", description: str | None = None) -> TrainConfig:
    """The config of a command line ``[CONFIG.yaml] [key=value ...]`` (``selfspec train``, ``selfspec distill``),
    with the files it names checked before any work.

    Raises:
        UserError: a config, override, adapter or chat template the user must fix (the message says what).
    """
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__)
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
    return cfg


if __name__ == "__main__":
    sys.exit(run_command("selfspec train", main, sys.argv[1:]))
