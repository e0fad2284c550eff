"""Training checkpoints: ``accelerate``'s state (model, optimiser, registered scheduler, RNG states) in a
directory that replaces the previous one by an atomic rename, plus ``trainer_state.json`` (step, seconds,
what the run trained on), so a killed run resumes from its last checkpoint and no half-written checkpoint
is ever read."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from selfspec.base.files import replace_dir

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

BEST_FILE = "best_head.safetensors"


def save_checkpoint(
    accelerator: Accelerator,
    out: Path,
    step: int,
    elapsed_s: float,
    identity: dict[str, Any],
    best: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None,
    trained_tokens: int = 0,
) -> None:
    """Write ``accelerator.save_state`` to ``<out>.tmp`` with ``trainer_state.json`` (``step``,
    ``train_elapsed_s``, ``train_tokens``, ``identity``, and ``best``'s info), then put it at ``out``
    (:func:`~selfspec.base.files.replace_dir`: the old one is swapped out only once the new one is complete).
    Every process must call it (``save_state`` synchronises them).

    Args:
        best: the main process's best head so far, ``(info, state_dict)``: the info goes to
            ``trainer_state.json["best"]``, the tensors to ``best_head.safetensors`` (:func:`resumed_best`).
    """
    tmp = out.with_name(out.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step, "train_elapsed_s": round(elapsed_s, 3), "train_tokens": trained_tokens, **identity}
        if best is not None:
            state["best"] = best[0]
            save_file({k: v.contiguous() for k, v in best[1].items()}, str(tmp / BEST_FILE))
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        replace_dir(tmp, out)
    accelerator.wait_for_everyone()


def resumed_best(checkpoint: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The best head recorded in ``checkpoint`` by :func:`save_checkpoint`: ``(info, state_dict)`` (CPU
    tensors), or None when it holds none."""
    state_file, weights = checkpoint / "trainer_state.json", checkpoint / BEST_FILE
    if not state_file.exists() or not weights.exists():
        return None
    info = json.loads(state_file.read_text()).get("best")
    return (info, load_file(str(weights))) if info else None


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
