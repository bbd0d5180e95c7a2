#!/usr/bin/env bash
# On a CUDA machine: the gpu-marked resume/checkpoint tests, then the checkpoint benchmark of the
# 1.5B preset (actor + fp32 AdamW state). Usage: bash scripts/gpu_resume_check.sh
# THREADS="1 4": one benchmark per write-thread count; SKIP_TESTS=1: the benchmark only;
# BENCH_ARGS: more arguments of scripts/bench_checkpoint.py (e.g. "--repeats 1").
set -uo pipefail
source scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_resume.py 2>&1 | tail -15 | tee "$OUT/gpu_resume_tests.log"
for t in ${THREADS:-4}; do
  MINIRL_CKPT_WRITE_THREADS=$t timeout 400 python3 scripts/bench_checkpoint.py --out /tmp/minirl_ckpt_bench ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tee -a "$OUT/bench_checkpoint.log"
done
