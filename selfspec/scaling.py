"""``selfspec scaling-curve``: how a head grows with data and training time. Train one head family at growing
budgets, bench each head, and write the scaling table and plot (docs/SCALING.md is its run).

Each point of the schedule is a training run of ``selfspec train CONFIG`` with more conversations and more
minutes than the one before (the self-distilled answers are cached in one directory, so a larger point only
generates the answers the smaller ones did not), followed by one ``selfspec bench`` of the saved head against
plain decoding on the same prompts, in the same process. Per point the table gives:

* data: conversations (self-distilled + as written), the feature tokens trained on (the store's size), and the
  CPU hours a run from scratch spends: wall seconds of the training command (self-distillation of its new
  answers, features and training), plus the self-distillation seconds of the answers earlier points
  generated for it (read from their logs), times the threads, over 3600;
* held-out acceptance by depth and the chain tau estimate of the saved head (``train_summary.json``);
* tau and the median speedup over plain decoding on the bench prompts (``report.json``).

A point whose outputs exist is not run again (a killed curve resumes at the point it was in; the training
command itself resumes from its checkpoint). Results: ``OUT/scaling.json``, ``OUT/scaling.md``,
``OUT/scaling.png``, and per point ``OUT/NAME/point.json``, ``train.log``, ``bench.log``, the run and its
``bench/report.json``.

Usage::

    selfspec scaling-curve --config configs/eagle3-smollm2.yaml --out runs/scaling --threads 2 \\
        --bench-prompts ../shared/data/eval/mt_bench/question.jsonl --bench-num-prompts 16

``--recipes NAME=KEY=VALUE[,KEY=VALUE...] ...`` compares recipes at equal budgets in one command: every point trains
each recipe (the config plus the recipe's overrides, in ``OUT/POINT/RECIPE``; ``NAME=`` is the config as it is) and
benches all of them in one ``selfspec bench`` run (``OUT/POINT/bench``, the methods interleaved per prompt), so
the table has one row per point and recipe, e.g.
``--recipes kl= lk=eagle3.loss=lk_hybrid eagle31=eagle3.fc_norm=true,eagle3.norm_output=true``.

The default schedule (``--points``) is about 0.5, 1 and 2 CPU-hours on a 2-core CPU:
``NAME:DISTILLED:WRITTEN:MINUTES`` each, the minutes being the training clock (``max_train_minutes``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from selfspec.base.files import write_json
from selfspec.train.config import load_config

DEFAULT_POINTS = ("h0.5:160:200:6", "h1:320:400:12", "h2:640:800:30")


def parse_point(text: str) -> dict[str, Any]:
    """``NAME:DISTILLED:WRITTEN:MINUTES`` -> a point dict.

    Raises:
        ValueError: not four fields, or counts / minutes that are not positive numbers.
    """
    parts = text.split(":")
    if len(parts) != 4:
        raise ValueError(f"a point is NAME:DISTILLED:WRITTEN:MINUTES, got {text!r}")
    name, distilled, written, minutes = parts
    point = {"name": name, "distilled": int(distilled), "written": int(written), "minutes": float(minutes)}
    if point["distilled"] < 0 or point["written"] < 0 or point["minutes"] <= 0:
        raise ValueError(f"counts must be >= 0 and minutes > 0, got {text!r}")
    return point


def parse_recipe(text: str) -> dict[str, Any]:
    """``NAME=KEY=VALUE[,KEY=VALUE...]`` (or ``NAME=``) -> ``{"name", "overrides"}``.

    Raises:
        ValueError: no ``=`` after the name, a name that is not a plain word, or an override without ``=``.
    """
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"a recipe is NAME=KEY=VALUE[,KEY=VALUE...] (or NAME= for the config as it is), got {text!r}")
    overrides = [o for o in rest.split(",") if o]
    if any("=" not in o for o in overrides):
        raise ValueError(f"each override of recipe {name!r} is KEY=VALUE, got {rest!r}")
    return {"name": name, "overrides": overrides}


def train_command(args: argparse.Namespace, point: dict[str, Any], out: Path, recipe: list[str] = ()) -> list[str]:
    """The ``selfspec train`` command of one point (the shared distillation cache, the point's budget), with a
    recipe's overrides after ``--override``'s.

    With ``self_distill`` the point's conversations are the first ``distilled`` training conversations
    regenerated and the next ``written`` as written, out of the config's pool (kept, so every point has the same
    held-out split); without it, the pool is cut to give about ``written`` training conversations (the
    held-out split then grows with it, by the config's ``eval_fraction``).

    Raises:
        ValueError: ``distilled`` > 0 for a config without ``self_distill``.
    """
    cfg = load_config(args.config, args.override)
    overrides = [f"output_dir={out}", f"max_train_minutes={point['minutes']}", f"threads={args.threads}"]
    if cfg.self_distill:
        pool = max(cfg.max_conversations, int((point["distilled"] + point["written"]) / (1 - cfg.eval_fraction)) + 50)
        overrides += [
            f"distill_dir={args.out / 'distill'}",
            f"distill_conversations={point['distilled']}",
            f"original_conversations={point['written']}",
            f"max_conversations={pool}",
        ]
    elif point["distilled"]:
        raise ValueError(f"{args.config} does not self-distill: give points with 0 distilled conversations")
    else:
        overrides.append(f"max_conversations={int(point['written'] / (1 - cfg.eval_fraction)) + 1}")
    return [sys.executable, "-m", "selfspec.train", str(args.config), *overrides, *args.override, *recipe]


def bench_command(args: argparse.Namespace, heads: dict[str, Path], out: Path) -> list[str]:
    """The ``selfspec bench`` command of one point's heads (``{method name: heads dir}``), all in one run with the
    baseline in the same process."""
    cmd = [sys.executable, "-m", "selfspec.bench", "--prompts", str(args.bench_prompts), "--heads"]
    cmd += [f"{name}={path}" for name, path in heads.items()]
    cmd += ["--methods", "baseline", "--max-new-tokens", str(args.bench_max_new_tokens), "--max-turns", "1"]
    cmd += ["--threads", str(args.threads), "--out", str(out)]
    if args.target:
        cmd += ["--target", args.target]
    if args.bench_num_prompts:
        cmd += ["--num-prompts", str(args.bench_num_prompts)]
    return cmd


def run_logged(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` with its output in ``log``; returns its wall seconds.

    Raises:
        RuntimeError: a non-zero exit (the message names the log).
    """
    t0 = time.perf_counter()
    with log.open("a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"{cmd[2]} exited with {rc}: see {log}")
    return time.perf_counter() - t0


def feature_tokens(run_dir: Path) -> int:
    """Tokens of the training split in a run's feature store (``features/rank*-of*/manifest.json``, every process's
    complete shards; 0 when it kept none)."""
    from selfspec.train.store_shards import read_manifest

    total = 0
    for directory in sorted((run_dir / "features").glob("rank*-of*")):
        manifest = read_manifest(directory)
        if manifest is not None:
            total += sum(s.tokens for s in manifest.shards if s.split == "train")
    return total


def trained_tokens(summary: dict[str, Any]) -> int | None:
    """Head positions the optimiser saw: the loop's ``train_tokens_total`` (older Medusa summaries: ``positions``), or
    from an older summary its tokens/s times its seconds; None when neither was logged."""
    for key in ("train_tokens", "positions"):
        if f"{key}_total" in summary:
            return int(summary[f"{key}_total"])
    rate = summary.get("train_tokens_per_s") or summary.get("positions_per_s")
    seconds = summary.get("train_s")
    return round(rate * seconds) if rate and seconds else None


def stage_seconds(log: Path) -> dict[str, float | None]:
    """Seconds of self-distillation and of the target-feature pass logged by the training command(s) in ``log``
    (summed over resumed attempts; None for a stage that did not run)."""
    pats = {
        "distill_s": r"self-distillation done in ([0-9.]+)s",
        "features_s": r"target features: \d+ tokens in ([0-9.]+)s",
    }
    text = log.read_text() if log.exists() else ""
    found = {k: [float(x) for x in re.findall(pat, text)] for k, pat in pats.items()}
    return {k: round(sum(v), 1) if v else None for k, v in found.items()}


def point_row(
    point: dict[str, Any],
    run_dir: Path,
    bench_dir: Path,
    wall_s: float,
    threads: int,
    earlier_distill_s: float = 0.0,
    method: str = "head",
) -> dict[str, Any]:
    """One table row from a point's ``train_summary.json``, bench ``report.json`` (its method ``method``) and
    training log.

    ``earlier_distill_s``: self-distillation seconds that earlier runs spent on answers this run reuses
    from the shared cache; they count in its CPU hours (a run from scratch generates them).
    """
    summary = json.loads((run_dir / "train_summary.json").read_text())
    report = json.loads((bench_dir / "report.json").read_text())
    ratios, taus = [], []
    for sample in report["samples"]:
        res = sample["results"]
        ratios.append(res[method]["tokens_per_s"] / res["baseline"]["tokens_per_s"])
        if res[method].get("tau"):
            taus.append(res[method]["tau"])
    selected = summary.get("selected", {})
    stages = stage_seconds(run_dir / "train.log")
    return {
        **point,
        "feature_tokens": feature_tokens(run_dir),
        "train_steps": summary["step"],
        "wall_s": round(wall_s, 1),
        **stages,
        "train_s": summary.get("train_s"),
        "trained_tokens": trained_tokens(summary),
        "earlier_distill_s": round(earlier_distill_s, 1),
        "cpu_hours": round((wall_s + earlier_distill_s) * threads / 3600, 3),
        "heldout_acceptance": selected.get("acceptance"),
        "chain_tau_estimate": selected.get("chain_tau"),
        "bench_tau": round(statistics.mean(taus), 3) if taus else None,
        "speedup": round(statistics.median(ratios), 3),
        "prompts": len(ratios),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown scaling table (a recipe column when the rows carry recipes)."""
    recipes = any("recipe" in r for r in rows)
    lines = [
        "| point | " + ("recipe | " if recipes else "") + "conversations | feature tokens | trained tokens | CPU-hours "
        "| minutes: distill / features / train | steps | held-out acceptance | chain tau est. | bench tau | speedup |",
        "|---|" + ("---|" if recipes else "") + "---:|---:|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        acc = " / ".join(f"{a:.2f}" for a in r["heldout_acceptance"] or [])
        trained = f"{r['trained_tokens']:,}" if r.get("trained_tokens") else "-"
        distill = ((r.get("distill_s") or 0.0) + (r.get("earlier_distill_s") or 0.0)) / 60
        features = (r.get("features_s") or 0.0) / 60
        minutes = f"{distill:.1f} / {features:.1f} / {(r.get('train_s') or 0.0) / 60:.1f}"
        recipe = f"{r.get('recipe', '-')} | " if recipes else ""
        lines.append(
            f"| {r['name']} | {recipe}{r['distilled']} + {r['written']} | {r['feature_tokens']:,} | {trained} "
            f"| {r['cpu_hours']:.2f} | {minutes} | {r['train_steps']} | {acc} | {r['chain_tau_estimate']} "
            f"| {r['bench_tau']} | {r['speedup']:.3f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Tau (bench and estimate) and speedup against feature tokens, one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for recipe in dict.fromkeys(r.get("recipe") for r in rows):
        sub = [r for r in rows if r.get("recipe") == recipe]
        x, tag = [r["feature_tokens"] for r in sub], f" ({recipe})" if recipe else ""
        ax.plot(x, [r["bench_tau"] for r in sub], "o-", label="tau (bench)" + tag)
        ax.plot(x, [r["chain_tau_estimate"] for r in sub], "s--", label="chain tau estimate (held out)" + tag)
        ax.plot(x, [r["speedup"] for r in sub], "^-", label="speedup (median)" + tag)
        for r, xi in zip(sub, x, strict=True):
            ax.annotate(f"{r['cpu_hours']:.1f} h", (xi, r["speedup"]), textcoords="offset points", xytext=(4, -12))
    ax.set_xscale("log")
    ax.set_xlabel("feature tokens trained on")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``selfspec scaling-curve [options]``; returns the exit status (0)."""
    parser = argparse.ArgumentParser(prog="selfspec scaling-curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/eagle3-smollm2.yaml"))
    parser.add_argument("--out", type=Path, default=Path("runs/scaling"))
    parser.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), help="NAME:DISTILLED:WRITTEN:MINUTES")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", default=None, help="bench target (default: the head's)")
    parser.add_argument("--bench-prompts", default="../shared/data/eval/mt_bench/question.jsonl")
    parser.add_argument("--bench-num-prompts", type=int, default=16)
    parser.add_argument("--bench-max-new-tokens", type=int, default=128)
    parser.add_argument("--override", nargs="*", default=[], help="extra key=value for every training run")
    parser.add_argument(
        "--recipes", nargs="+", default=None, help="NAME=KEY=VALUE[,KEY=VALUE...]: train and bench each at every point"
    )
    args = parser.parse_args(argv)
    points = [parse_point(p) for p in args.points]
    recipes = [parse_recipe(r) for r in args.recipes] if args.recipes else [{"name": "head", "overrides": []}]
    if len({r["name"] for r in recipes}) < len(recipes) or "baseline" in {r["name"] for r in recipes}:
        parser.error("recipe names must differ from each other and from 'baseline'")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    earlier = 0.0  # self-distillation seconds of earlier points (their answers are reused from the cache)
    for point in points:
        point_dir = args.out / point["name"]
        run_dirs = {r["name"]: point_dir / r["name"] if args.recipes else point_dir for r in recipes}
        done = {name: d / "point.json" for name, d in run_dirs.items()}
        if all(f.exists() for f in done.values()):
            here = [json.loads(f.read_text()) for f in done.values()]
        else:
            walls = {}
            for r in recipes:
                run_dir = run_dirs[r["name"]]
                run_dir.mkdir(parents=True, exist_ok=True)
                cmd = train_command(args, point, run_dir, r["overrides"])
                walls[r["name"]] = run_logged(cmd, run_dir / "train.log")
            heads = {name: d / "heads" for name, d in run_dirs.items()}
            run_logged(bench_command(args, heads, point_dir / "bench"), point_dir / "bench.log")
            distilled = {name: stage_seconds(d / "train.log")["distill_s"] or 0.0 for name, d in run_dirs.items()}
            here = []
            for name, run_dir in run_dirs.items():
                # a run from scratch also generates the answers an earlier run of this point left in the cache
                reused = earlier + max(distilled.values()) - distilled[name]
                row = point_row(point, run_dir, point_dir / "bench", walls[name], args.threads, reused, name)
                if args.recipes:
                    row["recipe"] = name
                write_json(done[name], row)
                here.append(row)
        earlier += max((r.get("distill_s") or 0.0) for r in here)
        rows += here
        print(table(rows), flush=True)
    write_json(args.out / "scaling.json", rows)
    (args.out / "scaling.md").write_text(table(rows) + "\n")
    plot(rows, args.out / "scaling.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
