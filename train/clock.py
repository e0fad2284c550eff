"""The training clock and the one learning-rate schedule every recipe uses.

The schedule is linear warmup, then cosine decay (Loshchilov & Hutter 2017, SGDR, without restarts) over
whichever runs out first: the steps, the token budget ``max_train_tokens`` (the tokens the head has trained
on, the same on every machine), or the time cap ``max_train_minutes`` read from the clock, so a run stopped
by either budget still ends with an annealed rate.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from selfspec.train.config import TrainConfig


class TrainClock:
    """Optimisation time of a run in seconds and the tokens it has trained on, counting what the checkpoint it
    resumes from recorded (so both budgets and the annealed LR carry over a kill and resume).

    Args:
        before_s: optimisation seconds already spent by the runs this one resumes (0 for a fresh run).
        before_tokens: tokens already trained on by those runs.

    Attributes:
        tokens: tokens trained on so far (all processes), resumed runs included; the loop adds each step's.
    """

    def __init__(self, before_s: float = 0.0, before_tokens: int = 0) -> None:
        self.before = float(before_s)
        self._t0 = time.perf_counter() - self.before
        self.tokens = int(before_tokens)

    def elapsed(self) -> float:
        """Seconds of optimisation so far, resumed runs included."""
        return time.perf_counter() - self._t0

    def session(self) -> float:
        """Seconds of optimisation in this process only."""
        return self.elapsed() - self.before

    def out_of_time(self, cfg: TrainConfig) -> bool:
        """Whether ``cfg.max_train_minutes`` (if set) has run out."""
        return bool(cfg.max_train_minutes) and self.elapsed() / 60 > cfg.max_train_minutes

    def out_of_tokens(self, cfg: TrainConfig) -> bool:
        """Whether ``cfg.max_train_tokens`` (if set) has been trained on."""
        return bool(cfg.max_train_tokens) and self.tokens >= cfg.max_train_tokens


def resumed_clock(checkpoint: Path) -> TrainClock:
    """The clock of a run resuming ``checkpoint``: the optimisation seconds and trained tokens its
    ``trainer_state.json`` recorded (0 when absent)."""
    path = checkpoint / "trainer_state.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    return TrainClock(float(state.get("train_elapsed_s", 0.0)), int(state.get("train_tokens", 0)))


def lr_factor(cfg: TrainConfig, step: int, total_steps: int, elapsed_s: float, tokens: int = 0) -> float:
    """Learning-rate multiplier for optimiser step ``step`` (0-based) of ``total_steps``.

    Warmup ``(step + 1) / warmup_steps``; then ``0.5 (1 + cos(pi p))`` where p is the share of the decay
    done: by steps ``(step - warmup) / (total - warmup)``, with ``cfg.max_train_tokens`` by trained tokens
    ``tokens / max_train_tokens``, with ``cfg.max_train_minutes`` by time ``elapsed_s / (60 max_train_minutes)``,
    whichever is furthest along. p is capped at 1 (rate 0).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.max_train_tokens:
        progress = max(progress, tokens / cfg.max_train_tokens)
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
        return lr_factor(cfg, step, total_steps, clock.elapsed(), clock.tokens)

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)
