"""Data-pass throughput (self-distillation + target features) with and without capturing features during generation.

    python scripts/data_pass.py [--config configs/eagle3-smollm2.yaml] [--num-prompts 64] [--rounds 2] [--threads 2]

The prompts are the first ``--num-prompts`` training conversations of the config's data (the split and the
prompt-length cap of ``selfspec train``). Each round runs both ways, alternating which goes first:

* ``plain``: :func:`~selfspec.train.features.self_distill`, then
  :func:`~selfspec.train.features.hidden_features` over the regenerated conversations as training renders them;
* ``capture``: ``self_distill(capture=...)``, then :func:`~selfspec.train.features.features_reusing` (computing
  only the conversations whose training tokens differ from the tokens generated).

Both use the config's EAGLE-3 layers, batch size, answer length and ``feature_batch_tokens``. It prints each run's
seconds per stage and feature tokens per second of the whole data pass, the medians, the share of conversations
captured, whether the answers were the same, and the largest difference between captured and computed features.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from selfspec.heads.eagle3 import default_target_layers
from selfspec.target import load_target
from selfspec.train.config import load_config
from selfspec.train.data import load_conversations, split_conversations
from selfspec.train.distill_states import CapturedStates
from selfspec.train.feature_store import training_examples
from selfspec.train.features import features_reusing, hidden_features, self_distill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/eagle3-smollm2.yaml")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("selfspec.train.features").setLevel(logging.INFO)  # how many sequences were captured
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model, tok = load_target(cfg.target)
    convs = load_conversations(cfg.data, max_conversations=cfg.max_conversations)
    train, _ = split_conversations(convs, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    prompts = train[: args.num_prompts]
    layers = list(cfg.eagle3.target_layers or default_target_layers(model.config.num_hidden_layers))
    print(f"{len(prompts)} prompts, layers {layers}, batch {cfg.distill_batch_size}", flush=True)
    rates: dict[str, list[float]] = {"plain": [], "capture": []}
    answers: dict[str, list] = {}
    feats_of: dict[str, list] = {}
    for rnd in range(args.rounds):
        for way in ("plain", "capture") if rnd % 2 == 0 else ("capture", "plain"):
            with tempfile.TemporaryDirectory() as tmp:
                capture = CapturedStates(layers, int(cfg.distill_capture_gb * 2**30)) if way == "capture" else None
                t0 = time.perf_counter()
                out = self_distill(
                    model,
                    tok,
                    prompts,
                    Path(tmp) / "distill.jsonl",
                    cfg.distill_max_new_tokens,
                    cfg.distill_batch_size,
                    max_prompt_tokens=cfg.max_length - cfg.distill_max_new_tokens,
                    disable_progress=True,
                    capture=capture,
                )
                t1 = time.perf_counter()
                ex = training_examples(cfg, model, tok, out)
                held = len(capture) if capture is not None else 0
                if capture is None:
                    feats = hidden_features(model, ex, True, layers, cfg.feature_batch_tokens)
                else:
                    feats = features_reusing(model, ex, capture, True, layers, cfg.feature_batch_tokens)
                t2 = time.perf_counter()
            n_tok = sum(int(e["input_ids"].numel()) for e in ex)
            rate = n_tok / (t2 - t0)
            rates[way].append(rate)
            answers.setdefault(way, out)
            feats_of.setdefault(way, feats)
            extra = f", {held} of {len(ex)} captured" if capture is not None else ""
            print(
                f"round {rnd} {way}: distill {t1 - t0:.1f} s, features {t2 - t1:.1f} s, {n_tok} tokens, "
                f"{rate:.0f} feature tokens/s of the data pass{extra}",
                flush=True,
            )
    same = answers["plain"] == answers["capture"]
    diff = max(float((a - b).abs().max()) for a, b in zip(feats_of["plain"], feats_of["capture"], strict=True))
    for way, r in rates.items():
        print(f"{way}: median {statistics.median(r):.0f} feature tokens/s")
    print(f"answers identical: {same}; max |captured - computed| {diff:.2e}")


if __name__ == "__main__":
    main()
