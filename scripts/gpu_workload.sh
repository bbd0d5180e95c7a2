#!/usr/bin/env bash
# On a CUDA machine: the 32 x 8 x 1,024 workload (32 prompts x 8 samples x 1,024-token budget, one optimizer
# step per rollout batch, 3 steps) once per variant, then a table of steps 2..3.
# Usage: bash scripts/gpu_workload.sh 'name|ENV=x|minirl.override=y ...' ...
#   e.g. bash scripts/gpu_workload.sh 'eager||model.compile_layers=false' 'compiled'
# Named workloads (each expands to its variants):
#   lora    the workload with full fine-tuning, then with LoRA (model.lora_rank = 64): peak memory,
#           step time and the weight sync (timing_s/update_weights) side by side
#   lora7b  the qwen2-7b preset with LoRA, 2 steps of 16 prompts x 8 samples x 1,024 tokens on one
#           GPU (full fine-tuning's weights, gradients and AdamW state alone take 122 GB)
# Env: PROFILE (default h200), WORKLOAD (the overrides that make the 32 x 8 x 1,024 workload; empty for the
# profile's own), RUN_LIMIT (seconds per run, default 240), OUT (logs; default ./gpu_logs), EXTRA_KEYS
# (more metrics for the table, space-separated), COLD=1 (each variant compiles into empty inductor and Triton
# caches of its own, so that every step 1 is a cold start whatever ran before on the machine).
set -uo pipefail
source scripts/gpu_setup.sh
[ -f data/gsm8k/train.parquet ] || python3 scripts/make_data.py --out data --seed 0 --tasks gsm8k >/dev/null
WORKLOAD=${WORKLOAD-data.train_batch_size=32 rollout.n=8 actor.ppo_mini_batch_size=32 trainer.total_training_steps=3}
LORA="model.lora_rank=64 model.lora_alpha=64"
variants=()
for arg in "$@"; do
  case "$arg" in
    lora) variants+=("full||" "lora64||$LORA") ;;
    lora7b) variants+=("lora7b||model.preset=qwen2-7b $LORA model.enable_gradient_checkpointing=true \
data.train_batch_size=16 actor.ppo_mini_batch_size=16 trainer.total_training_steps=2 rollout.gpu_memory_utilization=0.3") ;;
    *) variants+=("$arg") ;;
  esac
done
set -- "${variants[@]}"
for variant in "$@"; do
  IFS='|' read -r name envs overrides <<<"$variant"
  if [ "${COLD:-0}" = 1 ]; then
    rm -rf "/tmp/cold_$name"
    envs="TORCHINDUCTOR_CACHE_DIR=/tmp/cold_$name/inductor TRITON_CACHE_DIR=/tmp/cold_$name/triton $envs"
  fi
  echo "== $name: env [$envs] overrides [$overrides]"
  env $envs timeout "${RUN_LIMIT:-240}" python3 -m minirl --config bench.toml --profile "${PROFILE:-h200}" $WORKLOAD \
    trainer.progress_bar=false trainer.default_local_dir=/tmp/runs trainer.experiment_name="wl_$name" $overrides \
    >"$OUT/wl_$name.log" 2>&1
  echo "exit $? (log: $OUT/wl_$name.log)"; grep -i "error\|warn" "$OUT/wl_$name.log" | head -5
done
python3 - /tmp/runs "$@" <<'PY'
import glob, json, os, sys
keys = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor", "timing_s/update_weights")
keys += ("timing_s/step", "perf/mfu/actor", "compile/seconds", "compile/cache_hits", "compile/precompile_wait_s")
keys += ("peak_gib",)  # the largest memory_gib/<phase>
keys += tuple(os.environ.get("EXTRA_KEYS", "").split())  # e.g. timing_s/gen.kv_resume rollout/graph_captures
print("| variant | step | " + " | ".join(k.split("/")[-1] for k in keys) + " |")
last = {}
for variant in sys.argv[2:]:
    name = variant.split("|")[0]
    for path in glob.glob(os.path.join(sys.argv[1], "**", "metrics.jsonl"), recursive=True):
        if not any(c == f"wl_{name}" or c.startswith(f"wl_{name}_") for c in path.split(os.sep)):
            continue
        for line in open(path):
            m = json.loads(line)
            phases = {k: v for k, v in m.items() if k.startswith("memory_gib/") and "/held/" not in k}
            m["peak_gib"] = max(phases.values(), default=float("nan"))
            print(f"| {name} | {m.get('step')} | " + " | ".join(f"{m.get(k, float('nan')):.4g}" for k in keys) + " |")
            last[name] = m
# what holds the memory at each variant's last step (minirl.observe.memory), then the phases' peaks
for name, m in last.items():
    held = " ".join(f"{k.split('/')[-1]}={v:.2f}" for k, v in m.items() if "/held/" in k)
    peaks = " ".join(f"{k.split('/')[-1]}={v:.1f}" for k, v in m.items() if k.startswith("memory_gib/") and "/held/" not in k)
    print(f"{name} GiB held: {held} | phase peaks: {peaks}")
PY
