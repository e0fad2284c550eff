"""``python -m benchmarks.trainers`` end to end with the real trainers' code: a small selfspec EAGLE-3 run on the
SmolLM2 target, then selfspec, SpecForge and speculators trained again on its data for a tiny token budget, their heads
imported and scored by selfspec's held-out evaluation. Needs both venvs (``python -m selfspec.engine_envs specforge
speculators``); minutes on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.trainers import main
from selfspec.engine_envs import env_works
from tests.helpers.engines import engine_missing

pytestmark = pytest.mark.slow


def test_three_trainers_at_equal_tokens(smollm2, tmp_path):
    for name in ("specforge", "speculators"):
        if not env_works(name):
            engine_missing(f"the {name} venv is not built: python -m selfspec.engine_envs {name}")
    run = tmp_path / "run"
    options = [
        "head=eagle3",
        "target=smollm2-135m-instruct",
        "data=sharegpt",
        "max_conversations=40",
        "eval_fraction=0.2",
        "self_distill=false",
        "max_length=128",
        "draft_vocab_size=1024",
        "max_train_tokens=3000",
        "eval_every=1000",
        "calibrate_prompts=0",
        "threads=2",
        "features=store",
        f"output_dir={run}",
    ]
    subprocess.run([sys.executable, "-m", "selfspec.train", *options], check=True, capture_output=True)
    out = tmp_path / "cmp"
    assert main(["--run", str(run), "--out", str(out), "--max-train-tokens", "1500", "--threads", "2"]) == 0
    report = json.loads((out / "trainers.json").read_text())
    assert list(report["trainers"]) == ["selfspec", "specforge", "speculators"]
    for name, record in report["trainers"].items():
        assert record["trained_tokens"] >= 1500, name
        assert record["source"] == "rerun" and record["cpu_minutes"] > 0
        chain = record["heldout"]["chain"]
        assert len(chain) == 3 and all(0 <= c <= 1 for c in chain) and record["heldout"]["positions"] > 0
        assert (out / name / "heads" / "config.json").is_file()
    for name in ("specforge", "speculators"):
        assert report["trainers"][name]["patches"]
    table = (out / "trainers.md").read_text()
    assert all(f"| {name} |" in table for name in report["trainers"])
