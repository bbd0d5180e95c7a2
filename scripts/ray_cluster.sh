#!/usr/bin/env bash
# A Ray cluster for multi-node minirl jobs (docs/multinode.md). Plain `ray` is enough: no
# dashboard, no job server; the driver runs on the head node and attaches to the cluster.
#
#   bash scripts/ray_cluster.sh head               on the head node (rank 0 runs there)
#   bash scripts/ray_cluster.sh worker HEAD_IP     on every other node
#   bash scripts/ray_cluster.sh wait N             until N nodes are alive (WAIT_TIMEOUT s, default 300)
#   bash scripts/ray_cluster.sh submit ARGS...     on the head: python -m minirl ARGS... on the cluster
#   bash scripts/ray_cluster.sh stop               on every node
#
# Environment: PYTHON (python), RAY_PORT (6379), GPUS and CPUS (default: what Ray detects),
# NODE_IP (this node's address, for hosts with several networks), BLOCK=1 (stay in the
# foreground: SLURM steps and containers), FORCE=1 (stop with --force).
# Export what the ranks need (HF_HOME, NCCL_*, PYTHONPATH, ...) BEFORE `head` and `worker`:
# Ray's worker processes inherit the environment of `ray start`, not the driver's.
set -euo pipefail

PYTHON=${PYTHON:-python}
PORT=${RAY_PORT:-6379}

start_args() {
  local args=(--disable-usage-stats --include-dashboard=false)
  [[ -n "${GPUS:-}" ]] && args+=(--num-gpus="$GPUS")
  [[ -n "${CPUS:-}" ]] && args+=(--num-cpus="$CPUS")
  [[ -n "${NODE_IP:-}" ]] && args+=(--node-ip-address="$NODE_IP")
  [[ "${BLOCK:-0}" == 1 ]] && args+=(--block)
  echo "${args[@]}"
}

wait_for_nodes() {
  "$PYTHON" - "$1" "${WAIT_TIMEOUT:-300}" <<'PY'
import sys, time
import ray

want, timeout = int(sys.argv[1]), float(sys.argv[2])
ray.init(address="auto", logging_level="ERROR")
deadline = time.monotonic() + timeout
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
        print(f"ray_cluster: {len(alive)} node(s) alive, {gpus:g} GPU(s)")
        sys.exit(0)
    if time.monotonic() > deadline:
        print(f"ray_cluster: only {len(alive)} of {want} node(s) joined within {timeout:g} s; "
              "check `ray_cluster.sh worker HEAD_IP` on the others (firewall: port 6379 and Ray's ports)",
              file=sys.stderr)
        sys.exit(1)
    time.sleep(2)
PY
}

cmd=${1:-}
shift || true
case "$cmd" in
  head)   ray start --head --port="$PORT" $(start_args) ;;
  worker) [[ $# -ge 1 ]] || { echo "usage: $0 worker HEAD_IP" >&2; exit 2; }
          ray start --address="$1:$PORT" $(start_args) ;;
  wait)   [[ $# -ge 1 ]] || { echo "usage: $0 wait N" >&2; exit 2; }
          wait_for_nodes "$1" ;;
  submit) exec env RAY_ADDRESS="${RAY_ADDRESS:-auto}" "$PYTHON" -m minirl "$@" ;;
  stop)   if [[ "${FORCE:-0}" == 1 ]]; then ray stop --force; else ray stop; fi ;;
  *)      sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
