"""Host synchronisations of a decode run, counted and attributed to the Python line that caused them.

Two counters, both active only while a :class:`Probe` says the run's steps have begun (the prefill is ignored):

* :func:`count_cuda_syncs`: ``torch.cuda.set_sync_debug_mode("warn")``, every synchronising CUDA operation's
  warning counted by line (CUDA only);
* :func:`count_host_reads`: counters patched into the host reads of tensor values (:data:`HOST_READS`: syncs on a
  GPU when the tensor lives there) and, counted apart, the explicit moves to a device (``Tensor.to(device)``,
  ``torch.tensor(..., device=)``: a pageable host-to-device copy waits for the stream). Works on any device;
  torch is restored on exit.

:func:`count_syncs` runs a function under them and returns the counts per step. Used by
:mod:`benchmarks.gpu_cycle`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType
from typing import Any

import torch

import selfspec.decode

# The directory holding the decode package (the repository root of a checkout): sites under it are written
# relative to it (``decode/host.py:67``), others from their site-packages folder on.
ROOT = Path(selfspec.decode.__file__).resolve().parents[1]
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
MOVES = ("to(device)", "tensor(device=)")
_TRANSPARENT: set[CodeType] = set()


def transparent(fn: Callable) -> Callable:
    """Mark a counting or timing wrapper: a site is the first frame outside the marked functions."""
    _TRANSPARENT.add(fn.__code__)
    return fn


class Probe:
    """Marks where a run's steps begin (e.g. the drafter's first ``propose``): counters and timers ignore the
    prefill before it."""

    def __init__(self) -> None:
        self.in_steps = False


def _short(frame) -> str:
    path = frame.f_code.co_filename
    if path.startswith(str(ROOT)):
        return f"{os.path.relpath(path, ROOT)}:{frame.f_lineno}"
    cut = path.rfind("site-packages/")
    return f"{path[cut + 14 :] if cut >= 0 else os.path.basename(path)}:{frame.f_lineno}"


def where(frame) -> str:
    """``path:line`` of the innermost frame outside the :func:`transparent` wrappers, shortened (relative to
    :data:`ROOT`, or from site-packages), plus ``" <- path:line"`` of the innermost frame under :data:`ROOT`
    when that one is a library's."""
    while frame.f_back is not None and frame.f_code in _TRANSPARENT:
        frame = frame.f_back
    inner, f = _short(frame), frame
    while f is not None and (f.f_code in _TRANSPARENT or not f.f_code.co_filename.startswith(str(ROOT))):
        f = f.f_back
    if f is None or f is frame:
        return inner
    return f"{inner} <- {_short(f)}"


@contextlib.contextmanager
def count_cuda_syncs(probe: Probe, sites: Counter) -> Iterator[None]:
    """Count every synchronising CUDA operation during the steps (``torch.cuda.set_sync_debug_mode("warn")``),
    by the Python line that caused it, into ``sites``."""

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        if not probe.in_steps or "synchroniz" not in str(message):
            return
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.endswith("warnings.py"):
            f = f.f_back
        sites[where(f) if f is not None else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def count_host_reads(probe: Probe, sites: Counter) -> Iterator[None]:
    """Count, during the steps, every host read of tensor values (:data:`HOST_READS`) and every explicit
    move to a device (``Tensor.to(device)``, ``torch.tensor(..., device=)``), by calling line, into
    ``sites`` (keys end with the call's name). Patched on ``torch.Tensor`` and ``torch.tensor`` for the
    duration only."""
    saved: dict[str, tuple[bool, Any]] = {}

    def counted(name: str, orig: Callable) -> Callable:
        @transparent
        def call(self, *args, **kwargs):
            if probe.in_steps:
                sites[f"{where(sys._getframe(1))} {name}"] += 1
            return orig(self, *args, **kwargs)

        return call

    @transparent
    def to(self, *args, **kwargs):
        if probe.in_steps and ("device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[:1])):
            sites[f"{where(sys._getframe(1))} to(device)"] += 1
        return saved["to"][1](self, *args, **kwargs)

    orig_tensor = torch.tensor

    @transparent
    def tensor(*args, **kwargs):
        if probe.in_steps and kwargs.get("device") is not None:
            sites[f"{where(sys._getframe(1))} tensor(device=)"] += 1
        return orig_tensor(*args, **kwargs)

    try:
        for name in (*HOST_READS, "to"):
            saved[name] = (name in torch.Tensor.__dict__, getattr(torch.Tensor, name))
            setattr(torch.Tensor, name, to if name == "to" else counted(name, saved[name][1]))
        torch.tensor = tensor
        yield
    finally:
        torch.tensor = orig_tensor
        for name, (own, orig) in saved.items():
            if own:
                setattr(torch.Tensor, name, orig)
            else:
                delattr(torch.Tensor, name)


def count_syncs(run: Callable[[Probe], int], method: str, probe: Probe | None = None) -> dict[str, Any]:
    """Run ``run(probe)`` (it returns the number of steps it ran) once with the host-read counters on, and
    for ``method == "debug"`` CUDA's sync debug mode too. Returns per step: ``syncs_per_step`` (the debug
    mode's count where it ran, else the host reads), ``host_reads_per_step``, ``device_moves_per_step``,
    and the sites ``{site: count per step}`` of ``sync_sites`` and ``host_read_sites``."""
    probe = probe or Probe()
    probe.in_steps = False
    reads, syncs = Counter(), Counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(count_host_reads(probe, reads))
        if method == "debug":
            stack.enter_context(count_cuda_syncs(probe, syncs))
        steps = max(1, run(probe))
    probe.in_steps = False
    if method != "debug":
        syncs = Counter({k: v for k, v in reads.items() if not k.endswith(MOVES)})
    moves = sum(v for k, v in reads.items() if k.endswith(MOVES))
    return {
        "syncs_per_step": sum(syncs.values()) / steps,
        "host_reads_per_step": (sum(reads.values()) - moves) / steps,
        "device_moves_per_step": moves / steps,
        "sync_sites": {k: v / steps for k, v in syncs.most_common()},
        "host_read_sites": {k: v / steps for k, v in reads.most_common()},
    }
