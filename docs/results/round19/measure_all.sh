#!/usr/bin/env bash
# Quiet-machine benches (CI paused by the caller). Cost profiles of SmolLM2 measured anew first (the cached ones were
# measured while other work shared the cores).
set -x
cd /work/main
rm -f /root/.cache/selfspec/profiles/verify-c4fbf900c925acd8-cpu-float32-t2.json /root/.cache/selfspec/profiles/draft-eagle3-c4fbf900c925acd8-*.json
F=/work/runs/e3/heads
A=/work/runs/adapt/gsm8k
selfspec bench --prompts /work/runs/eval/gsm8k-b.jsonl \
  --heads adapt20=$A-840000/heads adapt10=$A-420000/heads adapt5=$A-210000/heads frozen=$F \
  --methods baseline no_draft hybrid --suffix-index /work/runs/adapt/gsm8k-served.jsonl \
  --max-new-tokens 128 --threads 2 --out /work/runs/bench/gsm8k-b > /work/runs/bench/gsm8k-b.log 2>&1
A=/work/runs/adapt/humaneval
selfspec bench --prompts /work/runs/eval/humaneval-b.jsonl \
  --heads adapt10=$A-420000/heads adapt5=$A-210000/heads frozen=$F \
  --methods baseline no_draft hybrid --suffix-index /work/runs/adapt/humaneval-served.jsonl \
  --max-new-tokens 128 --threads 2 --out /work/runs/bench/humaneval-b > /work/runs/bench/humaneval-b.log 2>&1
selfspec bench --prompts /work/runs/eval/mt_bench.jsonl --num-prompts 24 \
  --heads frozen=$F gsm8k20=/work/runs/adapt/gsm8k-840000/heads humaneval10=/work/runs/adapt/humaneval-420000/heads \
  --methods baseline no_draft --max-new-tokens 128 --threads 2 --out /work/runs/bench/mtbench > /work/runs/bench/mtbench.log 2>&1
/work/runs/measure_refactor.sh > /work/runs/bench/refactor.out 2>&1
selfspec bench --stream --prompts /work/runs/eval/gsm8k.jsonl --heads /work/runs/e3/heads --window 10 \
  --max-new-tokens 128 --threads 2 --out /work/runs/bench/stream-gsm8k > /work/runs/bench/stream-gsm8k.log 2>&1
echo ALL DONE
