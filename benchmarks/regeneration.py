"""The target's greedy answers written by HF ``generate`` and by vLLM's CPU build: rates and token agreement.

    python -m benchmarks.regeneration --prompts 256 --out runs/regeneration [--config configs/eagle3-smollm2.yaml]

Runs ``selfspec distill`` twice on the config's first ``--prompts`` training conversations (first turns, greedy, the
config's answer cap), once with ``distill_engine=hf`` (``distill_batch_size``, 64 in the quickstart's config) and
once with ``distill_engine=vllm``, one after the other, each in a fresh process whose wall and CPU seconds
(``RUSAGE_CHILDREN``: the vLLM worker included) are measured. Then, per conversation, the two answers are compared
token for token (the answers' texts tokenized by the target's tokenizer); where they part, the target's own logits
after the shared prefix say whether the two best tokens were a near-tie (:func:`selfspec.bench.ties.is_near_tie`).
Writes ``OUT/regeneration.json`` and prints a Markdown summary.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("hf", "vllm")


def run_distill(engine: str, config: str, prompts: int, out: Path) -> dict:
    """One ``selfspec distill`` run; returns its wall and CPU seconds and its answers file."""
    run_dir = out / engine
    cmd = [
        sys.executable,
        "-m",
        "selfspec",
        "distill",
        config,
        f"distill_engine={engine}",
        f"distill_conversations={prompts}",
        "distill_eval_conversations=0",
        "original_conversations=0",
        f"distill_dir={run_dir / 'distill'}",
        f"output_dir={run_dir}",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"selfspec distill ({engine}) failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    (run_dir / "distill.log").write_text(proc.stderr)
    files = sorted((run_dir / "distill").glob("train*-rank0-of1.jsonl"))
    if len(files) != 1:
        raise SystemExit(f"expected one answers file in {run_dir / 'distill'}, found {files}")
    return {"wall_s": wall, "cpu_s": cpu, "answers_file": str(files[0])}


def answers(path: str) -> dict[str, dict]:
    with open(path) as fh:
        return {rec["id"]: rec for rec in map(json.loads, fh)}


def compare(runs: dict[str, dict], config: str) -> dict:
    """Token agreement of the two engines' answers, with the near-tie check where they part."""
    import torch

    from selfspec.base.target import load_target
    from selfspec.bench.ties import is_near_tie
    from selfspec.train.config import load_config

    cfg = load_config(config, [])
    target, tokenizer = load_target(cfg.target)
    hf, vllm = (answers(runs[e]["answers_file"]) for e in ENGINES)
    common = [i for i in hf if i in vllm]
    equal, parted, tokens = 0, [], {e: 0 for e in ENGINES}
    for cid in common:
        msgs = hf[cid]["messages"]
        a, b = (tokenizer(r[cid]["messages"][-1]["content"], add_special_tokens=False)["input_ids"] for r in (hf, vllm))
        tokens["hf"] += len(a)
        tokens["vllm"] += len(b)
        if a == b:
            equal += 1
            continue
        first = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prompt = tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
        tie = is_near_tie(target, torch.tensor(list(prompt)), a, first)
        parted.append({"id": cid, "first_diff": first, "hf_tokens": len(a), "vllm_tokens": len(b), "near_tie": tie})
    return {
        "prompts": len(common),
        "equal": equal,
        "agreement": equal / len(common) if common else None,
        "parted": parted,
        "answer_tokens": tokens,
        "only_hf": len(set(hf) - set(vllm)),
        "only_vllm": len(set(vllm) - set(hf)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--config", default="configs/eagle3-smollm2.yaml")
    parser.add_argument("--out", type=Path, default=Path("runs/regeneration"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {e: run_distill(e, args.config, args.prompts, args.out) for e in ENGINES}
    result = {"config": args.config, "runs": runs, **compare(runs, args.config)}
    for e in ENGINES:
        runs[e]["answers_per_cpu_s"] = result["prompts"] / runs[e]["cpu_s"]
        runs[e]["answers_per_s"] = result["prompts"] / runs[e]["wall_s"]
        runs[e]["tokens_per_s"] = result["answer_tokens"][e] / runs[e]["wall_s"]
    (args.out / "regeneration.json").write_text(json.dumps(result, indent=1))
    print("| engine | wall s | CPU s | answers / CPU-s | answers / s | answer tokens / s |")
    print("|---|---:|---:|---:|---:|---:|")
    for e in ENGINES:
        r = runs[e]
        print(
            f"| {e} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['answers_per_cpu_s']:.3f} | {r['answers_per_s']:.2f} "
            f"| {r['tokens_per_s']:.1f} |"
        )
    ties = sum(p["near_tie"] for p in result["parted"])
    print(
        f"\n{result['equal']}/{result['prompts']} answers equal token for token ({result['agreement']:.1%}); "
        f"{len(result['parted'])} part, {ties} of them first at a near-tie of the target"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
