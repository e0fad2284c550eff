"""selfspec/gpu_check.py: the prepared GPU check runs every stage (accelerate launch of the training, the bench
against generate, one JSON of figures) on the CPU with --dry-run, on a tiny saved target."""

from __future__ import annotations

import json

import pytest

from tests.helpers.archs import tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer


@pytest.mark.slow
def test_dry_run_trains_benches_and_writes_every_figure(tmp_path):
    from selfspec.gpu_check import main

    target_dir = tmp_path / "target"
    tiny_target("llama").save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(24)))
    out = tmp_path / "check"
    code = main(["--dry-run", "--target", str(target_dir), "--data", str(data), "--out", str(out)])
    figures = json.loads((out / "gpu_check.json").read_text())
    assert code == 0, (figures.get("error"), (out / "train.log").read_text()[-3000:])
    assert figures["exact"] is True and figures["within_budget"] is True and "error" not in figures
    assert figures["train_command"][:2] == ["accelerate.commands.launch", "--num_processes"]
    assert figures["train"]["step"] == 2 and figures["train"]["heldout_chain_tau"] >= 1.0
    methods = figures["bench"]["methods"]
    assert set(methods) == {"baseline", "no_draft", "eagle3"} and figures["bench"]["reference"] == "baseline"
    for m in ("no_draft", "eagle3"):  # exact against generate (the baseline), and timed
        assert methods[m]["mismatches"] == 0 and methods[m]["median_tokens_per_s"] > 0 and methods[m]["speedup"] > 0
    assert methods["eagle3"]["tau"] >= 1.0
    assert set(figures["seconds"]) == {"target", "train", "bench", "total"}


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_training_run_is_a_valid_config_launched_by_accelerate(tmp_path, dry_run):
    """The GPU run's overrides (bf16, a five-minute clock, the embedded target, the packaged ShareGPT) are keys and
    values the config reader accepts, so the check cannot fail there on a machine with no time to rerun it."""
    from selfspec.gpu_check import build_parser, train_command, training_overrides
    from selfspec.quickstart import default_config
    from selfspec.train.config import load_config

    args = build_parser().parse_args(["--dry-run"] if dry_run else [])
    overrides = training_overrides(args, "smollm2-135m-instruct", tmp_path / "train")
    cfg = load_config(default_config("eagle3"), overrides)
    assert cfg.head == "eagle3" and cfg.output_dir == str(tmp_path / "train")
    if dry_run:
        assert cfg.max_steps == 2 and cfg.dtype == "float32"
    else:
        assert (cfg.dtype, cfg.mixed_precision, cfg.max_train_minutes) == ("bfloat16", "bf16", 5.0)
        assert cfg.max_train_tokens is None and cfg.data == "sharegpt" and cfg.target == "smollm2-135m-instruct"
    command = train_command(args, default_config("eagle3"), overrides)
    assert command[1:3] == ["-m", "accelerate.commands.launch"] and command[-len(overrides) - 3 :][:2] == [
        "-m",
        "selfspec.train",
    ]
    assert ("--cpu" in command) == dry_run and ("bf16" in command) != dry_run


def test_launcher_prints_the_modules_usage():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--help"], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m selfspec.gpu_check"), out.stderr
    assert "--dry-run" in out.stdout
