"""Chain acceptance of a block head on its own greedy outputs, two ways: the incremental decode (the drafter fed
each verified path) and a fresh drafter fed the whole prefix at every third position (round 17).

Run from the repository root: ``python docs/results/round17/depth-check/depth.py HEAD_DIR``.
"""

import json
import sys

import torch

from selfspec.base.target import load_target
from selfspec.decode.drafters import BlockDrafter
from selfspec.decode.drafters.base import DraftLimit
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig
from selfspec.heads import load_heads
from selfspec.prompts import encode_messages

torch.set_num_threads(1)
target, tok = load_target("smollm2-135m-instruct")
head = load_heads(sys.argv[1], target)
with open("docs/results/round14/questions.jsonl") as f:
    questions = [json.loads(line) for line in f][::6]
inc_hits, inc_n, off_hits, off_n = [0] * 3, [0] * 3, [0] * 3, [0] * 3
for q in questions:
    ids = encode_messages(tok, [{"role": "user", "content": q["turns"][0]}]).flatten()
    out = speculative_generate(target, BlockDrafter(head, target, length=3, top_k=1), ids, max_new_tokens=96)
    for k in range(3):
        inc_hits[k] += out.stats.accepted_by_depth[k]
        inc_n[k] += out.stats.drafted_by_depth[k]
    full = torch.cat([ids, torch.tensor(out.tokens)])
    with torch.no_grad():
        hs = target(full[None], output_hidden_states=True).hidden_states
    states = torch.cat([hs[i][0] for i in head.target_layers], dim=-1)
    for a in range(ids.numel(), full.numel() - 4, 3):
        fresh = BlockDrafter(head, target, length=3, top_k=1)
        fresh.begin(full[:a], states[:a])
        drafts = fresh.propose(full[: a + 1], SamplingConfig(), None, DraftLimit(useful_depth=10)).tokens[1:4]
        run = True
        for k in range(3):
            run = run and int(drafts[k]) == int(full[a + 1 + k])
            off_hits[k] += run
            off_n[k] += 1
print("incremental decode", [round(h / max(1, n), 3) for h, n in zip(inc_hits, inc_n, strict=True)])
print("fresh drafter on the same text", [round(h / max(1, n), 3) for h, n in zip(off_hits, off_n, strict=True)])
