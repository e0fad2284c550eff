"""The engine proofs' one decision when an engine is not there: skip, or fail under CI.

The export proofs run the engines themselves (the speculators package in its own venv, a llama.cpp build).
Where one cannot be had, a developer's run skips its proof with the command that provides it; ``.ci/run``
sets ``SELFSPEC_REQUIRE_ENGINES=1`` after building both, and then a missing engine fails the test, so a green
CI means the engines judged the exports.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

REQUIRE = "SELFSPEC_REQUIRE_ENGINES"


def engines_required() -> bool:
    """Whether ``$SELFSPEC_REQUIRE_ENGINES`` is ``1`` (as ``.ci/run`` sets it)."""
    return os.environ.get(REQUIRE, "") == "1"


def engine_missing(reason: str) -> NoReturn:
    """Skip the calling test (or fixture) because an engine is missing, or fail it when engines are required.

    Args:
        reason: what is missing and the command that provides it.

    Raises:
        pytest.fail.Exception: under ``SELFSPEC_REQUIRE_ENGINES=1``.
        pytest.skip.Exception: otherwise.
    """
    if engines_required():
        pytest.fail(f"{reason} ({REQUIRE}=1: every engine proof must run)", pytrace=False)
    pytest.skip(reason)


def run_engine_script(python: Path, script: str, export_dir: Path, io: dict[str, Any], work: Path, *args: str) -> Any:
    """Run ``script`` with an engine's own Python (offline, nothing of this environment on its path) as
    ``python run.py EXPORT_DIR IO.pt OUT.pt *args`` and return what it saved in ``OUT.pt``.

    Args:
        python: the engine venv's interpreter.
        script: the program; it reads ``sys.argv[1:]`` as above.
        export_dir: the exported head.
        io: tensors for the script (saved with ``torch.save``).
        work: a scratch directory.

    Raises:
        AssertionError: the script failed (with the end of its stderr).
    """
    torch.save(io, work / "io.pt")
    (work / "run.py").write_text(script)
    cmd = [str(python), str(work / "run.py"), str(export_dir), str(work / "io.pt"), str(work / "out.pt"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(work / "out.pt")
