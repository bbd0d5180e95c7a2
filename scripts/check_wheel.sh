#!/usr/bin/env bash
# Builds minirl as a normal wheel and checks that both packages import from it (not the source).
set -euo pipefail
PY=${1:-python}
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # it runs from a temp dir
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/dist" .
"$PY" -m pip install -q --no-deps --target "$tmp/site" "$tmp"/dist/minirl-*.whl
(cd "$tmp" && PYTHONPATH="$tmp/site" "$PY" -c "
import minirl, minirl_plugins, minirl_plugins.engines.native.engine.engine, minirl_plugins.engines.native.layers, minirl_plugins.engines.native.models
import minirl.dist.launchers.local, minirl_plugins.launchers.ray, minirl_plugins.engines.sglang, minirl.observe.runs.commands, minirl.observe.runs.compare, minirl.observe.runs.report
assert minirl.__file__.startswith('$tmp/site'), minirl.__file__
assert minirl_plugins.__file__.startswith('$tmp/site'), minirl_plugins.__file__
print('wheel install ok:', minirl.__file__)
")
