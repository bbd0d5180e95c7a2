#!/usr/bin/env bash
# On a 2-GPU CUDA machine: the h200 profile on 2 GPUs, then on 1, then the 2-GPU tests.
# Prints each run's table; logs go to $OUT (or ./gpu_logs).
set -uo pipefail
source scripts/gpu_setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 scripts/make_data.py --out data --seed 0 --tasks gsm8k >/dev/null
for gpus in 2 1; do
  timeout "${RUN_TIMEOUT:-270}" python3 -m minirl --config bench.toml --profile h200 trainer.progress_bar=false \
    trainer.n_gpus_per_node=$gpus trainer.experiment_name=gpus$gpus >"$OUT/gpus$gpus.log" 2>&1
  echo "== $gpus GPU(s): exit $?"; grep -E "^(batch|step [0-9]+:)" "$OUT/gpus$gpus.log" | cut -c1-200
  sed -n '/^metric/,$p' "$OUT/gpus$gpus.log"; tail -3 "$OUT/gpus$gpus.log" | grep -i error
done
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed 2>&1 | tail -6
