#!/usr/bin/env bash
set -x
cd /work/main
selfspec bench --stream --prompts /work/runs/eval/gsm8k.jsonl --heads /work/runs/e3/heads --window 10 \
  --max-new-tokens 128 --threads 2 --out /work/runs/bench/stream-gsm8k > /work/runs/bench/stream-gsm8k.log 2>&1
tail -15 /work/runs/bench/stream-gsm8k.log
