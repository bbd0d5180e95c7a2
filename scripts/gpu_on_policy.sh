#!/usr/bin/env bash
# On a CUDA machine: issue 11's workload (32 prompts x 8 samples x 1,024 tokens, one optimizer
# step per rollout batch) with the on-policy shortcut (default) and without it, 3 steps each.
# Usage: bash scripts/gpu_on_policy.sh   (logs and tables in $OUT or ./gpu_logs)
set -uo pipefail
source scripts/gpu_setup.sh
python3 scripts/make_data.py --out data --seed 0 --tasks gsm8k >/dev/null
W="--profile h200 data.train_batch_size=32 rollout.n=8 actor.ppo_mini_batch_size=32 trainer.progress_bar=false"
for shortcut in true false; do
  echo "== actor.on_policy_shortcut=$shortcut"
  timeout 280 python3 -m minirl --config bench.toml $W actor.on_policy_shortcut=$shortcut \
    trainer.experiment_name=onpolicy_$shortcut 2>&1 | tee "$OUT/onpolicy_$shortcut.log" \
    | grep -E "^batch:|^metric|^-----|time |throughput|MFU|^response|^\(mean|^prev"
done
