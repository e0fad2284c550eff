"""Experiment tracking: a run's loss, learning rate and tokens/s, and at each evaluation its held-out acceptance by
depth and chain tau estimate, sent to TensorBoard, Weights & Biases, MLflow or Trackio through ``accelerate``'s
trackers (``Accelerator(log_with=...)``, ``init_trackers``, ``log``, ``end_training``).

``TrainConfig.report_to`` names the tracker (None: none, and nothing here runs). The trackers are optional extras
(``pip install 'selfspec[tensorboard]'`` and so on): a named one that is not installed is refused before any work
(:func:`check_tracker`). Files go under ``<output_dir>/logs/<project>`` for the trackers that write files
(TensorBoard's event files; W&B in offline mode writes to its own ``wandb/`` directory).

Names logged: ``train/loss``, ``train/lr``, ``train/tokens_per_s`` (trained tokens, all processes, per second of
optimisation) at every optimiser step; ``eval/acceptance_depth_<d>`` (the held-out share of positions whose first
``d`` drafts all match the target's greedy tokens), ``eval/chain_tau_estimate`` (:func:`selfspec.train.loop.
chain_tau`) and each scalar the recipe evaluates (``eval/<name>``; a list as ``eval/<name>_<i>``, from 1) at each
evaluation, keyed by the optimiser step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator

# tracker name (accelerate's) -> (the module it imports, the pip extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def check_tracker(report_to: str | None) -> None:
    """Refuse a tracker that is unknown or not installed, before any work.

    Raises:
        ValueError: ``report_to`` is not a key of :data:`TRACKERS`, or its package cannot be imported (the message
            names the pip command).
    """
    if report_to in (None, "none"):
        return
    if report_to not in TRACKERS:
        raise ValueError(f"report_to must be one of {sorted(TRACKERS)} (or null for none), got {report_to!r}")
    module, extra = TRACKERS[report_to]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"report_to: {report_to} needs the {module} package: pip install 'selfspec[{extra}]'")


def accelerator_kwargs(report_to: str | None, output_dir: str | Path) -> dict[str, Any]:
    """The ``Accelerator`` arguments of a run's tracker: ``{}`` without one (None or ``"none"``); else ``log_with``
    and the ``project_dir`` (``<output_dir>/logs``) the file-writing trackers write under."""
    if report_to in (None, "none"):
        return {}
    check_tracker(report_to)
    return {"log_with": report_to, "project_dir": str(Path(output_dir) / "logs")}


def run_config(cfg: Any) -> dict[str, Any]:
    """The config's scalars as tracker hyper-parameters (a flat mapping: a nested section's keys are dotted,
    tuples and None written as text), which every tracker accepts."""
    flat: dict[str, Any] = {}

    def add(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                add(f"{prefix}{f.name}" if not prefix else f"{prefix}.{f.name}", getattr(value, f.name))
        elif isinstance(value, bool | int | float | str):
            flat[prefix] = value
        else:
            flat[prefix] = str(value)

    for f in dataclasses.fields(cfg):
        add(f.name, getattr(cfg, f.name))
    return flat


def start_tracking(accelerator: Accelerator, cfg: Any, project: str) -> None:
    """``accelerator.init_trackers(project, config=run_config(cfg))`` when the run reports to a tracker."""
    if accelerator.log_with:
        accelerator.init_trackers(project, config=run_config(cfg))


def step_scalars(loss: float, lr: float, tokens: int, seconds: float) -> dict[str, float]:
    """What an optimiser step logs: the step's mean loss, the learning rate it used, and the trained tokens per second
    of optimisation so far (``tokens`` over ``seconds``, all processes)."""
    return {"train/loss": float(loss), "train/lr": float(lr), "train/tokens_per_s": tokens / max(seconds, 1e-9)}


def eval_scalars(metrics: Mapping[str, Any], acceptance: Sequence[float] | None, tau: float | None) -> dict[str, float]:
    """What an evaluation logs: ``acceptance`` by depth (``eval/acceptance_depth_1`` ...), the chain ``tau``
    estimate, and the recipe's other numeric metrics (lists one scalar per entry)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in ("acceptance", "chain_tau_estimate"):
            continue
        if isinstance(value, bool | int | float):
            out[f"eval/{key}"] = float(value)
        elif isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
            out.update({f"eval/{key}_{i}": float(v) for i, v in enumerate(value, start=1)})
    for depth, a in enumerate(acceptance or (), start=1):
        out[f"eval/acceptance_depth_{depth}"] = float(a)
    if tau is not None:
        out["eval/chain_tau_estimate"] = float(tau)
    return out


def end_tracking(accelerator: Accelerator) -> None:
    """Close the run's trackers (flushes TensorBoard's event files, finishes a W&B run)."""
    if accelerator.log_with:
        accelerator.end_training()
