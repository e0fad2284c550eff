"""The one training loop every head recipe runs: setup -> optimise (the head only) -> save.

A recipe (:class:`Recipe`) supplies its head, its batches, its loss step and its evaluation; this module
supplies the rest, the same for every head family:

* AdamW over the head's trainable parameters and one scheduler built once (:func:`~selfspec.train.clock.
  make_scheduler`: warmup + cosine by steps or by the clock of ``max_train_minutes``);
* batches through a ``torch.utils.data.DataLoader`` whose batch sampler (:class:`EpochBatches`) draws
  each epoch's batches from a seed and the epoch number; ``accelerator.prepare`` shards them across
  processes and places them on the device, and DDP averages the gradients;
* gradient accumulation over ``grad_accum_steps`` batches per optimiser step and autocast (bf16) through
  ``accelerate``; every step count is of optimiser steps;
* checkpoints every ``save_every`` steps (:mod:`selfspec.train.checkpoint`: ``accelerate`` state, atomic
  rename); a killed run resumes at its last checkpoint, on the same batches, and ends with the same head
  as an unbroken run;
* held-out evaluation every ``eval_every`` steps with per-position acceptance and the chain tau estimate
  (:func:`chain_tau`); the head saved is the one of the highest estimate (``select_head: tau``), not the
  lowest loss, since a draft's loss can keep falling while its acceptance falls;
* the progress bar, in the unit of the budget that stops the run (:mod:`selfspec.train.progress`), and the
  experiment tracker of ``report_to`` (:mod:`selfspec.train.tracking`: loss, learning rate, tokens/s, held-out
  acceptance by depth and the chain tau estimate);
* the time budget, ``<output_dir>/train_summary.json`` and
  ``<heads>/training_record.json`` (:mod:`selfspec.train.record`);
* the draft vocabulary's choice from token counts (:func:`draft_vocabulary`).
"""

from __future__ import annotations

import abc
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.heads.config import draft_vocab_from_counts
from selfspec.train.checkpoint import resumable_step, resumed_best, save_checkpoint
from selfspec.train.clock import TrainClock, make_scheduler, resumed_clock
from selfspec.train.config import TrainConfig
from selfspec.train.progress import TrainProgress
from selfspec.train.record import RECORD_FILE, training_record
from selfspec.train.tracking import end_tracking, eval_scalars, start_tracking, step_scalars

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass
class StepLoss:
    """One optimiser step's loss and what to report of it.

    Attributes:
        loss: float32 scalar with a graph to the head's parameters.
        logs: scalars or lists of scalars (already rounded) for the history and the progress bar.
        counts: items this process trained on in the step (``{"positions": 256}``), summed over the run into
            ``<name>_per_s`` rates in the summary.
    """

    loss: torch.Tensor
    logs: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


class Recipe(abc.ABC):
    """What a head family supplies to :func:`train_loop`.

    Attributes (set by the subclass): ``family`` (``"medusa"``, ``"eagle"``), ``cfg`` (the run's config),
    ``target`` (the frozen target), ``signature`` (of the features it trains on,
    :func:`~selfspec.train.feature_store.feature_signature`; a checkpoint of other features is not resumed).
    """

    family: str
    cfg: TrainConfig
    target: PreTrainedModel
    signature: str

    def epoch_seed(self, epoch: int) -> int:
        """The seed of epoch ``epoch``'s batches: a pure function of ``cfg.seed`` and the epoch, so a resumed run
        replays them."""
        return self.cfg.seed * 1000 + epoch * 7

    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """The trained module: the head, or a wrapper whose ``forward`` is one step's whole forward (so DDP
        sees one forward per backward). Called once."""

    @abc.abstractmethod
    def batches(self, epoch: int) -> list[list[Any]]:
        """Epoch ``epoch``'s batches over all processes, each a list of items for :meth:`collate`; a pure
        function of the epoch (and the seed), so resume replays them exactly."""

    @abc.abstractmethod
    def collate(self, items: list[Any]) -> dict[str, torch.Tensor]:
        """One batch of tensors (on CPU; ``accelerate`` moves it to the device)."""

    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        """The loss of one optimiser step; ``model`` is :meth:`module` as ``accelerate`` prepared it."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, Any]:
        """Held-out metrics of the head now (runs on the main process only)."""

    @abc.abstractmethod
    def history(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The part of :meth:`evaluate`'s metrics that goes into each history record."""

    def acceptance(self, metrics: dict[str, Any]) -> list[float] | None:
        """Held-out per-position acceptance ``[a_1, ..., a_d]`` of :meth:`evaluate`'s metrics: ``a_i`` the share
        of drafts at depth i the target accepts given the first i - 1 were accepted, from which
        :func:`chain_tau` ranks checkpoints. Default: from a ``"chain"`` entry (EAGLE, EAGLE-3: ``chain[i-1]``
        the share of chains whose first i drafts all match), ``a_i = chain[i-1] / chain[i-2]``; None when the
        metrics have none (the last head is kept)."""
        chain = metrics.get("chain")
        if not chain:
            return None
        return [c / p if p > 0 else 0.0 for c, p in zip(chain, [1.0, *chain[:-1]], strict=True)]

    @abc.abstractmethod
    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        """Save the trained head to ``head_dir`` (main process only) and return the summary's recipe part;
        a ``"calibration_ids"`` entry (the conversations a post-training calibration decoded) goes to the
        training record instead."""


class EpochBatches(torch.utils.data.Sampler):
    """A batch sampler yielding ``num_batches`` batches of ``make(epoch)`` (cycling if it has fewer), with
    ``set_epoch`` as ``accelerate`` expects of a sampler.

    Args:
        make: ``epoch -> [batch, ...]``, each batch a list of dataset items.
        num_batches: batches per epoch (the loop makes it a multiple of the process count).
    """

    def __init__(self, make: Callable[[int], list[list[Any]]], num_batches: int) -> None:
        self.make, self.num_batches, self.epoch = make, num_batches, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[Any]]:
        batches = self.make(self.epoch)
        for i in range(self.num_batches):
            yield batches[i % len(batches)]


def chain_tau(acceptance: list[float]) -> float:
    """The greedy chain tau estimate of per-position acceptance ``[a_1, ..., a_d]``: the expected tokens per
    verification step of a chain of d drafts, ``1 + sum_i prod_{j <= i} a_j`` (the bonus token included; Leviathan
    et al. 2023, arXiv:2211.17192, with position-dependent acceptance)."""
    tau, run = 1.0, 1.0
    for a in acceptance:
        run *= float(a)
        tau += run
    return tau


def draft_vocabulary(counts: torch.Tensor, size: int | None) -> torch.Tensor | None:
    """The draft vocabulary of a head: the ``size`` (S) most frequent target token ids of ``counts`` (Long
    ``[V]``, how often each token is a training label), as Long ``[S]`` (:func:`~selfspec.heads.config.
    draft_vocab_from_counts`); None (the full vocabulary) when ``size`` is None or at least V. The counts come
    from the whole data set, so every process chooses the same vocabulary."""
    V = counts.numel()
    if not size or size >= V:
        return None
    return draft_vocab_from_counts(counts, size)


class _Items(torch.utils.data.Dataset):
    """A dataset whose item ``i`` is ``i`` itself: batches are built by the recipe's ``collate``."""

    def __getitem__(self, item: Any) -> Any:
        return item


def train_loop(cfg: TrainConfig, accelerator: Accelerator, recipe: Recipe, heldout_ids: list[str]) -> Path:
    """Train ``recipe``'s head and save it to ``<output_dir>/heads``; returns that directory.

    Uses ``cfg.lr``, ``betas``, ``weight_decay``, ``warmup_steps``, ``grad_clip``, ``epochs`` / ``max_steps``
    / ``max_train_minutes``, ``eval_every`` / ``save_every``, ``output_dir``, ``grad_accum_steps``: each
    optimiser step sums the gradients of that many of the recipe's batches (``accelerator.accumulate``; the
    loss of each divided by it), and every count here (steps, schedule, cadence, checkpoints) is of
    optimiser steps. Each loss runs under ``accelerator.autocast()`` (bf16 with ``mixed_precision: bf16``,
    set on the ``Accelerator`` by :mod:`selfspec.train.__main__`). ``heldout_ids`` (the held-out
    split's conversation ids, in split order) go to the training record.

    Raises:
        ValueError: the recipe has no batch.
    """
    out_dir = Path(cfg.output_dir)
    ckpt = out_dir / "checkpoint"
    world = accelerator.num_processes
    accum = cfg.grad_accum_steps
    accelerator.gradient_accumulation_steps = accum  # accumulate() syncs, and backward() divides, by it
    identity = {"head": recipe.family, "features": recipe.signature}
    if accum > 1:  # a step of another accumulation is another step (absent at 1: older checkpoints resume)
        identity["grad_accum_steps"] = accum
    module = recipe.module()
    # a warm start (init_heads): the held-out figures of the head it starts from, measured before any step (and
    # before a resumed run loads its checkpoint), so the summary says what training changed and selection can keep it
    initial = recipe.evaluate() if cfg.init_heads is not None and accelerator.is_main_process else None
    params = [p for p in module.parameters() if p.requires_grad]
    # fused AdamW: one kernel instead of ~10 elementwise passes per step (+20 % tokens/s on 2 CPU cores)
    fused = accelerator.device.type in ("cpu", "cuda")
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)
    n_batches = len(recipe.batches(0))
    if n_batches == 0:
        raise ValueError("no training batch: check the data source and max_length")
    # whole optimiser steps on every process: micro-batches per epoch a multiple of processes x accumulation
    per_step = world * accum
    sampler = EpochBatches(recipe.batches, max(per_step, n_batches // per_step * per_step))
    loader = torch.utils.data.DataLoader(_Items(), batch_sampler=sampler, collate_fn=recipe.collate)
    model, prepared_optim, loader = accelerator.prepare(module, optim, loader)
    steps_per_epoch = len(loader) // accum  # optimiser steps
    total = min(steps_per_epoch * cfg.epochs, cfg.max_steps or steps_per_epoch * cfg.epochs)

    step = resumable_step(ckpt, identity)
    clock = resumed_clock(ckpt) if step else TrainClock()
    sched = make_scheduler(cfg, optim, total, clock)
    accelerator.register_for_checkpointing(sched)  # stepped once per optimiser step, by this loop
    if step:
        accelerator.load_state(str(ckpt))
        logger.info("resumed from %s at step %d", ckpt, step)

    best = resumed_best(ckpt) if step else None  # (info {"step", "chain_tau", "acceptance"}, head state)

    def estimate(at: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """``{"step", "chain_tau", "acceptance"}`` of the head's held-out metrics; None without a ranking."""
        acc = recipe.acceptance(metrics) if cfg.select_head == "tau" else None
        if acc is None:
            return None
        return {"step": at, "chain_tau": round(chain_tau(acc), 4), "acceptance": [round(a, 4) for a in acc]}

    def consider(at: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """The tau estimate of the head now, kept as the best when it beats the best so far (main process)."""
        nonlocal best
        info = estimate(at, metrics)
        if info is None:
            return {}
        if best is None or info["chain_tau"] > best[0]["chain_tau"]:
            best = (info, {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()})
        return {"acceptance": info["acceptance"], "chain_tau_estimate": info["chain_tau"]}

    quiet = not accelerator.is_local_main_process
    start_tracking(accelerator, cfg, f"selfspec-{recipe.family}")
    hist: list[dict[str, Any]] = []
    if initial is not None and not step:  # step 0 of a warm start: a candidate like any evaluated head
        hist.append({"step": 0, **recipe.history(initial), **consider(0, initial)})
    counts: dict[str, int] = {}
    bar = TrainProgress(cfg, total, step, clock, f"train {recipe.family}", disable=quiet)
    model.train()
    stop, stopped_by = False, "steps"
    while step < total and not stop:
        epoch, within = divmod(step, steps_per_epoch)
        epoch_loader = accelerator.skip_first_batches(loader, within * accum) if within else loader
        epoch_loader.set_epoch(epoch)
        sampler.set_epoch(epoch)
        micro, losses = 0, []
        for batch in epoch_loader:
            with accelerator.accumulate(model), accelerator.autocast():
                # the micro-batch index: the optimiser step itself without accumulation
                out = recipe.loss(model, batch, step * accum + micro)
                accelerator.backward(out.loss)
            micro, losses = micro + 1, [*losses, out.loss.detach().float()]
            for key, n in out.counts.items():
                counts[key] = counts.get(key, 0) + int(n)
            clock.tokens += int(out.counts.get("train_tokens", 0)) * world  # every process trains as many
            if not accelerator.sync_gradients:
                continue
            used_lr = float(sched.get_last_lr()[0])
            if cfg.grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            prepared_optim.step()
            sched.step()
            prepared_optim.zero_grad(set_to_none=True)
            step += 1
            loss = round(float(torch.stack(losses).mean()), 4)
            micro, losses = 0, []
            bar.update(step, loss=f"{loss:.3f}", **{k: f"{v:.3f}" for k, v in out.logs.items() if isinstance(v, float)})
            accelerator.log(step_scalars(loss, used_lr, clock.tokens, clock.elapsed()), step=step)
            if (step % cfg.eval_every == 0 or step == total) and accelerator.is_main_process:
                raw = recipe.evaluate()
                metrics = {**recipe.history(raw), **consider(step, raw)}
                hist.append({"step": step, "loss": loss, **out.logs, **metrics, "lr": used_lr})
                logger.info("step %d %s", step, json.dumps({k: v for k, v in hist[-1].items() if k != "step"}))
                if accelerator.log_with:
                    acc = recipe.acceptance(raw)
                    tau = chain_tau(acc) if acc else None
                    accelerator.log(eval_scalars(recipe.history(raw), acc, tau), step=step)
            if step % cfg.save_every == 0 and step < total:
                save_checkpoint(accelerator, ckpt, step, clock.elapsed(), identity, best, clock.tokens)
            if clock.out_of_tokens(cfg):
                logger.info("max_train_tokens reached at step %d (%d tokens)", step, clock.tokens)
                stopped_by, stop = "tokens", True
            elif clock.out_of_time(cfg):
                logger.info("max_train_minutes reached at step %d (%d tokens)", step, clock.tokens)
                stopped_by, stop = "clock", True
            if stop or step >= total:
                break
    bar.close()
    elapsed = clock.session()
    final_dir = out_dir / "heads"
    if accelerator.is_main_process:
        metrics = recipe.evaluate()
        if not hist or hist[-1]["step"] != step:
            consider(step, metrics)
        if best is not None and best[0]["step"] != step:
            info = best[0]
            logger.info("saving the head of step %d (chain tau estimate %.3f)", info["step"], info["chain_tau"])
            module.load_state_dict(best[1])
            metrics = recipe.evaluate()
        extras = recipe.save(metrics, final_dir)
        calibration_ids = extras.pop("calibration_ids", [])
        rates = {f"{k}_per_s": round(n * world / max(elapsed, 1e-9), 1) for k, n in counts.items()}
        totals = {f"{k}_total": n * world for k, n in counts.items()}
        summary = {
            "head": recipe.family,
            "step": step,
            "train_s": round(elapsed, 1),
            # what ended training: "tokens" (max_train_tokens), "clock" (the max_train_minutes cap), "steps"
            "stopped_by": stopped_by,
            "trained_tokens": clock.tokens,
            "max_train_tokens": cfg.max_train_tokens,
            "max_train_minutes": cfg.max_train_minutes,
            **({"selected": {"by": "chain_tau_estimate", **best[0]}} if best is not None else {}),
            # init_heads: the held-out estimate of the head the run started from
            **({"initial": estimate(0, initial)} if initial is not None else {}),
            **rates,
            **totals,
            **extras,
            "history": hist,
        }
        (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
        record = training_record(cfg, recipe.family, recipe.target, heldout_ids, calibration_ids)
        (final_dir / RECORD_FILE).write_text(json.dumps(record, indent=2))
        logger.info("saved the %s head to %s", recipe.family, final_dir)
    end_tracking(accelerator)
    accelerator.wait_for_everyone()
    return final_dir
