"""Time self-distillation's batched greedy generation by batch size.

    python scripts/distill_batch.py PROMPTS.jsonl [--num-prompts 64] [--new-tokens 96] [--batch-sizes 32,64]
        [--rounds 2] [--threads 2]

PROMPTS.jsonl is a self-distillation cache (``<distill_dir>/train-rank0-of1.jsonl``: one ``{"id",
"messages"}`` per line); each record's messages up to its last turn are the prompt, rendered with the
target's chat template and sorted by length as :func:`selfspec.train.features.self_distill` does. The
target (SmolLM2-135M-Instruct, float32, CPU) runs ``generate`` greedily over the same prompts at each
batch size, after one warm-up call, the settings interleaved for ``--rounds`` rounds; every run after
the first reports how many answers equal the first run's. docs/RESULTS.md (round 6) quotes its run.

``--caches dynamic,static`` runs ``generate`` with each KV cache (``cache_implementation``), interleaved.
``--engines generate,selfspec`` also runs selfspec's batched loop (``selfspec.load(target, prompt_lookup=True)``
and ``generate([...], batch_tree="auto")``: rows leave the batch when they finish, rows are never padded,
speculation sized by batch) on the same batches, interleaved with ``generate``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from selfspec.target import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--batch-sizes", default="32,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="times each setting runs, settings interleaved")
    p.add_argument("--engines", default="generate", help="generate and/or selfspec, comma-separated")
    p.add_argument(
        "--caches", default="dynamic", help="generate's KV caches to compare: dynamic and/or static (comma-separated)"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target("smollm2-135m-instruct")
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    with open(args.prompts) as fh:
        records = [json.loads(line) for line in fh][: args.num_prompts]
    texts = [tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=False) for r in records]
    texts.sort(key=lambda t: len(tok(t, add_special_tokens=False)["input_ids"]))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    with torch.inference_mode():  # warm-up: the first generate of a process pays one-off costs
        enc = tok(texts[:8], return_tensors="pt", padding=True, add_special_tokens=False)
        model.generate(**enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    engines = args.engines.split(",")
    spec = None
    if "selfspec" in engines:
        import selfspec

        spec = selfspec.load(model, prompt_lookup=True, tokenizer=tok)
        spec.generate([tok(texts[0], add_special_tokens=False)["input_ids"]] * 2, max_new_tokens=8)  # warm-up
    reference = None
    caches = args.caches.split(",")
    runs = [(e, c) for e in engines for c in (caches if e == "generate" else ["-"])]
    for _ in range(args.rounds):
        for engine, cache in runs:
            for bs in sizes:
                answers = []
                t0 = time.perf_counter()
                for s in range(0, len(texts), bs):
                    if engine == "selfspec":
                        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[s : s + bs]]
                        outs = spec.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=tok.eos_token_id)
                        answers += [tok.decode(o.tokens, skip_special_tokens=True) for o in outs]
                        continue
                    enc = tok(texts[s : s + bs], return_tensors="pt", padding=True, add_special_tokens=False)
                    with torch.inference_mode():
                        extra = {"cache_implementation": "static"} if cache == "static" else {}
                        out = model.generate(
                            **enc,
                            max_new_tokens=args.new_tokens,
                            do_sample=False,
                            pad_token_id=tok.pad_token_id,
                            **extra,
                        )
                    answers += [tok.decode(r[enc["input_ids"].shape[1] :], skip_special_tokens=True) for r in out]
                seconds = time.perf_counter() - t0
                agree = 0 if reference is None else sum(a == b for a, b in zip(reference, answers, strict=True))
                same = "" if reference is None else f", {agree}/{len(texts)} answers as the first"
                reference = reference or answers
                print(
                    f"{engine:9s} {cache:7s} batch {bs:4d}: {seconds:6.1f} s for {len(texts)} prompts x "
                    f"{args.new_tokens} tokens{same}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
