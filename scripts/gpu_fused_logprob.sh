#!/usr/bin/env bash
# On a CUDA machine: the fused log-prob/entropy kernels (minirl/kernels/logprob.py) against the plain
# torch path. 1) the gpu-marked exactness tests, 2) the one-chunk micro-benchmark, 3) issue 11's
# workload (32 prompts x 8 samples x 1,024 tokens, one optimizer step per step, 3 steps) with the
# fused path (default on CUDA) and with MINIRL_LOGPROB_IMPL=plain.
# Usage: bash scripts/gpu_fused_logprob.sh   (logs and tables in $OUT or ./gpu_logs)
set -uo pipefail
source scripts/gpu_setup.sh
STAGES=${STAGES:-tests bench workload}
if [[ $STAGES == *tests* ]]; then
  echo "== gpu tests"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_logprob_fused.py 2>&1 | tail -5
fi
if [[ $STAGES == *bench* ]]; then
  echo "== micro-benchmark"
  timeout 120 python3 scripts/bench_fused_logprob.py
fi
[[ $STAGES == *workload* ]] || exit 0
python3 scripts/make_data.py --out data --seed 0 --tasks gsm8k >/dev/null
W="--profile h200 data.train_batch_size=32 rollout.n=8 actor.ppo_mini_batch_size=32 trainer.total_training_steps=3"
W="$W trainer.progress_bar=false trainer.default_local_dir=/tmp/runs"
for impl in auto plain; do
  echo "== MINIRL_LOGPROB_IMPL=$impl"
  MINIRL_LOGPROB_IMPL=$impl timeout "${RUN_LIMIT:-150}" python3 -m minirl --config bench.toml $W \
    trainer.experiment_name=lp_$impl >"$OUT/lp_$impl.log" 2>&1
  echo "exit $?"
  python3 - /tmp/runs "lp_$impl" <<'PY'
import glob, json, os, sys
for path in glob.glob(os.path.join(sys.argv[1], "**", "metrics.jsonl"), recursive=True):
    if sys.argv[2] not in path:
        continue
    for line in open(path):
        m = json.loads(line)
        keys = ("timing_s/update_actor", "timing_s/ref", "timing_s/gen", "timing_s/step", "perf/mfu/actor")
        print(m.get("step"), " ".join(f"{k.split('/')[-1]}={m.get(k, float('nan')):.4g}" for k in keys))
PY
done
