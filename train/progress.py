"""The training progress bar, counted toward the budget that will stop the run.

A run stops at whichever runs out first: its optimiser steps (``epochs`` / ``max_steps``), its token budget
(``max_train_tokens``) or its clock (``max_train_minutes``). A bar of steps misleads a run that tokens or time stop:
the quickstart's showed 2,300 steps and a 51-minute ETA for a run that its token budget stopped at 540 steps. So
the bar counts in the unit of the budget:

* with ``max_train_tokens``: trained tokens (every process's, as :class:`~selfspec.train.clock.TrainClock` counts
  them); the total is the budget, or the tokens the steps will have trained if they run out first (projected
  from the tokens per step so far, so exact at the last step);
* with ``max_train_minutes`` alone: seconds of optimisation, toward the cap or the steps' projected time;
* otherwise optimiser steps.

A resumed run's bar starts where its checkpoint left off (steps, tokens and seconds carry over in the clock).
"""

from __future__ import annotations

import math

from tqdm.auto import tqdm

from selfspec.train.clock import TrainClock
from selfspec.train.config import TrainConfig


class TrainProgress:
    """The ``tqdm`` bar of :func:`~selfspec.train.loop.train_loop`, in the unit of the budget that stops the run.

    Args:
        cfg: the run's config (``max_train_tokens``, ``max_train_minutes``).
        total_steps: the optimiser steps the run may make (epochs and ``max_steps``).
        step: the optimiser step the run starts at (0, or a resumed checkpoint's).
        clock: the run's clock, read at every update (trained tokens, optimisation seconds).
        desc: the bar's label.
        disable: no bar (processes other than the local main one).

    Attributes:
        unit: ``"tokens"``, ``"seconds"`` or ``"steps"``.
        budget: the budget in that unit (the step total for ``"steps"``).
        bar: the ``tqdm`` bar; ``bar.total`` is the smaller of ``budget`` and the steps' projected count.
    """

    def __init__(
        self, cfg: TrainConfig, total_steps: int, step: int, clock: TrainClock, desc: str, disable: bool = False
    ) -> None:
        self.clock, self.total_steps = clock, total_steps
        if cfg.max_train_tokens:
            self.unit, self.budget = "tokens", int(cfg.max_train_tokens)
        elif cfg.max_train_minutes:
            self.unit, self.budget = "seconds", round(cfg.max_train_minutes * 60)
        else:
            self.unit, self.budget = "steps", total_steps
        units = {"tokens": ("tok", True), "seconds": ("s", False), "steps": ("step", False)}
        unit, scale = units[self.unit]
        # seconds a second is no rate: the time bar shows the time counted and left
        timed = "{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}{postfix}]"
        self.bar = tqdm(
            total=self.budget,
            initial=min(round(self._count(step)), self.budget),
            desc=desc,
            unit=unit,
            unit_scale=scale,
            bar_format=timed if self.unit == "seconds" else None,
            disable=disable,
        )

    def _count(self, step: int) -> float:
        """Progress in the bar's unit at optimiser step ``step``."""
        if self.unit == "tokens":
            return self.clock.tokens
        return self.clock.elapsed() if self.unit == "seconds" else step

    def update(self, step: int, **postfix: str) -> None:
        """Show the run at optimiser step ``step`` (>= 1), with ``postfix`` (loss, ...) and, unless the bar counts
        steps, the step count."""
        count = self._count(step)
        if self.unit != "steps":
            if count > 0:  # the steps run out first when their projected count is below the budget
                self.bar.total = min(self.budget, math.ceil(count * self.total_steps / step))
            postfix = {"step": f"{step}/{self.total_steps}", **postfix}
        self.bar.update(min(round(count), self.bar.total) - self.bar.n)
        self.bar.set_postfix(postfix)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()
