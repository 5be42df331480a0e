#!/usr/bin/env bash
# The GPU record of issue 30 in one run on a CUDA machine: the environment, bench/flex_gpu.py
# (BlockMask build vs create_block_mask, the example's train step at 8K), then the GPU suite
# (`pytest -m gpu`, spread over worker processes so FlexAttention's kernel compilations overlap).
#
# Usage: bench/gpu_suite.sh [OUT_DIR]   (needs `tessera` importable: an installed wheel, or
#        PYTHONPATH=bindings/python/python with the built extension in place)
# Logs and JSON go to OUT_DIR (default /tmp/tessera-gpu). Each stage has its own time limit, so
# a stage that hangs still leaves the others' results.
set -u
OUT_DIR=${1:-/tmp/tessera-gpu}
PY=${PYTHON:-python3}
SUITE_S=${SUITE_S:-330}
BENCH_S=${BENCH_S:-240}
WORKERS=${WORKERS:-8}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | grep -m1 'Model name'
  $PY -c "import sys, torch, numpy, tessera; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'tessera', tessera.__file__)"
} > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

echo "== bench/flex_gpu.py"
timeout "$BENCH_S" $PY bench/flex_gpu.py --json "$OUT_DIR/flex_gpu.json" > "$OUT_DIR/flex_gpu.log" 2>&1
echo "rc=$?" >> "$OUT_DIR/flex_gpu.log"
tail -n 8 "$OUT_DIR/flex_gpu.log"

echo "== pytest -m gpu"
xdist=()
if $PY -c "import xdist" 2>/dev/null; then xdist=(-n "$WORKERS"); fi
(cd bindings/python && timeout "$SUITE_S" $PY -m pytest tests/test_gpu.py -m gpu -q -rfEs "${xdist[@]}" \
  -p no:cacheprovider --junitxml="$OUT_DIR/gpu_suite.xml") > "$OUT_DIR/gpu_suite.log" 2>&1
echo "rc=$?" >> "$OUT_DIR/gpu_suite.log"
tail -n 40 "$OUT_DIR/gpu_suite.log"
