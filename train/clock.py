"""The training clock and the one learning-rate schedule every recipe uses.

The schedule is linear warmup, then cosine decay (Loshchilov & Hutter 2017, SGDR, without restarts) over
whichever runs out first: the steps, or the time budget ``max_train_minutes`` read from the clock, so a run
stopped by its time budget still ends with an annealed rate on any machine.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from selfspec.train.config import TrainConfig


class TrainClock:
    """Optimisation time of a run in seconds, counting the time recorded by the checkpoint it resumes from
    (so a time budget and a time-annealed LR carry over a kill and resume).

    Args:
        before_s: optimisation seconds already spent by the runs this one resumes (0 for a fresh run).
    """

    def __init__(self, before_s: float = 0.0) -> None:
        self.before = float(before_s)
        self._t0 = time.perf_counter() - self.before

    def elapsed(self) -> float:
        """Seconds of optimisation so far, resumed runs included."""
        return time.perf_counter() - self._t0

    def session(self) -> float:
        """Seconds of optimisation in this process only."""
        return self.elapsed() - self.before

    def out_of_time(self, cfg: TrainConfig) -> bool:
        """Whether ``cfg.max_train_minutes`` (if set) has run out."""
        return bool(cfg.max_train_minutes) and self.elapsed() / 60 > cfg.max_train_minutes


def resumed_elapsed(checkpoint: Path) -> float:
    """Optimisation seconds recorded in a checkpoint's ``trainer_state.json`` (0 when absent)."""
    state = checkpoint / "trainer_state.json"
    return float(json.loads(state.read_text()).get("train_elapsed_s", 0.0)) if state.exists() else 0.0


def lr_factor(cfg: TrainConfig, step: int, total_steps: int, elapsed_s: float) -> float:
    """Learning-rate multiplier for optimiser step ``step`` (0-based) of ``total_steps``.

    Warmup ``(step + 1) / warmup_steps``; then ``0.5 (1 + cos(pi p))`` where p is the share of the decay
    done: by steps ``(step - warmup) / (total - warmup)``, or with ``cfg.max_train_minutes`` by time
    ``elapsed_s / (60 max_train_minutes)`` when that is further along. p is capped at 1 (rate 0).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.max_train_minutes:
        progress = max(progress, elapsed_s / (cfg.max_train_minutes * 60.0))
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_scheduler(
    cfg: TrainConfig, optim: torch.optim.Optimizer, total_steps: int, clock: TrainClock
) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's one scheduler, built once: a ``LambdaLR`` whose lambda reads the step it is given and
    ``clock`` (:func:`lr_factor`), so each ``step()`` sets the rate of the coming optimiser step.

    The lambda is a closure, not a callable object, so the scheduler's ``state_dict`` (saved with the
    checkpoint) holds the step and rates only, never the clock.
    """

    def factor(step: int) -> float:
        return lr_factor(cfg, step, total_steps, clock.elapsed())

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)
