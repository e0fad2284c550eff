#!/usr/bin/env bash
# The prepared GPU check (selfspec/gpu_check.py), offline: trains an EAGLE-3 head on the embedded SmolLM2 target for
# five minutes in bf16 with `accelerate launch`, benches it against `generate` (exactness and tokens/s) and writes
# every figure to runs/gpu-check/gpu_check.json, in under ten minutes. Arguments pass through (--dry-run: on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m selfspec.gpu_check "$@"
