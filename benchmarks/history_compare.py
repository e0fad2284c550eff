"""``python -m benchmarks.history_compare PROMPTS``: selfspec's served history beside Arctic Inference's suffix
decoding, drafting alone, on the same stream.

Both draft continuations from what was served before (SuffixDecoding, Oliaro et al. 2024, arXiv:2411.04975; Arctic
Inference ships it). This compares the two sources on one stream, apart from any head and any kernel: the target
answers the prompts in order (greedy: the stream is the target's own output), then each
source is replayed over it as a chain drafter verified greedily: at each step it drafts up to ``--draft`` tokens
from the prompt and output so far and from the earlier outputs it holds, the longest prefix equal to the target's
next tokens is accepted plus the bonus token, and tau is tokens per step. Ours is
:class:`~selfspec.decode.drafters.served_history.ServedHistory` with the request's own n-grams
(:class:`~selfspec.decode.drafters.prompt_lookup.PromptLookupDrafter`'s chain), the longer match winning as in the
hybrid drafter; theirs is
``arctic_inference.suffix_decoding.SuffixDecodingCache`` (its prompt tree and global response cache), run by the
Python of a virtual environment that has ``arctic-inference`` and ``numpy`` (``--arctic-python``; it needs no vLLM).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from selfspec.decode.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.decode.drafters.served_history import ServedHistory

ARCTIC_REPLAY = r"""
import json, sys
from arctic_inference.suffix_decoding import SuffixDecodingCache
stream, draft = json.load(open(sys.argv[1])), int(sys.argv[2])
cache, out = SuffixDecodingCache(max_tree_depth=64), []
for i, (prompt, output) in enumerate(stream):
    cache.start_request(i, prompt)
    steps, at = 0, 0
    while at < len(output):
        spec = cache.speculate(i, prompt + output[:at], max_spec_tokens=draft).token_ids
        n = 0
        while n < len(spec) and at + n < len(output) and spec[n] == output[at + n]:
            n += 1
        step = min(n + 1, len(output) - at)
        cache.add_active_response(i, output[at : at + step])
        at, steps = at + step, steps + 1
    cache.stop_request(i)
    out.append(steps)
print(json.dumps(out))
"""


def replay_served_history(stream: list[tuple[list[int], list[int]]], draft: int) -> list[int]:
    """Verification steps per request of a chain drafter on :class:`ServedHistory` plus the request's own n-grams
    (the longer match wins, the request's own on a tie), each output added after its request."""
    history, lookup, steps_per_request = ServedHistory(), PromptLookupDrafter(num_tokens=draft), []
    for prompt, output in stream:
        steps, at = 0, 0
        while at < len(output):
            context = prompt + output[:at]
            own = lookup.chain(context, draft)
            found, n = history.lookup(context, draft)
            chain = found if n > own[1] else own[0]
            hit = 0
            while hit < len(chain) and at + hit < len(output) and chain[hit] == output[at + hit]:
                hit += 1
            at, steps = at + min(hit + 1, len(output) - at), steps + 1
        history.add(output)
        steps_per_request.append(steps)
    return steps_per_request


def replay_arctic(stream: list[tuple[list[int], list[int]]], draft: int, python: str) -> list[int]:
    """The same replay with Arctic Inference's ``SuffixDecodingCache`` in the environment of ``python``.

    Raises:
        RuntimeError: that Python cannot import ``arctic_inference`` (the message names the install).
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stream.json"
        path.write_text(json.dumps(stream))
        done = subprocess.run([python, "-c", ARCTIC_REPLAY, str(path), str(draft)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{python} could not replay the stream with Arctic Inference ({done.stderr.strip()[-300:]}); make a "
            "virtual environment with `pip install arctic-inference==0.3.0 numpy` and pass its python"
        )
    return json.loads(done.stdout)


def windows(stream: list[tuple[list[int], list[int]]], steps: dict[str, list[int]], window: int) -> list[dict]:
    """tau (output tokens per verification step) of each source per window of ``window`` requests."""
    rows = []
    for start in range(0, len(stream), window):
        tokens = sum(len(o) for _, o in stream[start : start + window])
        row: dict[str, Any] = {"first": start + 1, "last": min(len(stream), start + window)}
        for name, per_request in steps.items():
            row[name] = round(tokens / max(1, sum(per_request[start : start + window])), 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Serve the prompts with the target (no drafts), replay both sources, print and write the table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.history_compare", description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="+", help="MT-bench JSONL files, served in the order given (first turns)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--arctic-python", required=True, help="python of a venv with arctic-inference and numpy")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft", type=int, default=8, help="longest chain drafted per step")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/history-compare")
    args = p.parse_args(argv)
    import selfspec
    from selfspec.prompts import load_prompts

    torch.set_num_threads(args.threads)
    prompts = [q for f in args.prompts for q in load_prompts(f, max_turns=1)]
    model = selfspec.load(args.target, prompt_lookup=True, tune="off")
    stream = []
    for q in prompts:
        ids = model.encode(q.first_turn_messages())
        stream.append((ids.tolist(), model.generate(ids, args.max_new_tokens).tokens))
    steps = {
        "served_history": replay_served_history(stream, args.draft),
        "arctic_suffix": replay_arctic(stream, args.draft, args.arctic_python),
    }
    report = {"requests": len(stream), "draft": args.draft, "windows": windows(stream, steps, args.window)}
    total = sum(len(o) for _, o in stream)
    report["overall"] = {name: round(total / sum(s), 3) for name, s in steps.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "history_compare.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["overall"]))
    for row in report["windows"]:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
