#!/usr/bin/env bash
set -x
cd /work/main
F=/work/runs/e3/heads; A=/work/runs/adapt/gsm8k
selfspec bench --prompts /work/runs/eval/gsm8k-b.jsonl \
  --heads adapt20=$A-840000/heads adapt10=$A-420000/heads adapt5=$A-210000/heads frozen=$F \
  --methods baseline no_draft hybrid --suffix-index /work/runs/adapt/gsm8k-served.jsonl \
  --max-new-tokens 128 --threads 2 --out /work/runs/bench/gsm8k-b > /work/runs/bench/gsm8k-b.log 2>&1
tail -30 /work/runs/bench/gsm8k-b.log
