#!/usr/bin/env bash
# The GPU record (BENCHMARKS.md's NVIDIA rows) in one run on a one-GPU CUDA machine without network access, in under
# 8 minutes: the environment (GPU, driver, torch, whether flash_attn.cute and varlen_attn import),
# bench/flex_gpu.py first, on a quiet GPU (plan -> device BlockMask vs compiled create_block_mask at
# 8K/32K/128K; attention fwd+bwd per engine vs flex with create_block_mask's mask, doc-causal at 8K
# and 32K; the example's train step at 8K, bf16 autocast), then the GPU suite (`pytest -m gpu`:
# every GPU test, the torch engines' included, in three processes so FlexAttention's kernel
# compilations overlap).
#
# Usage: bench/gpu_suite.sh [OUT_DIR]   (needs `tessera` importable: an installed wheel, a
#        PYTHONPATH pointing at a built package, or the built extension copied into the checkout
#        as below; nothing is downloaded)
# Files go to OUT_DIR (default /tmp/tessera-gpu; eight: flex_gpu.log, which opens with the
# environment, flex_gpu.json, a log and a JUnit XML per test process). Each stage has its own time limit
# (BENCH_S for the bench, SUITE_S for the tests; 250 + 240 s by default), so a stage that hangs
# still leaves the others' results; the bench writes its JSON after every section.
set -u
OUT_DIR=${1:-/tmp/tessera-gpu}
PY=${PYTHON:-python3}
SUITE_S=${SUITE_S:-240}
BENCH_S=${BENCH_S:-250}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The checkout's sources when a built extension is copied next to them (the extension
# bindings/python/python/tessera/_tessera.abi3.so: git ignores it; carry it to the machine), ahead
# of any installed tessera.
if [ -e bindings/python/python/tessera/_tessera.abi3.so ]; then
  export PYTHONPATH="$PWD/bindings/python/python${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | grep -m1 'Model name'
  $PY - <<'PY'
import importlib.util, sys, torch, numpy, tessera
def has(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
varlen = has("torch.nn.attention.varlen") and hasattr(importlib.import_module("torch.nn.attention.varlen"), "varlen_attn")
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "numpy",
      numpy.__version__, "tessera", tessera.__file__)
print("flash_attn.cute importable:", has("flash_attn.cute"), " varlen_attn:", varlen,
      " capability:", torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
PY
} > "$OUT_DIR/flex_gpu.log" 2>&1
cat "$OUT_DIR/flex_gpu.log"
env_lines=$(wc -l < "$OUT_DIR/flex_gpu.log")

echo "== bench/flex_gpu.py"
timeout "$BENCH_S" $PY bench/flex_gpu.py --lens 8192,32768,131072 --attn-lens 8192,32768 \
  --attn-masks doc_causal --reps 5 --steps 8 --warmup 2 --json "$OUT_DIR/flex_gpu.json" \
  >> "$OUT_DIR/flex_gpu.log" 2>&1
echo "rc=$?" >> "$OUT_DIR/flex_gpu.log"
tail -n +"$((env_lines + 1))" "$OUT_DIR/flex_gpu.log"  # the bench's part (the environment is above)

echo "== pytest -m gpu"
# Three pytest processes side by side, each with its own inductor/triton caches (eight xdist workers
# sharing one cache failed their first FlexAttention compilations with NoValidChoicesError; two
# processes, test_gpu.py's rest with the engines, ran past 210 s on a slow start on an H200 on 2026-11-28).
run_suite() {  # name, -k expression, test file
  (cd bindings/python && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 \
   timeout "$SUITE_S" $PY -m pytest "$3" -m gpu ${2:+-k "$2"} \
   -q -rfEs -p no:cacheprovider -p no:xdist --junitxml="$OUT_DIR/gpu_$1.xml") > "$OUT_DIR/gpu_$1.log" 2>&1
  echo "rc=$?" >> "$OUT_DIR/gpu_$1.log"
}
run_suite conformance "conformance" tests/test_gpu.py &
run_suite rest "not conformance" tests/test_gpu.py &
run_suite engines "" tests/test_gpu_engines.py &
wait
for n in conformance rest engines; do echo "-- $n"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^rc=" "$OUT_DIR/gpu_$n.log"; done
