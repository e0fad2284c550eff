"""The written-down patches that let other projects' EAGLE-3 trainers run on a CPU, applied to a copy of their code.

The rule: a trainer's code is changed only where it names a GPU device or a GPU kernel; everything else (the model,
the loss, the data order, the optimiser, the schedule) is its own. Each :class:`Patch` replaces one exact piece of
text of one file of the installed package and says why; :func:`patched_copy` copies the package out of its venv,
applies every patch (an upstream change that moves the text is an error naming the patch, never a silent skip) and
returns the directory to put first on ``PYTHONPATH``. The installed package is never touched.

Settings the trainers offer as options (attention implementation, loss implementation, dtype, data-loader workers)
are chosen in :mod:`benchmarks.trainer_runs`, not patched.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from selfspec.engine_envs import env_python


@dataclass(frozen=True)
class Patch:
    """One exact text replacement in a trainer's package.

    Attributes:
        path: the file, relative to the package directory.
        old: the text replaced; it must occur exactly ``count`` times.
        new: what replaces it.
        reason: why (a GPU device or kernel, named).
        count: occurrences of ``old`` (all are replaced).
        to_end: replace from ``old`` to the end of the file instead (``old`` must occur once).
    """

    path: str
    old: str
    new: str
    reason: str
    count: int = 1
    to_end: bool = False


_SPECFORGE_LOSS = '''class LogSoftmaxLoss:
    """selfspec's CPU patch: the reference loss of this file (``_compute_loss``, the same
    ``-mean(sum(mask * p * log_softmax(logits)))`` the Triton kernels compute) in plain torch."""

    @staticmethod
    def apply(logits, target, position_mask):
        return _compute_loss(logits, target, position_mask)
'''

SPECFORGE_PATCHES: tuple[Patch, ...] = (
    Patch(
        "core/loss.py",
        "import triton\nimport triton.language as tl\n",
        "",
        "Triton compiles GPU kernels only; the file's Triton loss kernels are dropped below",
    ),
    Patch(
        "core/loss.py",
        "@torch.compile(dynamic=None)\ndef _compute_loss(",
        "def _compute_loss(",
        "torch.compile generates a device kernel for the reference loss; eager computes the same function",
    ),
    Patch(
        "core/loss.py",
        "def _calculate_settings(n):",
        _SPECFORGE_LOSS,
        "the Triton forward/backward kernels of LogSoftmaxLoss need a GPU: the file's own reference loss instead",
        to_end=True,
    ),
)
"""SpecForge 0.2.0 (``specforge/``): its offline EAGLE-3 path runs on a CPU once the Triton loss is swapped for the
plain-torch reference in the same file (``specforge/core/loss.py``)."""

SPECULATORS_PATCHES: tuple[Patch, ...] = (
    Patch(
        "train/trainer.py",
        'self.device_type = acc.type if acc is not None else "cuda"',
        'self.device_type = acc.type if acc is not None else "cpu"',
        "the trainer falls back to the CUDA device type (autocast) when no accelerator exists",
    ),
    Patch(
        "train/trainer.py",
        "self.model.to(self.local_rank)",
        'self.model.to("cpu")',
        "the model is moved to the GPU of the local rank",
        count=2,
    ),
    Patch(
        "train/trainer.py",
        "v.to(self.local_rank, non_blocking=True)",
        'v.to("cpu", non_blocking=True)',
        "each batch is moved to the GPU of the local rank",
        count=2,
    ),
    Patch(
        "train/trainer.py",
        "            torch.accelerator.synchronize()\n",
        "            if torch.accelerator.is_available():\n                torch.accelerator.synchronize()\n",
        "the step timer synchronises the accelerator, which raises when there is none",
    ),
    Patch(
        "train/trainer.py",
        "        torch.accelerator.synchronize()\n        return time.perf_counter()",
        "        if torch.accelerator.is_available():\n            torch.accelerator.synchronize()\n"
        "        return time.perf_counter()",
        "the step timer synchronises the accelerator, which raises when there is none",
    ),
    Patch(
        "utils/util.py",
        '    if acc is None:\n        return "cuda:0"',
        '    if acc is None:\n        return "cpu"',
        "checkpoints are loaded onto cuda:0 when no accelerator exists",
    ),
)
"""speculators 0.9.0 (``speculators/``): device names in its trainer and checkpoint loader."""

PATCHES: dict[str, tuple[str, tuple[Patch, ...]]] = {
    "specforge": ("specforge", SPECFORGE_PATCHES),
    "speculators": ("speculators", SPECULATORS_PATCHES),
}
"""Per trainer: ``(package name, patches)``; the venv is the trainer's name (:mod:`selfspec.engine_envs`)."""


def apply_patches(package_dir: Path, patches: tuple[Patch, ...]) -> list[dict[str, str]]:
    """Apply ``patches`` in order to the package copy at ``package_dir``; returns what was done (path and reason).

    Raises:
        RuntimeError: a patch's text is not found exactly as often as it says (the package is another version);
            the message names the file and the reason of the patch.
    """
    done = []
    for p in patches:
        file = package_dir / p.path
        text = file.read_text()
        found = text.count(p.old)
        if found != (1 if p.to_end else p.count):
            raise RuntimeError(
                f"{file}: the patch '{p.reason}' expects its text {p.count if not p.to_end else 1} time(s), found it "
                f"{found} time(s): another version of the package than the one the patch was written for"
            )
        text = text[: text.index(p.old)] + p.new if p.to_end else text.replace(p.old, p.new)
        file.write_text(text)
        done.append({"path": p.path, "reason": p.reason})
    return done


def installed_package(trainer: str) -> Path:
    """The package directory of ``trainer``'s package inside its venv.

    Raises:
        RuntimeError: the venv is missing or does not import the package (the message names the build command).
    """
    package, _ = PATCHES[trainer]
    python = env_python(trainer)
    hint = f"build it with: python -m selfspec.engine_envs {trainer}"
    if not python.is_file():
        raise RuntimeError(f"the {trainer} environment is not built ({python} is missing); {hint}")
    code = f"import importlib.util as u; print(u.find_spec({package!r}).submodule_search_locations[0])"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {trainer} environment does not find {package}: {done.stderr[-500:]}; {hint}")
    return Path(done.stdout.strip())


def patched_copy(trainer: str, out: Path) -> tuple[Path, list[dict[str, str]]]:
    """Copy ``trainer``'s package out of its venv into ``out/<package>`` and apply its patches (:data:`PATCHES`).

    Returns:
        ``(out, applied)``: the directory to put first on ``PYTHONPATH``, and each patch's path and reason.

    Raises:
        KeyError: no patches are declared for ``trainer``.
        RuntimeError: see :func:`installed_package` and :func:`apply_patches`.
    """
    package, patches = PATCHES[trainer]
    source = installed_package(trainer)
    target = out / package
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    return out, apply_patches(target, patches)
