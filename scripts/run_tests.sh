#!/usr/bin/env bash
# Runs the test suite; pytest's "no tests collected" (exit 5) counts as a failure.
# The unit and integration tests run one process per core (pytest-xdist), each with one intra-op
# thread: nearly all of their time is single-threaded Python over tiny tensors. The distributed
# tests start their own processes (world 2, Ray) and run afterwards, alone.
set -u
PY=${1:-python}
CORES=$("$PY" -c "import os; print(max(1, len(os.sched_getaffinity(0))))")
status=0
check() {  # pytest's exit code: 5 (nothing collected) is a failure too
  local rc=$1
  if [ "$rc" -eq 5 ]; then echo "minirl: no tests were collected" >&2; rc=1; fi
  if [ "$rc" -ne 0 ]; then status=$rc; fi
}
# --durations: the slowest tests, what to trim when CI nears 40 minutes
OMP_NUM_THREADS=1 "$PY" -m pytest -q -n "$CORES" --dist load --maxschedchunk 1 --durations=30 tests/unit tests/integration
check $?
"$PY" -m pytest -q --durations=15 tests/distributed
check $?
exit "$status"
