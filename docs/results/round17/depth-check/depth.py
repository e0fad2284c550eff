import json, sys, torch
torch.set_num_threads(1)
from selfspec.heads import load_heads
from selfspec.train.target import load_target
from selfspec.prompts import encode_messages
from selfspec.decode.drafters import BlockDrafter
from selfspec.decode.drafters.base import DraftLimit
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig

target, tok = load_target("smollm2-135m-instruct")
head = load_heads(sys.argv[1], target)
qs = [json.loads(l) for l in open("docs/results/round14/questions.jsonl")][:: 6]
inc_hits, inc_n = [0, 0, 0], [0, 0, 0]
off_hits, off_n = [0, 0, 0], [0, 0, 0]
for q in qs:
    ids = encode_messages(tok, [{"role": "user", "content": q["turns"][0]}]).flatten()
    d = BlockDrafter(head, target, length=3, top_k=1)
    out = speculative_generate(target, d, ids, max_new_tokens=96)
    for k in range(3):
        inc_hits[k] += out.stats.accepted_by_depth[k]; inc_n[k] += out.stats.drafted_by_depth[k]
    full = torch.cat([ids, torch.tensor(out.tokens)])
    with torch.no_grad():
        hs = target(full[None], output_hidden_states=True).hidden_states
    states = torch.cat([hs[i][0] for i in head.target_layers], dim=-1)
    for a in range(ids.numel(), full.numel() - 4, 3):
        f = BlockDrafter(head, target, length=3, top_k=1)
        f.begin(full[:a], states[:a])
        tree = f.propose(full[: a + 1], SamplingConfig(), None, DraftLimit(useful_depth=10))
        drafts = tree.tokens[1:4].tolist()
        run = True
        for k in range(3):
            run = run and drafts[k] == int(full[a + 1 + k])
            off_hits[k] += run; off_n[k] += 1
print("incremental decode", [round(h / max(1, n), 3) for h, n in zip(inc_hits, inc_n)])
print("fresh drafter on the same text", [round(h / max(1, n), 3) for h, n in zip(off_hits, off_n)])
