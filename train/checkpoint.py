"""Training checkpoints: ``accelerate``'s state (model, optimiser, registered scheduler, RNG states) in a
directory that replaces the previous one by an atomic rename, plus ``trainer_state.json`` (step, seconds,
what the run trained on), so a killed run resumes from its last checkpoint and no half-written checkpoint
is ever read."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)


def save_checkpoint(accelerator: Accelerator, out: Path, step: int, elapsed_s: float, identity: dict[str, Any]) -> None:
    """Write ``accelerator.save_state`` to ``<out>.tmp`` with ``trainer_state.json`` (``step``,
    ``train_elapsed_s``, ``identity``), then rename it to ``out`` (the old one moved aside first and
    removed after). Every process must call it (``save_state`` synchronises them)."""
    tmp = out.with_name(out.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step, "train_elapsed_s": round(elapsed_s, 3), **identity}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def resumable_step(checkpoint: Path, identity: dict[str, Any]) -> int:
    """The step to resume from ``checkpoint``: its recorded step when it exists and was written by a run
    with the same ``identity`` (head family, feature signature), else 0 (a warning names the mismatch)."""
    state_file = checkpoint / "trainer_state.json"
    if not state_file.exists():
        return 0
    state = json.loads(state_file.read_text())
    differs = {k: (state.get(k), v) for k, v in identity.items() if state.get(k) != v}
    if differs:
        logger.warning("checkpoint %s is of another run %s (was, now): starting afresh", checkpoint, differs)
        return 0
    return int(state["step"])
