#!/usr/bin/env bash
# The bench runs recorded in docs/RESULTS.md (2-core CPU, fp32, 128 new tokens, interleaved per prompt).
# Needs EAGLE and Medusa heads trained on the same data (the quickstart's EAGLE run and
# `selfspec train configs/medusa-smollm2.yaml` pointed at its distill_dir), and the eval prompt sets
# (EVAL=path to data/eval). EAGLE's tree budget is chosen by the head's acceptance profile and this
# machine's cost profile (depth / total_tokens "auto"); Medusa's tree size from its heads' accuracies and
# the same cost profile (TREE_NODES=N fixes it).
set -euo pipefail
EVAL=${EVAL:-../shared/data/eval}
EAGLE=${EAGLE:-runs/qs-eagle/heads}
MEDUSA=${MEDUSA:-runs/qs-medusa/heads}
OUT=${OUT:-runs/bench}
HEADS="medusa=$MEDUSA eagle=$EAGLE"
COMMON="--max-new-tokens 128 --threads 2 --dtype float32${TREE_NODES:+ --tree-nodes $TREE_NODES}"
selfspec bench --prompts "$EVAL/mt_bench/question.jsonl" --max-turns 1 --per-category 1 --heads $HEADS \
    --methods baseline $COMMON --out $OUT/mt_bench-greedy
selfspec bench --prompts "$EVAL/humaneval/question.jsonl" --num-prompts 5 --heads $HEADS \
    --methods baseline $COMMON --out $OUT/humaneval-greedy
selfspec bench --prompts "$EVAL/gsm8k/question.jsonl" --num-prompts 5 --heads $HEADS \
    --methods baseline $COMMON --out $OUT/gsm8k-greedy
if [ "${WITH_SAMPLING:-0}" = 1 ]; then
    selfspec bench --prompts "$EVAL/mt_bench/question.jsonl" --max-turns 1 --per-category 1 --heads $HEADS \
        --methods baseline $COMMON --temperature 0.7 --seed 0 --out $OUT/mt_bench-t0.7
fi
