"""Target-feature throughput of the feature store by forward batch size, on a run's own conversations.

    python scripts/feature_throughput.py [--config configs/eagle3-smollm2.yaml] [--distilled DISTILL.jsonl]
        [--num-distilled 120] [--num-written 120] [--batch-tokens 0,2048,4096,8192] [--rounds 2] [--threads 2]

The examples are the first ``--num-distilled`` self-distilled conversations of a cache
(``<distill_dir>/train-rank0-of1.jsonl``) and the first ``--num-written`` conversations of the config's data
as written, rendered as training renders them (``max_length`` tokens). Each ``--batch-tokens`` setting runs
:func:`selfspec.train.features.hidden_features` with the config's EAGLE-3 layers (SmolLM2: 2, 15, 27), the
settings interleaved for ``--rounds`` rounds after one warm-up; it prints tokens/s per run and the median per
setting, and the largest difference from the one-at-a-time states.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from selfspec.heads.eagle3 import default_target_layers
from selfspec.target import load_target
from selfspec.train.config import load_config
from selfspec.train.data import load_conversations
from selfspec.train.feature_store import training_examples
from selfspec.train.features import hidden_features


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/eagle3-smollm2.yaml")
    p.add_argument("--distilled", default="runs/scaling/distill/train-rank0-of1.jsonl")
    p.add_argument("--num-distilled", type=int, default=120)
    p.add_argument("--num-written", type=int, default=120)
    p.add_argument("--batch-tokens", default="0,2048,4096,8192")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model, tok = load_target(cfg.target)
    with open(args.distilled) as fh:
        convs = [json.loads(line) for line in fh][: args.num_distilled]
    convs += load_conversations(cfg.data, max_conversations=args.num_written)
    ex = training_examples(cfg, model, tok, convs)
    layers = list(cfg.eagle3.target_layers or default_target_layers(model.config.num_hidden_layers))
    n_tok = sum(int(e["input_ids"].numel()) for e in ex)
    print(f"{len(ex)} examples, {n_tok} tokens, layers {layers}", flush=True)
    settings = [int(x) for x in args.batch_tokens.split(",")]
    hidden_features(model, ex[:8], True, layers, max(settings))  # warm-up
    rates: dict[int, list[float]] = {b: [] for b in settings}
    reference = None
    for rnd in range(args.rounds):
        for b in settings:
            t0 = time.perf_counter()
            feats = hidden_features(model, ex, True, layers, b)
            rate = n_tok / (time.perf_counter() - t0)
            rates[b].append(rate)
            if reference is None:
                reference = feats
            diff = max(float((x - y).abs().max()) for x, y in zip(reference, feats, strict=True))
            print(f"round {rnd} batch_tokens {b}: {rate:.0f} tokens/s (max |diff| {diff:.2e})", flush=True)
    for b in settings:
        print(f"batch_tokens {b}: median {statistics.median(rates[b]):.0f} tokens/s")


if __name__ == "__main__":
    main()
