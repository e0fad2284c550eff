"""A user's mistake through the real ``selfspec`` command (``selfspec.cli.main``, the console entry point): one line on
stderr that names the problem and what to do, exit status 2, no traceback, and nothing written. Every case fails
before any model loads, so the module stays fast; ``python -m selfspec`` and ``python -m selfspec.llamacpp --help``
run as subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec import __version__
from selfspec.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding the inputs of every case; the commands' default outputs (``runs/...``) would
    land in it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"turns": ["hi"]\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "ok.jsonl").write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["Hi"]}) + "\n")
    (tmp_path / "bad.yaml").write_text("lr: [0.1\nepochs: 2\n")
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "config.json").write_text(json.dumps({"head_type": "eagle"}))
    return tmp_path


def refused(argv: list[str], capsys, workdir: Path) -> str:
    """Run ``selfspec ARGV``; check exit 2, one stderr line, nothing on stdout, no file made. Returns the line."""
    before = sorted(workdir.rglob("*"))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert out == "" and "Traceback" not in err
    assert sorted(workdir.rglob("*")) == before  # no output folder, no file
    return lines[0]


CASES = {
    "bench-missing-prompts": (
        ["bench", "--prompts", "missing.jsonl"],
        "selfspec bench: error: no such prompt file: missing.jsonl: pass a JSONL file of one JSON object a line",
    ),
    "bench-prompts-not-json": (
        ["bench", "--prompts", "bad.jsonl"],
        "selfspec bench: error: bad.jsonl:1 is not JSON (Expecting ',' delimiter, column 17): write one JSON object",
    ),
    "bench-empty-prompts": (
        ["bench", "--prompts", "empty.jsonl"],
        "selfspec bench: error: empty.jsonl holds no prompts: write one JSON object a line with 'turns'",
    ),
    "bench-no-prompt-left": (
        ["bench", "--prompts", "ok.jsonl", "--num-prompts", "0"],
        "selfspec bench: error: no prompts to run from ok.jsonl: ask for at least one",
    ),
    "bench-unknown-target": (
        ["bench", "--prompts", "ok.jsonl", "--target", "no-such-target"],
        "selfspec bench: error: unknown target 'no-such-target': use a local model directory, a Hub id like",
    ),
    "tune-tree-missing-prompts": (
        ["tune-tree", "--heads", "heads", "--prompts", "missing.jsonl"],
        "selfspec tune-tree: error: no such prompt file: missing.jsonl",
    ),
    "train-yaml-syntax": (
        ["train", "bad.yaml"],
        "selfspec train: error: bad.yaml is not valid YAML at line 2, column 7: expected ',' or ']', but got ':'",
    ),
    "quickstart-yaml-syntax": (
        ["quickstart", "--config", "bad.yaml"],
        "selfspec quickstart: error: bad.yaml is not valid YAML at line 2, column 7",
    ),
    "train-missing-config": (
        ["train", "nowhere.yaml"],
        "selfspec train: error: config file nowhere.yaml does not exist",
    ),
    "train-bad-override": (
        ["train", "lr=[0.1"],
        "selfspec train: error: override 'lr=[0.1' is not YAML (line 1, column 5: expected ',' or ']'",
    ),
    "quickstart-unknown-key": (
        ["quickstart", "learning_rate=0.1"],
        "unknown config keys ['learning_rate']; valid keys: ['",
    ),
    "quickstart-bad-override": (
        ["quickstart", "epochs=[1"],
        "selfspec quickstart: error: override 'epochs=[1' is not YAML (line 1, column 3",
    ),
    "quickstart-bad-type": (
        ["quickstart", "epochs=many"],
        "epochs must be an integer, got 'many'",
    ),
    "train-empty-data": (
        ["train", "data=empty.jsonl", "output_dir=out"],
        "selfspec train: error: data file empty.jsonl is empty: put conversations in it",
    ),
    "train-missing-data": (
        ["train", "data=missing.jsonl", "output_dir=out"],
        "selfspec train: error: no such data file: missing.jsonl",
    ),
    "train-unknown-target": (
        ["train", "target=no-such-target", "output_dir=out"],
        "selfspec train: error: unknown target 'no-such-target': use a local model directory",
    ),
    "train-sharded-target-online": (
        ["train", "target_parallel=fsdp", "features=online", "output_dir=out"],
        "selfspec train: error: target_parallel: fsdp reads features from the store",
    ),
    "train-sharded-target-medusa2": (
        ["train", "target_parallel=fsdp", "medusa.joint=true", "output_dir=out"],
        "selfspec train: error: medusa.joint (Medusa-2) trains the target, which target_parallel shards frozen",
    ),
    "train-unknown-target-parallel": (
        ["train", "target_parallel=tp2", "output_dir=out"],
        "selfspec train: error: target_parallel must be one of ['none', 'fsdp'], got 'tp2'",
    ),
    "export-unknown-format": (
        ["export", "heads", "--format", "onnx", "--out", "out", "--target", "t"],
        "selfspec export: error: unknown export format 'onnx'; choose one of",
    ),
    "import-unknown-format": (
        ["import", "heads", "--format", "gguf", "--out", "out", "--target", "t"],
        "selfspec import: error: unknown import format 'gguf'",
    ),
    "export-unknown-target": (
        ["export", "heads", "--format", "sglang", "--out", "out", "--target", "./nowhere"],
        "selfspec export: error: cannot load the target './nowhere'",
    ),
    "unknown-command": (["serve"], "selfspec: error: unknown command 'serve'; choose one of train, bench"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_is_one_line_on_stderr_exit_2_and_nothing_written(case, workdir, capsys):
    argv, expected = CASES[case]
    line = refused(argv, capsys, workdir)
    assert line.startswith(expected) if expected.startswith("selfspec") else expected in line, line


def test_push_errors_go_to_stderr(workdir, capsys):
    line = refused(["push", "heads", "alice/m", "--dry-run"], capsys, workdir)  # a config.json of no selfspec head
    assert line.startswith("selfspec push: error: ") and "config.json lacks its 'selfspec' object" in line, line


# Every range of a number in the training config, with the message that gives it (before any output folder).
RANGES = {
    "lr=-1": "lr must be > 0, got -1.0",
    "lr=0": "lr must be > 0, got 0.0",
    "epochs=0": "epochs must be >= 1, got 0",
    "warmup_steps=-5": "warmup_steps must be >= 0, got -5",
    "eval_every=0": "eval_every must be >= 1, got 0",
    "grad_clip=-1": "grad_clip must be >= 0, got -1.0",
    "max_length=0": "max_length must be >= 1, got 0",
    "threads=-3": "threads must be >= 1 (null: torch's default), got -3",
    "betas=[2,3]": "betas must be in [0, 1), got (2.0, 3.0)",
    "draft_vocab_size=0": "draft_vocab_size must be >= 1 (null: the full vocabulary), got 0",
    "max_train_minutes=-1": "max_train_minutes must be > 0 (null: no clock), got -1.0",
    "eagle.batch_tokens=0": "eagle.batch_tokens must be >= 1, got 0",  # a section's field: its path
    "medusa.num_heads=0": "medusa.num_heads must be >= 1, got 0",
}


@pytest.mark.parametrize("override", list(RANGES))
@pytest.mark.parametrize("command", ["train", "quickstart"])
def test_config_numbers_are_refused_with_their_range_before_any_output(command, override, workdir, capsys):
    line = refused([command, override, "output_dir=out", "target=no-such-target"], capsys, workdir)
    assert line.startswith(f"selfspec {command}: error: ") and line.endswith(f" {RANGES[override]}"), line


def test_python_dash_m_selfspec_and_version():
    run = [sys.executable, "-m", "selfspec", "--version"]
    done = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, f"selfspec {__version__}", "")


def test_llamacpp_help_prints_help_and_builds_nothing(tmp_path):
    env = {"SELFSPEC_LLAMA_CPP": str(tmp_path / "none"), "PATH": "", "HOME": str(tmp_path)}
    run = [sys.executable, "-m", "selfspec.llamacpp", "--help"]
    done = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m selfspec.llamacpp") and "building" not in done.stdout
    assert list(tmp_path.iterdir()) == []
