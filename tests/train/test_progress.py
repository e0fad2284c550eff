"""train/progress.py: the training bar counts toward the budget that stops the run: trained tokens under
``max_train_tokens`` (the budget, or the steps' tokens when the steps run out first), seconds under
``max_train_minutes`` alone, else steps; a resumed run's bar starts where the run is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import selfspec.train.loop as loop
from selfspec.train.clock import TrainClock
from selfspec.train.config import TrainConfig
from selfspec.train.loop import Recipe, StepLoss, train_loop
from selfspec.train.progress import TrainProgress
from tests.helpers.archs import tiny_llama
from tests.helpers.training import fresh_accelerator

TOKENS_PER_STEP = 40  # what the recipe below reports a step trains on
STEPS_PER_EPOCH = 4


class Counted(Recipe):
    """A head of one linear layer, 4 batches an epoch, each step reporting ``TOKENS_PER_STEP`` trained tokens."""

    family = "counted"
    signature = "counted-0"

    def __init__(self) -> None:
        self.target = tiny_llama()  # named by the training record only
        torch.manual_seed(0)
        self.head = torch.nn.Linear(4, 1, bias=False)
        self.x = torch.randn(16, 4)

    def module(self) -> torch.nn.Module:
        return self.head

    def batches(self, epoch: int) -> list[list[int]]:
        return [list(range(16))] * STEPS_PER_EPOCH

    def collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        return {"x": self.x[items]}

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        return StepLoss(((model(batch["x"]) - 1.0) ** 2).mean(), counts={"train_tokens": TOKENS_PER_STEP})

    def evaluate(self) -> dict[str, Any]:
        return {}

    def history(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {}

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        head_dir.mkdir(parents=True, exist_ok=True)
        return {}


class Recorded(TrainProgress):
    """The loop's bar, keeping every bar the loop makes and the (count, total) it showed after each step."""

    made: list[Recorded] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = (self.bar.n, self.bar.total)
        self.shown: list[tuple[float, float]] = []
        Recorded.made.append(self)

    def update(self, step: int, **postfix: str) -> None:
        super().update(step, **postfix)
        self.shown.append((self.bar.n, self.bar.total))


@pytest.fixture
def bars(monkeypatch) -> list[Recorded]:
    Recorded.made = []
    monkeypatch.setattr(loop, "TrainProgress", Recorded)
    return Recorded.made


def train(tmp_path: Path, name: str, **overrides) -> dict:
    cfg = TrainConfig(lr=0.01, warmup_steps=0, eval_every=1000, output_dir=str(tmp_path / name), **overrides)
    train_loop(cfg, fresh_accelerator(), Counted(), [])
    return json.loads((tmp_path / name / "train_summary.json").read_text())


def test_the_bar_counts_tokens_toward_the_token_budget(tmp_path, bars):
    """The quickstart's case: many steps allowed, a token budget that stops the run long before them."""
    summary = train(tmp_path, "tokens", epochs=50, save_every=1000, max_train_tokens=300)
    assert summary["stopped_by"] == "tokens" and summary["step"] == 8  # 8 x 40 = 320 >= 300
    (bar,) = bars
    assert bar.unit == "tokens" and bar.start == (0, 300)
    assert [total for _, total in bar.shown] == [300] * 8  # the budget, never the 200 steps' 8,000 tokens
    assert [n for n, _ in bar.shown] == [40, 80, 120, 160, 200, 240, 280, 300]  # trained tokens, capped at the end


def test_the_bar_counts_the_steps_tokens_when_the_steps_run_out_first(tmp_path, bars):
    summary = train(tmp_path, "steps-first", epochs=2, save_every=1000, max_train_tokens=10_000)
    assert summary["stopped_by"] == "steps" and summary["trained_tokens"] == 8 * TOKENS_PER_STEP
    (bar,) = bars
    assert bar.start == (0, 10_000)  # nothing is known of a step's tokens before the first
    assert bar.shown == [(TOKENS_PER_STEP * s, 8 * TOKENS_PER_STEP) for s in range(1, 9)]


def test_a_resumed_run_starts_its_bar_where_it_is(tmp_path, bars, monkeypatch):
    real_save = loop.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, "resumed", epochs=50, save_every=3, max_train_tokens=300)
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    summary = train(tmp_path, "resumed", epochs=50, save_every=3, max_train_tokens=300)
    assert summary["step"] == 8 and summary["trained_tokens"] == 320
    killed, resumed = bars
    assert killed.shown[-1] == (120, 300) and resumed.start == (120, 300)
    assert [n for n, _ in resumed.shown] == [160, 200, 240, 280, 300]


class StoppedClock(TrainClock):
    """A clock that reads ``now`` seconds."""

    now = 0.0

    def elapsed(self) -> float:
        return self.now


def test_a_time_budget_counts_seconds_and_no_budget_counts_steps():
    clock = StoppedClock()
    timed = TrainProgress(TrainConfig(max_train_minutes=2.0), 1000, 0, clock, "t")
    assert timed.unit == "seconds" and (timed.bar.n, timed.bar.total) == (0, 120)
    clock.now = 30.4
    timed.update(10)
    assert (timed.bar.n, timed.bar.total) == (30, 120)
    clock.now = 45.0
    timed.update(900)  # 900 of 1,000 steps in 45 s: the steps will run out at 50 s, before the 120 s cap
    assert (timed.bar.n, timed.bar.total) == (45, 50)
    steps = TrainProgress(TrainConfig(), 1000, 250, StoppedClock(), "s")
    assert steps.unit == "steps" and (steps.bar.n, steps.bar.total) == (250, 1000)
    steps.update(251)
    assert (steps.bar.n, steps.bar.total) == (251, 1000)
