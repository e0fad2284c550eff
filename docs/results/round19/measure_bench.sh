#!/usr/bin/env bash
# Benches of the adapted heads on the second halves (first turns, greedy, 128 tokens, 2 threads), the MT-bench check,
# the stream, the before/after bench of issue 38's refactor. Run on a quiet machine, one after another.
set -x
cd /work/main
F=/work/runs/e3/heads
for set in gsm8k humaneval; do
  A=/work/runs/adapt/$set
  selfspec bench --prompts /work/runs/eval/$set-b.jsonl \
    --heads adapt20=$A-840000/heads adapt10=$A-420000/heads adapt5=$A-210000/heads frozen=$F \
    --methods baseline no_draft hybrid --suffix-index /work/runs/adapt/$set-distill/train-rank0-of1.jsonl \
    --max-new-tokens 128 --threads 2 --out /work/runs/bench/$set-b > /work/runs/bench/$set-b.log 2>&1
  tail -30 /work/runs/bench/$set-b.log
done
selfspec bench --prompts /work/runs/eval/mt_bench.jsonl --num-prompts 24 \
  --heads frozen=$F gsm8k20=/work/runs/adapt/gsm8k-840000/heads humaneval20=/work/runs/adapt/humaneval-840000/heads \
  --methods baseline no_draft --max-new-tokens 128 --threads 2 --out /work/runs/bench/mtbench > /work/runs/bench/mtbench.log 2>&1
tail -20 /work/runs/bench/mtbench.log
