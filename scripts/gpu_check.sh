#!/usr/bin/env bash
# On a CUDA machine: install minirl over the machine's torch, run the gpu-marked tests, then the
# benchmark job (bench.toml picks the h200 profile when CUDA is present). Logs go to $OUT (or
# ./gpu_logs). Usage: bash scripts/gpu_check.sh [extra minirl overrides...]
set -uo pipefail
source scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
[ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit tests/integration 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
python3 scripts/make_data.py --out data --seed 0 --tasks gsm8k copy >/dev/null
timeout "${BENCH_TIMEOUT:-420}" python3 -m minirl --config bench.toml trainer.progress_bar=false "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^step [0-9]*:"
