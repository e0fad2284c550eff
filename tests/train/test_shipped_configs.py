"""configs/: every shipped training config loads, and the full recipe asks for no more conversations than the
packaged ShareGPT holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec.train.config import load_config
from selfspec.train.data import load_conversations

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRAINING = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("accelerate-"))


def test_the_training_configs_are_shipped():
    assert {p.name for p in TRAINING} >= {"eagle3-smollm2.yaml", "eagle3-smollm2-full.yaml", "medusa2-smollm2.yaml"}


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.stem)
def test_config_loads(path):
    cfg = load_config(path)
    assert cfg.data == "sharegpt"
    # the SmolLM2 recipes, and those for served targets (tests/train/test_served_recipes.py) on their Hub ids
    assert (cfg.target == "smollm2-135m-instruct") == ("smollm2" in path.stem)


def test_full_recipe_fits_the_packaged_data():
    full, small = load_config(CONFIGS / "eagle3-smollm2-full.yaml"), load_config(CONFIGS / "eagle3-smollm2.yaml")
    pool = len(load_conversations("sharegpt", max_conversations=full.max_conversations))
    assert pool == full.max_conversations  # the packaged file holds that many usable conversations
    train = pool * (1 - full.eval_fraction)
    assert full.distill_conversations + full.original_conversations <= train * 0.99  # hash split: a margin
    # the same recipe, more of everything: the quickstart's answers are the first ones of the full run's cache
    assert (full.head, full.eagle3, full.lr, full.distill_dir) == (
        small.head,
        small.eagle3,
        small.lr,
        small.distill_dir,
    )
    assert full.max_train_minutes is None and full.distill_conversations > small.distill_conversations
