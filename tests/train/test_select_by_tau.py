"""The head saved is the evaluated one of the highest held-out chain tau estimate, not the last or the lowest
loss: a recipe whose loss falls at every step and whose rigged evaluation peaks at step 3 saves the step-3
head, also after a kill and resume past that step; ``select_head: last`` keeps the last."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from selfspec.train.config import TrainConfig
from selfspec.train.loop import Recipe, StepLoss, chain_tau, train_loop
from tests.helpers.archs import tiny_llama
from tests.helpers.training import fresh_accelerator

# held-out chain (share of chains whose first d drafts all match) after each optimiser step: peaks at step 3
RIGGED = {1: [0.2, 0.05], 2: [0.4, 0.1], 3: [0.6, 0.3], 4: [0.5, 0.2], 5: [0.45, 0.2], 6: [0.3, 0.1]}
RIGGED |= {7: [0.25, 0.1], 8: [0.2, 0.1]}


class Rigged(Recipe):
    family = "rigged"
    signature = "rigged-0"

    def __init__(self) -> None:
        self.target = tiny_llama()  # named by the training record only
        torch.manual_seed(0)
        self.head = torch.nn.Linear(4, 1, bias=False)
        self.steps = 0
        self.snapshots: dict[int, torch.Tensor] = {}
        self.x = torch.randn(16, 4)

    def module(self) -> torch.nn.Module:
        return self.head

    def batches(self, epoch: int) -> list[list[int]]:
        return [list(range(16))] * 4  # the same batch each step: the loss falls at every step

    def collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        return {"x": self.x[items]}

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        self.steps = step + 1  # the optimiser step this batch ends
        return StepLoss(((model(batch["x"]) - 1.0) ** 2).mean())

    def evaluate(self) -> dict[str, Any]:
        self.snapshots.setdefault(self.steps, self.head.weight.detach().clone())
        return {"chain": RIGGED[self.steps]}

    def history(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {"chain": metrics["chain"]}

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        head_dir.mkdir(parents=True, exist_ok=True)
        torch.save(self.head.weight.detach().clone(), head_dir / "w.pt")
        return {}


def train(tmp_path: Path, name: str, **overrides) -> tuple[Rigged, dict, torch.Tensor]:
    recipe = Rigged()
    cfg = TrainConfig(
        lr=0.01, warmup_steps=0, epochs=2, eval_every=1, save_every=4, output_dir=str(tmp_path / name), **overrides
    )
    heads_dir = train_loop(cfg, fresh_accelerator(), recipe, [])
    summary = json.loads((tmp_path / name / "train_summary.json").read_text())
    return recipe, summary, torch.load(heads_dir / "w.pt")


def test_chain_tau_is_one_plus_the_sum_of_products():
    assert chain_tau([]) == 1.0
    assert chain_tau([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_the_head_of_the_highest_tau_estimate_is_saved(tmp_path):
    recipe, summary, saved = train(tmp_path, "a")
    losses = [h["loss"] for h in summary["history"]]
    assert summary["step"] == 8 and losses == sorted(losses, reverse=True)  # the loss falls throughout
    assert summary["selected"] == {
        "by": "chain_tau_estimate",
        "step": 3,
        "chain_tau": 1.9,
        "acceptance": [0.6, 0.5],  # per position: 0.6, then 0.3 / 0.6
    }
    assert [h["chain_tau_estimate"] for h in summary["history"]] == [round(1 + sum(RIGGED[s]), 4) for s in range(1, 9)]
    assert torch.equal(saved, recipe.snapshots[3]) and not torch.equal(saved, recipe.snapshots[8])


def test_a_killed_run_keeps_its_best_head_over_the_resume(tmp_path, monkeypatch):
    import selfspec.train.loop as loop

    ref, _, ref_saved = train(tmp_path, "ref")
    real_save = loop.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, "killed")
    state = json.loads((tmp_path / "killed" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["best"]["step"] == 3
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    resumed, summary, saved = train(tmp_path, "killed")
    assert 3 not in resumed.snapshots  # the resumed process never saw step 3: its head came from the checkpoint
    assert summary["selected"]["step"] == 3 and torch.equal(saved, ref.snapshots[3])


def test_select_head_last_keeps_the_last(tmp_path):
    recipe, summary, saved = train(tmp_path, "last", select_head="last")
    assert "selected" not in summary and torch.equal(saved, recipe.snapshots[8])
