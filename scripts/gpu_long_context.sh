#!/usr/bin/env bash
# On one H200: the RLinf-vs-verl comparison's long context scaled to one GPU (profile `h200-long`: 4 prompts
# x 16 samples x 16,384-token responses, 2 steps). Logs, metrics.jsonl and the end-of-run table
# go to $OUT (or ./gpu_logs). Usage: bash scripts/gpu_long_context.sh [extra minirl overrides...]
set -uo pipefail
source scripts/gpu_setup.sh
python3 scripts/make_data.py --out data --seed 0 --tasks gsm8k >/dev/null
timeout "${LONG_TIMEOUT:-480}" python3 -m minirl --config bench.toml --profile h200-long trainer.progress_bar=false \
  trainer.experiment_name=long "$@" 2>&1 | tee "$OUT/long.log" | grep -v "^step [0-9]*:"
cp runs/long/metrics.jsonl "$OUT/long_metrics.jsonl" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
