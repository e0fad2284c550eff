#!/usr/bin/env bash
# The bench runs recorded in docs/RESULTS.md (2-core CPU, fp32, 128 new tokens, interleaved per prompt).
# Needs the heads trained by configs/medusa-smollm2.yaml and configs/eagle-smollm2.yaml, and the eval
# prompt sets (EVAL=path to data/eval).
set -euo pipefail
EVAL=${EVAL:-../shared/data/eval}
HEADS="medusa=runs/medusa-smollm2/heads eagle=runs/eagle-smollm2/heads"
COMMON="--max-new-tokens 128 --threads 2 --dtype float32 --tree-nodes 4 --eagle-depth 3 --eagle-top-k 2 --eagle-total-tokens 4"
selfspec bench --prompts "$EVAL/mt_bench/question.jsonl" --max-turns 1 --per-category 1 --heads $HEADS \
    --methods baseline hf_prompt_lookup prompt_lookup $COMMON --out runs/bench/mt_bench-greedy
selfspec bench --prompts "$EVAL/mt_bench/question.jsonl" --max-turns 1 --per-category 1 --heads $HEADS \
    --methods baseline $COMMON --temperature 0.7 --seed 0 --out runs/bench/mt_bench-t0.7
selfspec bench --prompts "$EVAL/humaneval/question.jsonl" --num-prompts 5 --heads $HEADS \
    --methods baseline prompt_lookup $COMMON --out runs/bench/humaneval-greedy
selfspec bench --prompts "$EVAL/gsm8k/question.jsonl" --num-prompts 5 --heads $HEADS \
    --methods baseline prompt_lookup $COMMON --out runs/bench/gsm8k-greedy
selfspec bench --prompts sharegpt-heldout --num-prompts 8 --heads $HEADS \
    --methods baseline $COMMON --out runs/bench/sharegpt-heldout-greedy
for set in humaneval gsm8k; do
    selfspec bench --prompts "$EVAL/$set/question.jsonl" --num-prompts 5 --heads $HEADS \
        --methods baseline $COMMON --temperature 0.7 --seed 0 --out runs/bench/$set-t0.7
done
