"""The ``selfspec`` command: ``train``, ``distill``, ``adapt``, ``bench``, ``tune-tree``, ``quickstart``, ``export``,
``import``, ``push``, ``scaling-curve``."""

from __future__ import annotations

import argparse
import importlib
import sys

from selfspec import __version__
from selfspec.base.errors import run_command

# Each command's module and function, imported only when it runs: training pulls in accelerate and datasets, the bench
# matplotlib, and `selfspec --help` should need none of them. (Nothing imports this module, so the import graph of
# tests/test_layers.py, which does not read this table, loses no edge that could point upward or close a cycle.)
RUNNERS = {
    "train": ("selfspec.distill", "train_main"),  # train.__main__'s, after the vLLM stage when the config names vLLM
    "distill": ("selfspec.distill", "main"),
    "bench": ("selfspec.bench", "main"),
    "adapt": ("selfspec.adapt", "main"),
    "tune-tree": ("selfspec.tune", "main"),
    "quickstart": ("selfspec.quickstart", "main"),
    "export": ("selfspec.export.cli", "export_main"),
    "import": ("selfspec.export.cli", "import_main"),
    "push": ("selfspec.hub", "main"),
    "scaling-curve": ("selfspec.scaling", "main"),
}


def main(argv: list[str] | None = None) -> int:
    """``selfspec COMMAND ...``: the command's exit status; 2 on a user's mistake (one line on stderr, see
    :func:`selfspec.base.errors.run_command`) or an unknown command; ``--version`` prints the version."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"selfspec {__version__}")
        return 0
    commands = {
        "train": "train heads on a frozen target (same as: accelerate launch -m selfspec.train CONFIG [k=v ...])",
        "bench": "speedup and tau against plain transformers generate, in one run",
        "adapt": "adapt heads to the work of a prompt file: the target answers it, the heads train from where they are",
        "tune-tree": "size a head's draft tree to this machine (EAGLE: writes <heads>/acceptance_profile.json)",
        "quickstart": "the embedded default: SmolLM2 target, ShareGPT data, train heads, then bench",
        "export": "write heads in a serving engine's format (speculators for vLLM, sglang, gguf for llama.cpp)",
        "import": "read heads of the speculators or SGLang layouts into a selfspec head directory",
        "push": "push heads with their model card to the Hugging Face Hub (--dry-run: show, upload nothing)",
        "scaling-curve": "train a head family at growing data and time budgets, bench each, tabulate and plot",
        "distill": "only the self-distillation stage of a training config: the target writes the answers (HF or vLLM)",
    }
    if argv and argv[0] not in ("-h", "--help") and argv[0] not in commands:
        print(f"selfspec: error: unknown command {argv[0]!r}; choose one of {', '.join(commands)}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        parser = argparse.ArgumentParser(prog="selfspec", description="self-speculative decoding")
        parser.add_argument("-V", "--version", action="version", version=f"selfspec {__version__}")
        sub = parser.add_subparsers(dest="command")
        for name, help_text in commands.items():
            sub.add_parser(name, help=help_text, add_help=False)
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    module, function = RUNNERS[command]
    return run_command(f"selfspec {command}", getattr(importlib.import_module(module), function), rest)


if __name__ == "__main__":
    sys.exit(main())
