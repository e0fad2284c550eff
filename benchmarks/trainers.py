"""``python -m benchmarks.trainers``: selfspec's EAGLE-3 trainer against SpecForge's and speculators' at equal
trained tokens, on the same data, judged by the same held-out evaluation.

```
python -m benchmarks.trainers --run runs/e3 --out runs/trainers [--trainers selfspec specforge speculators]
    [--max-train-tokens N] [--threads 2] [--bench-prompts FILE --bench-num-prompts 8 --bench-engines selfspec]
```

What is compared: three EAGLE-3 heads trained on the reference run's (``--run``, a finished ``selfspec train`` of an
``eagle3`` head) training sequences, with the target states selfspec computed for it (its feature store), each trainer
reading them in its own offline feature format (:mod:`benchmarks.trainer_data`), for the same number of trained
tokens (default: what the reference run trained), each with its own recipe (:mod:`benchmarks.trainer_runs`) and
its code patched only where it names a GPU device or kernel (:mod:`benchmarks.trainer_patches`, each patch with
its reason, listed in the report).

* ``selfspec``: with the reference run's budget the reference head itself (its ``train_s`` and trained tokens from
  its summary); with another budget, or ``--rerun-selfspec``, ``selfspec train`` again from the run's config on the
  same feature store (``max_train_tokens`` the budget, no calibration).
* ``specforge``, ``speculators``: their trainers in their venvs (``python -m selfspec.engine_envs specforge
  speculators`` builds them), then ``selfspec import`` of the head they wrote.

Every head is then scored by selfspec's own held-out evaluation (:func:`selfspec.train.eagle3.evaluate`, the one that
chose the reference head) on the run's held-out split: per-position greedy chain acceptance at depth 1, 2, 3 and
chain tau (``1 + sum``) at depths 2 and 3. Training cost: CPU-minutes of the training process and its children
(user + system, from ``getrusage``; start-up and data loading included, export and import not), and wall seconds.
Optionally (``--bench-prompts``) one bench of the three heads per engine (``selfspec bench --heads``, its tau).

Outputs (``--out``): ``trainers.json``, ``trainers.md`` (the table), per trainer ``<name>/`` (its inputs, logs
``train.log``, its head in its own layout and ``heads/``, the imported selfspec head directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.trainer_patches import PATCHES, patched_copy
from benchmarks.trainer_runs import ReferenceData, TrainerJob, head_directory, specforge_job, speculators_job
from selfspec.base.files import now_utc, write_json
from selfspec.engines.registry import DEFAULT_ENGINE, registered_engines
from selfspec.engines.registry import engine as engine_record

logger = logging.getLogger(__name__)

TRAINERS = ("selfspec", "specforge", "speculators")
EVAL_DEPTH = 3


def load_reference(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(train_config.json, train_summary.json)`` of a finished EAGLE-3 run.

    Raises:
        ValueError: the run is not a finished EAGLE-3 run with a feature store (the message says what is missing).
    """
    missing = [
        p for p in ("train_config.json", "train_summary.json", "heads/config.json") if not (run_dir / p).is_file()
    ]
    if missing:
        raise ValueError(f"{run_dir} is not a finished selfspec training run (missing {', '.join(missing)})")
    cfg = json.loads((run_dir / "train_config.json").read_text())
    summary = json.loads((run_dir / "train_summary.json").read_text())
    if cfg.get("head") != "eagle3" or summary.get("feature_source") != "store":
        raise ValueError(
            f"{run_dir} trained a {cfg.get('head')} head from {summary.get('feature_source')} features; "
            "the comparison needs an eagle3 run on a feature store (features: store)"
        )
    return cfg, summary


def reference_data(
    run_dir: Path, cfg: dict[str, Any], summary: dict[str, Any], target: Any, where: str
) -> ReferenceData:
    """The run's stores and what every trainer needs of the target (:class:`ReferenceData`).

    Raises:
        ValueError: the run's feature store is missing, incomplete or not one process's.
    """
    from selfspec.train.feature_store import load_features, store_path
    from selfspec.train.store_shards import read_manifest

    path = store_path(run_dir)
    manifest = read_manifest(path)
    stores = load_features(path, manifest.identity) if manifest is not None else None
    if stores is None:
        raise ValueError(f"{path} holds no complete store: the comparison reads the run's one-process feature store")
    return ReferenceData(
        train=stores[0],
        held=stores[1],
        target_dir=Path(where),
        hidden_size=int(target.config.hidden_size),
        norm_weight=target.model.norm.weight.detach().float().clone(),
        draft_vocab_size=int(summary["draft_vocab_size"]),
        target_layers=tuple(int(i) for i in summary["target_layers"]),
        max_length=int(cfg["max_length"]),
    )


def run_measured(command: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run ``command`` (output appended to ``log``) at the lowest priority; returns ``(wall seconds, CPU seconds)``
    of it and its children.

    Raises:
        RuntimeError: it exited non-zero (the message holds the log's tail).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(command)}\n")
        fh.flush()
        done = subprocess.run(
            command, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env}, preexec_fn=lambda: os.nice(19)
        )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command[:4])} ...` failed (exit {done.returncode}): "
            f"{log.read_text()[-3000:]}\n(full log: {log})"
        )
    return wall, cpu


def heldout(head: torch.nn.Module, ref: ReferenceData, target: Any) -> dict[str, Any]:
    """selfspec's held-out evaluation of ``head`` (:func:`selfspec.train.eagle3.evaluate`) on the run's held-out
    split, to depth :data:`EVAL_DEPTH`: ``chain`` (per depth), ``chain_tau`` (depth 2, as the reference run's summary
    reports it), ``chain_tau_3``, ``positions``."""
    from selfspec.train.eagle3 import evaluate
    from selfspec.train.eagle_data import PairStore

    held = ref.held
    store = PairStore(held.tokens, held.features, held.loss_mask, held.lengths)
    lm = target.get_output_embeddings().weight.detach()
    metrics = evaluate(head.float(), store, lm, EVAL_DEPTH, ref.max_length)
    chain = metrics["chain"]
    return {
        "positions": metrics["positions"],
        "chain": chain,
        "chain_tau": round(1 + sum(chain[:2]), 4),
        "chain_tau_3": metrics["chain_tau"],
    }


def train_selfspec(run_dir: Path, work: Path, budget: int, threads: int) -> dict[str, Any]:
    """``selfspec train`` again from ``run_dir``'s config on its feature store, ``budget`` tokens, no calibration;
    returns its record (head directory, tokens, steps, wall and CPU seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "features").mkdir(exist_ok=True)
    link = work / "features" / "rank0-of1"
    if not link.exists():
        link.symlink_to((run_dir / "features" / "rank0-of1").resolve())
    overrides = [f"output_dir={work}", f"max_train_tokens={budget}", "calibrate_prompts=0", f"threads={threads}"]
    command = [sys.executable, "-m", "selfspec.train", str(run_dir / "train_config.json"), *overrides]
    wall, cpu = run_measured(command, thread_env(threads), work / "train.log")
    summary = json.loads((work / "train_summary.json").read_text())
    return {
        "head_dir": str(work / "heads"),
        "trained_tokens": summary["trained_tokens"],
        "steps": summary["step"],
        "wall_s": round(wall, 1),
        "cpu_minutes": round(cpu / 60, 2),
        "source": "rerun",
    }


def thread_env(threads: int) -> dict[str, str]:
    """Intra-op thread counts for a child process."""
    return {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def train_foreign(job: TrainerJob, patches: list[dict[str, str]], target: Any) -> dict[str, Any]:
    """Run ``job`` (training, then its exporter), import its head into ``<work>/heads``; returns its record."""
    from selfspec.export.importer import import_heads

    log = job.work / "train.log"
    wall, cpu = run_measured(job.train, job.env, log)
    if job.export is not None:
        run_measured(job.export, job.env, job.work / "export.log")
    source = head_directory(job)
    out = job.work / "heads"
    import_heads(source, job.head_format, out, target)
    return {
        "head_dir": str(out),
        "foreign_head_dir": str(source),
        "trained_tokens": job.plan.trained_tokens,
        "steps": job.plan.steps,
        "wall_s": round(wall, 1),
        "cpu_minutes": round(cpu / 60, 2),
        "source": "rerun",
        "plan": job.plan.to_dict(),
        "settings": job.settings,
        "patches": patches,
    }


def eagle31(head_dir: str) -> bool:
    """Whether the selfspec head directory holds an EAGLE-3.1 head (``fc_norm`` or ``norm_output`` set)."""
    own = json.loads((Path(head_dir) / "config.json").read_text()).get("selfspec", {})
    return bool(own.get("fc_norm") or own.get("norm_output"))


def bench_taus(heads: dict[str, str], out: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One ``selfspec bench`` per engine of ``--bench-engines`` over the heads it runs; ``{engine: {trainer: tau or
    the reason it has none}}``. A failed engine run is recorded (its log's tail), not raised."""
    taus: dict[str, dict[str, Any]] = {}
    for engine in args.bench_engines:
        where = out / "bench" / engine
        where.mkdir(parents=True, exist_ok=True)
        refused = {
            n: "EAGLE-3.1 head: this engine's export refuses it"
            for n, d in heads.items()
            if not engine_record(engine).eagle31 and eagle31(d)  # its export refuses them (docs/EXPORT.md)
        }
        run = {n: d for n, d in heads.items() if n not in refused}
        command = [
            *(sys.executable, "-m", "selfspec.cli", "bench", "--prompts", args.bench_prompts, "--heads"),
            *(f"{name}={d}" for name, d in run.items()),
            *("--threads", str(args.threads), "--num-prompts", str(args.bench_num_prompts)),
            *("--max-new-tokens", str(args.bench_max_new_tokens), "--out", str(where)),
            *("--engine", engine),
        ]
        try:
            run_measured(command, thread_env(args.threads), where / "bench.log")
            summary = json.loads((where / "report.json").read_text())["summary"]
            found = {n: (summary.get(n) or {}).get("overall", {}).get("tau") for n in run}
        except (RuntimeError, OSError, ValueError, KeyError) as err:
            logger.warning("bench on %s failed: %s", engine, str(err)[-500:])
            found = dict.fromkeys(run, f"bench failed (see {where / 'bench.log'})")
        taus[engine] = {n: refused.get(n, found.get(n)) for n in heads}
    return taus


def markdown(report: dict[str, Any]) -> str:
    """The comparison table (one row per trainer) and the notes."""
    rows = [
        "| trainer | trained tokens | steps | held-out acc. d1 | d2 | d3 | chain tau (d2) | tau (d3) | "
        "training CPU-min | wall s |" + "".join(f" bench tau ({e}) |" for e in report["bench_engines"]),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(report["bench_engines"]),
    ]
    for name, r in report["trainers"].items():
        h = r["heldout"]
        chain = [*h["chain"], None, None, None][:3]
        cells = [
            name,
            f"{r['trained_tokens']:,}",
            str(r.get("steps", "")),
            *(f"{c:.4f}" if c is not None else "" for c in chain),
            f"{h['chain_tau']:.4f}",
            f"{h['chain_tau_3']:.4f}",
            "" if r.get("cpu_minutes") is None else f"{r['cpu_minutes']:.1f}",
            "" if r.get("wall_s") is None else f"{r['wall_s']:.0f}",
        ]
        for e in report["bench_engines"]:
            tau = report["bench"][e].get(name)
            cells.append(f"{tau:.3f}" if isinstance(tau, float) else "" if tau is None else "-")
        rows.append("| " + " | ".join(cells) + " |")
    notes = [
        f"- Reference run: {report['run']}; budget {report['budget']:,} trained tokens (pairs: T - 1 per "
        "sequence per step); held-out split of the run, selfspec's evaluation (greedy chain acceptance).",
        *(f"- {name}: {r['note']}" for name, r in report["trainers"].items() if r.get("note")),
    ]
    for e in report["bench_engines"]:
        for name, tau in report["bench"][e].items():
            if isinstance(tau, str):
                notes.append(f"- bench ({e}), {name}: {tau}")
    for name, r in report["trainers"].items():
        for p in r.get("patches", []):
            notes.append(f"- patch, {name} `{p['path']}`: {p['reason']}")
    return "\n".join(["# EAGLE-3 trainers at equal trained tokens", "", *rows, "", *notes, ""])


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.trainers", description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="a finished `selfspec train` run of an eagle3 head (its directory)")
    p.add_argument("--out", required=True, help="directory for trainers.json, trainers.md and each trainer's files")
    p.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    p.add_argument("--max-train-tokens", type=int, default=None, help="budget (default: the run's trained tokens)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every trainer (run one at a time)")
    p.add_argument(
        "--ttt-steps",
        type=int,
        default=None,
        help="replace SpecForge's (7) and speculators' (3) training-time-test length (default: their own)",
    )
    p.add_argument("--rerun-selfspec", action="store_true", help="train selfspec again even at the run's budget")
    p.add_argument("--bench-prompts", default=None, help="also bench the heads on this prompt file (MT-bench JSONL)")
    p.add_argument(
        "--bench-only",
        action="store_true",
        help="bench the heads of an earlier comparison in --out (its trainers.json)",
    )
    p.add_argument("--bench-num-prompts", type=int, default=8)
    p.add_argument("--bench-max-new-tokens", type=int, default=128)
    p.add_argument(
        "--bench-engines", nargs="+", choices=registered_engines(), default=[DEFAULT_ENGINE], help="engines to bench on"
    )
    return p


def kept_trainers(out: Path, run: str, budget: int, ttt_steps: int | None) -> dict[str, Any]:
    """The trainers an earlier comparison in ``out`` finished for the same ``run``, ``budget`` and ``ttt_steps`` (its
    ``trainers.json``), whose heads are still there: a comparison too long for one sitting goes on trainer by trainer
    (``--trainers speculators`` one day, ``--trainers specforge`` the next) into one table. Empty when there is none or
    it was made with other settings."""
    path = out / "trainers.json"
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    if (earlier.get("run"), earlier.get("budget"), earlier.get("ttt_steps")) != (run, budget, ttt_steps):
        return {}
    return {n: r for n, r in earlier.get("trainers", {}).items() if (Path(r["head_dir"]) / "config.json").is_file()}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns 0, or 2 on bad input (the reason printed)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from selfspec.export.cli import load_frozen_target
    from selfspec.heads.load import load_heads

    run_dir, out = Path(args.run), Path(args.out)
    if args.bench_only:
        if not args.bench_prompts or not (out / "trainers.json").is_file():
            print(f"python -m benchmarks.trainers: --bench-only needs --bench-prompts and {out / 'trainers.json'}")
            return 2
        report = json.loads((out / "trainers.json").read_text())
        return finish(report, out, args)
    try:
        cfg, summary = load_reference(run_dir)
        target, where = load_frozen_target(cfg["target"])
        ref = reference_data(run_dir, cfg, summary, target, where)
    except ValueError as err:
        print(f"python -m benchmarks.trainers: {err}")
        return 2
    torch.set_num_threads(args.threads)
    budget = args.max_train_tokens or int(summary["trained_tokens"])
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "created_utc": now_utc(),
        "run": str(run_dir),
        "budget": budget,
        "threads": args.threads,
        "ttt_steps": args.ttt_steps,
        "trainers": kept_trainers(out, str(run_dir), budget, args.ttt_steps),
        "bench": {},
        "bench_engines": [],
    }
    for name in args.trainers:
        work = out / name
        if name in report["trainers"]:
            logger.info("trainer %s: kept from %s (same run, budget and TTT steps)", name, out / "trainers.json")
            continue
        logger.info("trainer %s: %d tokens", name, budget)
        if name == "selfspec" and budget == int(summary["trained_tokens"]) and not args.rerun_selfspec:
            record = {
                "head_dir": str(run_dir / "heads"),
                "trained_tokens": budget,
                "steps": summary["step"],
                "wall_s": summary["train_s"],
                "cpu_minutes": None,
                "source": "reference",
                "note": f"the reference head itself; {summary['train_s']} s wall on {cfg['threads']} threads "
                "(CPU time not measured: --rerun-selfspec measures it)",
            }
        elif name == "selfspec":
            record = train_selfspec(run_dir, work, budget, args.threads)
        else:
            work.mkdir(parents=True, exist_ok=True)
            patched, applied = patched_copy(name, work / "patched")
            make = specforge_job if name == "specforge" else speculators_job
            record = train_foreign(make(ref, work, budget, args.threads, patched, args.ttt_steps), applied, target)
        head = load_heads(record["head_dir"], target)
        record["heldout"] = heldout(head, ref, target)
        report["trainers"][name] = record
        logger.info("trainer %s: %s", name, json.dumps(record["heldout"]))
        write_json(out / "trainers.json", report)
        (out / "trainers.md").write_text(markdown(report))
    return finish(report, out, args)


def finish(report: dict[str, Any], out: Path, args: argparse.Namespace) -> int:
    """The bench (with ``--bench-prompts``), then ``trainers.json`` and ``trainers.md``; returns 0."""
    if args.bench_prompts:
        report["bench_engines"] = list(args.bench_engines)
        report["bench"] = bench_taus({n: r["head_dir"] for n, r in report["trainers"].items()}, out, args)
    write_json(out / "trainers.json", report)
    (out / "trainers.md").write_text(markdown(report))
    print((out / "trainers.md").read_text())
    return 0


__all__ = ["PATCHES", "TRAINERS", "heldout", "main", "markdown"]

if __name__ == "__main__":
    raise SystemExit(main())
