"""scripts/: the launchers run the package's commands (their usage lines, the config error, under accelerate), the
configs the training examples name exist, and the bench examples parse."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # the scripts run the selfspec command in new processes (about 8 s each here)


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.parametrize(
    ("script", "usage", "flag"),
    [("train.py", "usage: selfspec train", "overrides"), ("bench.py", "usage: selfspec bench", "--prompts")],
)
def test_script_help_is_the_package_command(script, usage, flag):
    out = _run(sys.executable, f"scripts/{script}", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(usage) and flag in out.stdout


def test_train_script_refuses_an_unknown_config_key():
    out = _run(sys.executable, "scripts/train.py", "configs/eagle3-smollm2.yaml", "no_such_key=1")
    assert out.returncode == 2 and out.stderr.startswith("selfspec train: error: ")
    assert "unknown config keys ['no_such_key']" in out.stderr and "valid keys" in out.stderr
    assert "max_train_tokens" in out.stderr  # the message lists the keys to choose from


def test_train_script_examples_name_configs_that_exist():
    configs = re.findall(r"configs/[\w.-]+\.yaml", (ROOT / "scripts" / "train.py").read_text())
    assert configs
    for path in configs:
        assert (ROOT / path).is_file(), path


def test_bench_script_examples_parse():
    """Each example command in scripts/bench.py's docstring (continuation lines joined) is one the bench parser takes
    (an unknown flag or a missing value exits with status 2 and fails the test)."""
    from selfspec.bench.cli import build_parser

    doc = (ROOT / "scripts" / "bench.py").read_text().replace("\\\n", " ")
    lines = [line for line in doc.splitlines() if line.startswith("    python scripts/bench.py ")]
    runs = [shlex.split(line.split("scripts/bench.py", 1)[1]) for line in lines]
    assert len(runs) == 3
    for argv in runs:
        build_parser().parse_args(argv)


def test_train_script_under_accelerate_launch():
    """``accelerate launch scripts/train.py ...``, the command the script's docstring gives, reaches the same parser."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    out = _run(*launch, "scripts/train.py", "configs/medusa-smollm2.yaml", "no_such_key=1", timeout=300)
    assert out.returncode != 0
    assert "unknown config keys ['no_such_key']" in out.stderr
