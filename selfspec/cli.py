"""The ``selfspec`` command: ``train``, ``adapt``, ``bench``, ``tune-tree``, ``quickstart``, ``export``, ``import``,
``push``, ``scaling-curve``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        parser = argparse.ArgumentParser(prog="selfspec", description="self-speculative decoding")
        sub = parser.add_subparsers(dest="command")
        for name, help_text in commands.items():
            sub.add_parser(name, help=help_text, add_help=False)
        parser.print_help()
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    command, rest = argv[0], argv[1:]
    # Each command is imported only when it runs: training pulls in accelerate and datasets, the bench
    # matplotlib, and `selfspec --help` should need none of them.
    if command == "train":
        from selfspec.train.__main__ import main as train_main

        return train_main(rest)
    if command == "bench":
        from selfspec.bench import main as bench_main

        return bench_main(rest)
    if command == "adapt":
        from selfspec.adapt import main as adapt_main

        return adapt_main(rest)
    if command == "tune-tree":
        from selfspec.tune import main as tune_main

        return tune_main(rest)
    if command == "push":
        from selfspec.hub import main as push_main

        return push_main(rest)
    if command == "scaling-curve":
        from selfspec.scaling import main as scaling_main

        return scaling_main(rest)
    if command in ("export", "import"):
        from selfspec.export.cli import export_main, import_main

        return export_main(rest) if command == "export" else import_main(rest)
    from selfspec.quickstart import main as quickstart_main

    return quickstart_main(rest)


if __name__ == "__main__":
    sys.exit(main())
