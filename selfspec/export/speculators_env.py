"""The separate environment in which the ``speculators`` package (0.9.0) runs, to prove exports with its own classes.

speculators 0.9.0 pins ``transformers<=5.19`` (selfspec runs 5.24) and pulls torchvision, torchaudio and datasets
that its model classes never import. The environment is a venv under the selfspec build cache
(``<build cache>/envs/speculators``, :func:`~selfspec.base.files.build_cache_root`) made with
``--system-site-packages`` (it reuses this machine's torch 2.13), holding ``speculators==0.9.0`` and
``hs-connectors==0.9.0`` without their dependencies, ``transformers==5.19.0`` (shadowing 5.24 inside the venv only),
``loguru==0.7.3``, and ``openai`` / ``aiohttp`` / ``httpx``, which its package ``__init__`` imports. Built once per
machine (``python -m selfspec.export.speculators_env``; ``.ci/run`` does it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from selfspec.base.files import build_cache_root

__all__ = ["build_env", "env_python"]

PINNED = ("speculators==0.9.0", "hs-connectors==0.9.0", "transformers==5.19.0", "loguru==0.7.3")
WITH_DEPS = ("openai", "aiohttp", "httpx")


def env_python() -> Path:
    """The venv's python (it may not exist yet)."""
    return build_cache_root() / "envs" / "speculators" / "bin" / "python"


def _works(python: Path) -> bool:
    probe = "import transformers, speculators.models; assert transformers.__version__ == '5.19.0'"
    return python.is_file() and subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def build_env() -> Path:
    """Build the environment unless it already imports speculators; returns its python.

    Raises:
        RuntimeError: pip failed (the message holds pip's last output lines).
    """
    python = env_python()
    if _works(python):
        return python
    root = python.parent.parent
    steps = [
        [sys.executable, "-m", "venv", "--system-site-packages", str(root)],
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", *PINNED],
        [str(python), "-m", "pip", "install", "--quiet", *WITH_DEPS],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {(done.stdout + done.stderr)[-2000:]}")
    if not _works(python):
        raise RuntimeError(f"{python} was built but does not import speculators with transformers 5.19.0")
    return python


if __name__ == "__main__":
    print(build_env())
