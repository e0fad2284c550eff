#!/usr/bin/env bash
# The same head benched by the code before issue 38's refactor (103152d, /tmp/old) and after (HEAD): tokens, steps and
# accepted tokens per prompt must be equal.
set -x
head -8 /work/runs/eval/mt_bench.jsonl > /work/runs/eval/refactor8.jsonl
cd /tmp && /tmp/oldenv/bin/selfspec bench --prompts /work/runs/eval/refactor8.jsonl --heads eagle3=/work/runs/e3/heads \
  --methods baseline no_draft hybrid --max-new-tokens 64 --threads 2 --out /work/runs/bench/refactor-before > /work/runs/bench/refactor-before.log 2>&1
cd /work/main && selfspec bench --prompts /work/runs/eval/refactor8.jsonl --heads eagle3=/work/runs/e3/heads \
  --methods baseline no_draft hybrid --max-new-tokens 64 --threads 2 --out /work/runs/bench/refactor-after > /work/runs/bench/refactor-after.log 2>&1
python - <<'PY'
import json
a = json.load(open("/work/runs/bench/refactor-before/report.json")); b = json.load(open("/work/runs/bench/refactor-after/report.json"))
same = diff = 0
for sa, sb in zip(a["samples"], b["samples"], strict=True):
    for m in sa["results"]:
        ra, rb = sa["results"][m], sb["results"][m]
        keys = [k for k in ("tokens", "steps", "accepted_per_step") if k in ra]
        ok = all(ra.get(k) == rb.get(k) for k in keys)
        same += ok; diff += not ok
        if not ok: print("DIFF", sa.get("question_id"), m, [k for k in keys if ra.get(k) != rb.get(k)])
print("same", same, "different", diff)
PY
