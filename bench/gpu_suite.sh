#!/usr/bin/env bash
# The GPU record of issue 30 in one run on a CUDA machine: the environment, bench/flex_gpu.py
# (BlockMask build vs create_block_mask, the example's train step at 8K), then the GPU suite
# (`pytest -m gpu`, in two processes so FlexAttention's kernel compilations overlap).
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
# Two pytest processes side by side, each with its own inductor/triton caches (eight xdist workers
# sharing one cache failed their first FlexAttention compilations with NoValidChoicesError): the
# conformance cases in one, the rest in the other. Select_algorithm's log says why a choice fails.
run_suite() {  # name, -k expression
  (cd bindings/python && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 \
   TORCH_LOGS=torch._inductor.select_algorithm timeout "$SUITE_S" $PY -m pytest tests/test_gpu.py -m gpu \
   -k "$2" -q -rfEs -p no:cacheprovider -p no:xdist --junitxml="$OUT_DIR/gpu_$1.xml") > "$OUT_DIR/gpu_$1.log" 2>&1
  echo "rc=$?" >> "$OUT_DIR/gpu_$1.log"
}
run_suite conformance "conformance" &
run_suite rest "not conformance" &
wait
for n in conformance rest; do echo "-- $n"; grep -E "^(FAILED|ERROR)|passed|failed|^rc=" "$OUT_DIR/gpu_$n.log"; done
