#!/usr/bin/env bash
# Offline adaptation of the quickstart EAGLE-3 head on the first halves of GSM8K and HumanEval (first turns),
# at three budgets in trained tokens (the tokens EAGLE-3 trains in 2.5 / 5 / 10 wall minutes at 2 threads on a quiet
# machine, ~1,400 tokens/s: 5 / 10 / 20 CPU-minutes), answers self-distilled once per set.
set -x
H=/work/runs/e3/heads
cd /work/main
for set in gsm8k humaneval; do
  for t in 210000 420000 840000; do
    selfspec adapt $H --prompts /work/runs/eval/$set-a.jsonl --out /work/runs/adapt/$set-$t --tokens $t --threads 2 \
      distill_dir=/work/runs/adapt/$set-distill > /work/runs/adapt/$set-$t.log 2>&1
    tail -4 /work/runs/adapt/$set-$t.log
  done
done
