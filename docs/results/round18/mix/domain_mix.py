"""Round 18's domain-mix data: ShareGPT conversations interleaved code / math / other by their first user turn.

The bench's turns are a third MT-bench, a third HumanEval (Python functions) and a third GSM8K (arithmetic word
problems), while ShareGPT's first turns are mostly prose. This keeps the same source and sizes as the quickstart
(up to 3,000 conversations) but takes them from each kind in turn, so the first 1,446 (the 320 self-distilled
prompts, the 400 kept as written) hold the three kinds alike (ShareGPT has 482 math-like first turns, all
taken). No bench prompt is involved.

    python docs/results/round18/mix/domain_mix.py OUT.jsonl
"""

import itertools
import json
import re
import sys

from selfspec.train.data import load_conversations

CODE = re.compile(r"```|\bdef |\bpython\b|\bjavascript\b|\bfunction\b|\bcode\b|\bsql\b|\bjava\b|c\+\+", re.I)
MATH = re.compile(r"\b(calculate|solve|how many|how much|equation|probability|percent|average|total|sum)\b", re.I)
PER_KIND = 1000


def kind(conversation: dict) -> str:
    first = next(m["content"] for m in conversation["messages"] if m["role"] == "user")
    if CODE.search(first):
        return "code"
    if len(first) < 500 and MATH.search(first) and re.search(r"\d", first):  # a question, not a pasted document
        return "math"
    return "other"


def main(out: str) -> None:
    kinds: dict[str, list[dict]] = {"code": [], "math": [], "other": []}
    for conversation in load_conversations("sharegpt"):
        bucket = kinds[kind(conversation)]
        if len(bucket) < PER_KIND:
            bucket.append(conversation)
        if all(len(b) == PER_KIND for b in kinds.values()):
            break
    print({k: len(v) for k, v in kinds.items()})
    with open(out, "w") as f:
        for row in itertools.zip_longest(*kinds.values()):  # a third of each kind while math lasts
            for conversation in filter(None, row):
                f.write(json.dumps(conversation) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
