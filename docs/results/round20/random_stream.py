"""A stream of random tokens through an online-adapting head, then ordinary prompts (round 20, issue 39).

The quickstart's EAGLE-3 head on SmolLM2-135M-Instruct, greedy. Three phases:

1. the frozen head on ``--ordinary`` prompts (first turns): tau per prompt, its mean and standard error;
2. ``selfspec.load(..., adapt=OnlineOptions(window=...))`` serves ``--random`` requests whose prompts are random
   token ids (uniform over the vocabulary, ``--prompt-tokens`` each, seeded): the online trainer learns from this
   junk, swaps and rolls back as its rules say;
3. the same adapting model then serves the ordinary prompts: tau per prompt against the frozen head's.

Every output of the adapting model is checked against the frozen model's (both greedy, so equal). Prints the
windows' decisions (swap / rollback) and the two mean taus. Run from the repository root:
``python docs/results/round20/random_stream.py --heads DIR --ordinary PROMPTS.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import selfspec
from selfspec.prompts import load_prompts
from selfspec.train.online import OnlineOptions


def tau_of(out) -> float:
    steps = out.stats.accepted_per_step
    return sum(steps) / max(1, len(steps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", required=True)
    p.add_argument("--ordinary", required=True, help="MT-bench JSONL prompts served after the random stream")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--random", type=int, default=48, help="random-token requests")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    frozen = selfspec.load(args.target, args.heads, threads=args.threads)
    online = selfspec.load(
        frozen.target, args.heads, tokenizer=frozen.tokenizer, adapt=OnlineOptions(window=args.window)
    )
    prompts = load_prompts(args.ordinary)
    vocab = frozen.target.get_output_embeddings().weight.shape[0]
    t0 = time.time()

    def ordinary(model):
        taus, tokens = [], []
        for prompt in prompts:
            out = model.generate(prompt.first_turn_messages(), args.max_new_tokens)
            taus.append(tau_of(out))
            tokens.append(out.tokens)
        return taus, tokens

    frozen_taus, frozen_tokens = ordinary(frozen)
    g = torch.Generator().manual_seed(0)
    mismatches = 0
    random_taus = []
    for _ in range(args.random):
        ids = torch.randint(0, vocab, (args.prompt_tokens,), generator=g)
        want = frozen.generate(ids, args.max_new_tokens, eos_token_id=[]).tokens
        got = online.generate(ids, args.max_new_tokens, eos_token_id=[])
        mismatches += got.tokens != want
        random_taus.append(tau_of(got))
    after_random = dict(swaps=online.online.stats.swaps, rollbacks=online.online.stats.rollbacks)
    online_taus, online_tokens = ordinary(online)
    mismatches += sum(a != b for a, b in zip(online_tokens, frozen_tokens, strict=True))

    def summary(taus):
        return round(statistics.mean(taus), 4), round(statistics.stdev(taus) / len(taus) ** 0.5, 4)

    stats = online.online.stats
    result = {
        "ordinary_prompts": len(prompts),
        "random_requests": args.random,
        "frozen_tau_mean_se": summary(frozen_taus),
        "random_stream_tau_mean_se": summary(random_taus),
        "after_random_online_tau_mean_se": summary(online_taus),
        "paired_difference_mean_se": summary([a - b for a, b in zip(online_taus, frozen_taus, strict=True)]),
        "after_random_stream": after_random,
        "swaps": stats.swaps,
        "rollbacks": stats.rollbacks,
        "train_s": round(stats.train_s, 1),
        "windows": stats.windows,
        "mismatches": mismatches,
        "wall_s": round(time.time() - t0),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
