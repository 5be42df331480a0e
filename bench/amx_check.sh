#!/usr/bin/env bash
# The AMX-BF16 path on a machine whose CPU reports amx_bf16 (a lent GPU machine's host may; this repo's
# usual CPUs do not): whether Tessera uses AMX there and why not, the Python bf16 tests with the
# AMX path forced (against float64 and real torch), then bench/torch_attention.py in bf16 on the
# AMX and the `vdpbf16ps` paths, D = 64 and 128, PyTorch (SDPA, compiled flex) timed in the same
# processes. About two minutes on 16 cores; nothing is downloaded.
#
# Usage: bench/amx_check.sh [OUT_DIR]   (needs `tessera` importable, as bench/gpu_suite.sh)
set -u
OUT_DIR=${1:-/tmp/tessera-amx}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
if [ -e bindings/python/python/tessera/_tessera.abi3.so ]; then
  export PYTHONPATH="$PWD/bindings/python/python${PYTHONPATH:+:$PYTHONPATH}"
fi
{
  lscpu | grep -m1 'Model name'
  echo "amx_bf16 flags: $(grep -c amx_bf16 /proc/cpuinfo)  cores: $(nproc)"
  $PY -c "import torch, tessera._tessera as t; print('torch', torch.__version__); print('kernel paths:', t.isa); print('amx:', t.amx)"
} 2>&1 | tee "$OUT_DIR/amx_check.log"
grep -q "^amx: used: AMX-BF16" "$OUT_DIR/amx_check.log" || { echo "AMX not used here: nothing to check"; exit 0; }

echo "== the Python bf16 tests, AMX forced" | tee -a "$OUT_DIR/amx_check.log"
TESSERA_CPU_PATHS=bf16=amx timeout "${TESTS_S:-150}" $PY -m pytest -q -x -p no:cacheprovider \
  bindings/python/tests -k bf16 -m "not slow and not gpu" 2>&1 | tail -5 | tee -a "$OUT_DIR/amx_check.log"

for d in 64 128; do
  for p in amx dot; do
    echo "== bench/torch_attention.py --dtype bf16 --dim $d, bf16 path $p" | tee -a "$OUT_DIR/amx_check.log"
    TESSERA_CPU_PATHS=bf16=$p timeout "${BENCH_S:-60}" $PY bench/torch_attention.py --dtype bf16 \
      --dim "$d" --reps 3 2>&1 | tee -a "$OUT_DIR/amx_check.log"
  done
done
