"""Held-out evaluation of a Medusa-2 run before its first step, started from Medusa-1 heads (``medusa.init_heads``).

    python scripts/medusa2_warm_eval.py --heads runs/medusa-smollm2/heads [--config configs/medusa2-smollm2.yaml]
        [key=value ...]

Builds the joint recipe as ``selfspec train`` does (same split; the self-distilled answers are read from the
run's ``distill_dir``, one process's files: nothing is generated here) and prints its held-out evaluation at step
0: each head's top-1, the KL to the base and the base agreement. With the adapter at its start (LoRA B = 0) these
are the Medusa-1 heads' own figures on the frozen target, so the joint run's later evaluations compare with
Medusa-1's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfspec.target import load_target
from selfspec.train.__main__ import distill_plan
from selfspec.train.config import load_config
from selfspec.train.data import load_conversations, split_conversations
from selfspec.train.feature_store import training_examples
from selfspec.train.medusa2 import Medusa2Recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/medusa2-smollm2.yaml")
    p.add_argument("--heads", required=True, help="the Medusa-1 heads directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("overrides", nargs="*", help="key=value, as for selfspec train")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [*args.overrides, f"medusa.init_heads={args.heads}"])
    if not cfg.distill_dir:
        raise SystemExit("set distill_dir=... to the directory holding the run's self-distilled answers")
    target, tok = load_target(cfg.target)
    convs = load_conversations(cfg.data, max_conversations=cfg.max_conversations)
    train, held = split_conversations(convs, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    if cfg.self_distill:  # the run's answers, read from its cache in the order the run used them
        to_distill, to_distill_eval, written = distill_plan(cfg, train, held)
        answers = []
        for convs_, name in ((to_distill, "train"), (to_distill_eval, "eval")):
            path = Path(cfg.distill_dir) / f"{name}-rank0-of1.jsonl"
            done = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
            answers.append([done[c["id"]] for c in convs_ if c["id"] in done])
        train, held = answers[0] + written, answers[1]
    ex, held_ex = (training_examples(cfg, target, tok, c) for c in (train, held))
    metrics = Medusa2Recipe(cfg, target, ex, held_ex, "step0").evaluate()
    print(json.dumps({"top1": [a[0] for a in metrics["topk"]], **{k: v for k, v in metrics.items() if k != "topk"}}))


if __name__ == "__main__":
    main()
