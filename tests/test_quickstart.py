"""The quickstart's shipped configs: found from a checkout and as package data, and valid."""

from importlib import resources

import pytest

from selfspec.quickstart import default_config
from selfspec.train.config import load_config


@pytest.mark.parametrize("head", ["eagle", "medusa"])
def test_shipped_configs_load_and_share_data_and_budget(head):
    path = default_config(head)
    assert path.is_file()
    packaged = resources.files("selfspec.configs") / path.name  # what a wheel install reads
    assert packaged.is_file() and packaged.read_text() == path.read_text()
    cfg = load_config(path)
    assert cfg.head == head
    # EAGLE vs Medusa is compared on the same data and the same time budget (issue: "same wall-clock budget")
    other = load_config(default_config("medusa" if head == "eagle" else "eagle"))
    for key in ("distill_conversations", "original_conversations", "max_train_minutes", "max_length", "seed",
                "draft_vocab_size", "data", "eval_fraction"):
        assert getattr(cfg, key) == getattr(other, key), key
    assert isinstance(cfg.lr, float) and cfg.max_train_minutes and cfg.max_train_minutes < 30
