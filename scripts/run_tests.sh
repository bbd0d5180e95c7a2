#!/usr/bin/env bash
# Runs the test suite; pytest's "no tests collected" (exit 5) counts as a failure.
set -u
PY=${1:-python}
"$PY" -m pytest -q --durations=40 tests   # the slowest 40: what to trim when CI nears 40 minutes
rc=$?
if [ "$rc" -eq 5 ]; then echo "minirl: no tests were collected" >&2; exit 1; fi
exit "$rc"
