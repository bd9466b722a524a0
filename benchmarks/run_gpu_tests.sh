#!/usr/bin/env bash
# On the GPU machine, from the repository root: every GPU-marked test, in parallel groups
# (each pytest process single-threaded; the machine has 16 cores). Logs in $OUT.
#   bash benchmarks/run_gpu_tests.sh            TEST_GROUPS="models ttile_onnx ..." to pick
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POWERFUSION_CACHE_DIR=${POWERFUSION_CACHE_DIR:-/tmp/pf-cache}
OUT=${OUT:-$(mktemp -d)}
TEST_GROUPS=${TEST_GROUPS:-"models ttile_onnx ttile_kernels streamed dtypes conformance runtime"}
LIMIT=${LIMIT_S:-540}
t0=$(date +%s)
py() { timeout $((LIMIT - ($(date +%s) - t0))) python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "$@"; }
for g in $TEST_GROUPS; do
  case $g in
    models) py tests/backends/test_cuda_models.py > "$OUT/gpu-models.txt" 2>&1 & ;;
    ttile_onnx) py tests/ttile/test_onnx_cuda.py > "$OUT/gpu-ttile-onnx.txt" 2>&1 & ;;
    ttile_kernels) py tests/ttile --ignore=tests/ttile/test_onnx_cuda.py > "$OUT/gpu-ttile-kernels.txt" 2>&1 & ;;
    streamed) py tests/backends/test_streamed_rows.py > "$OUT/gpu-streamed.txt" 2>&1 & ;;
    dtypes) py tests/backends/test_cuda_dtypes.py > "$OUT/gpu-dtypes.txt" 2>&1 & ;;
    runtime) py tests/runtime tests/rewrite/test_gpu_rewritten.py tests/perfmodel/test_tune_gpu.py tests/backends/test_c_renderer.py > "$OUT/gpu-runtime.txt" 2>&1 & ;;
    conformance)   # plans precompiled in parallel, then the cases in SHARDS pytest processes
      ( [ -n "${CONFORMANCE_IDS:-}" ] || timeout $((LIMIT / 2)) python3 benchmarks/precompile_conformance.py --jobs 12 --no-dtypes --budget-s $((LIMIT / 2 - 20)) \
          > "$OUT/precompile-conformance.log" 2>&1
        if [ -n "${CONFORMANCE_IDS:-}" ]; then cp "$CONFORMANCE_IDS" /tmp/conformance-ids.txt   # a chosen subset
        else python3 -m pytest -q -m gpu -p no:cacheprovider --co tests/conformance/test_cuda_conformance.py 2>/dev/null \
          | grep '::' > /tmp/conformance-ids.txt; fi
        n=${SHARDS:-6}
        for k in $(seq 0 $((n - 1))); do
          awk -v n=$n -v k=$k 'NR % n == k' /tmp/conformance-ids.txt > /tmp/conformance-ids-$k.txt
          PF_CUDA_CONFORMANCE_REPORT="$OUT/cuda-conformance-$k.json" py $(cat /tmp/conformance-ids-$k.txt) \
            > "$OUT/gpu-conformance-$k.txt" 2>&1 &
        done
        wait ) &
      ;;
  esac
done
wait
if ls "$OUT"/gpu-conformance-*.txt > /dev/null 2>&1; then   # one file each (the device returns few files)
  for f in "$OUT"/gpu-conformance-*.txt; do echo "## $(basename $f)"; cat "$f"; done > "$OUT/gpu-conformance.txt"
  cat "$OUT"/cuda-conformance-*.json.lines > "$OUT/cuda-conformance.jsonl" 2>/dev/null
  rm -f "$OUT"/gpu-conformance-*.txt "$OUT"/cuda-conformance-*.json.lines "$OUT"/cuda-conformance-*.json
  grep -h -E "passed|failed" "$OUT/gpu-conformance.txt" | grep -E "^[0-9]+ |in [0-9.]+s" 
fi
for f in "$OUT"/gpu-*.txt; do echo "== $(basename $f): $(tail -1 $f)"; grep -E "^(FAILED|ERROR)" "$f" | head -15; done
