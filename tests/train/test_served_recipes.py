"""configs/ recipes for the targets users serve (Llama-3.1-8B, Qwen3-8B, Qwen3-30B-A3B, gpt-oss-20b; EAGLE-3 and DFlash
each, regenerating through vLLM): each loads, names vLLM and a tracker, and trains one step as written (its head,
losses, online features, chat-template kwargs, reasoning setting) on a random model of its architecture shrunk to a
tiny width, with only the sizes, the data and the engine scaled down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfspec.train.__main__ import run
from selfspec.train.config import load_config
from tests.helpers.archs import tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ARCH = {"llama3.1-8b": "llama", "qwen3-8b": "qwen3", "qwen3-30b-a3b": "qwen3_moe", "gpt-oss-20b": "gpt_oss"}
RECIPES = [f"{head}-{name}" for name in ARCH for head in ("eagle3", "dflash")]

SHRUNK = [  # sizes, data and engine for a tiny target on a CPU; everything else as the recipe says
    "self_distill=false",
    "max_length=32",
    "draft_vocab_size=64",
    "max_steps=1",
    "eval_every=1",
    "save_every=1",
    "calibrate_prompts=0",
    "dtype=float32",
    "mixed_precision='no'",
    "report_to=null",
    "eval_fraction=0.2",
    "eagle3.batch_tokens=64",
    "block.batch_tokens=64",
    "block.block_size=4",
    "block.num_layers=1",
    "block.anchors=4",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipes") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(20)))
    return path


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_one_step_on_a_tiny_model_of_its_architecture(recipe, data, tmp_path):
    path = CONFIGS / f"{recipe}.yaml"
    full = load_config(path)
    assert full.distill_engine == "vllm" and full.distill_turns == "all" and full.report_to == "tensorboard"
    assert full.self_distill and full.features == "online" and full.mixed_precision == "bf16"
    target = tmp_path / "target"
    tiny_target(ARCH[recipe.split("-", 1)[1]]).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    cfg = load_config(path, [*SHRUNK, f"target={target}", f"data={data}", f"output_dir={tmp_path / 'run'}"])
    heads = run(cfg)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["step"] == 1 and summary["head"] == full.head
    assert json.loads((heads / "config.json").read_text())["head_type"] == full.head


def test_every_served_recipe_is_tested():
    assert sorted(p.stem for p in CONFIGS.glob("*-*b*.yaml") if "smollm2" not in p.stem) == sorted(RECIPES)
