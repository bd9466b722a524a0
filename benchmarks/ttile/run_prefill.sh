#!/usr/bin/env bash
# The prefill kernel on a GPU in one call: warm the kernel cache, run its GPU tests, benchmark.
#   OUT=<dir> BENCH_S=140 POWERFUSION_GIT_COMMIT=<sha> bash benchmarks/ttile/run_prefill.sh
set -u
OUT=${OUT:-ttile_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/prefill_device.txt" 2>&1
timeout ${PRECOMPILE_S:-100} python3 -m benchmarks.ttile.precompile --prefill ${QUICK:+--quick} 2>&1 | tail -6 \
  | tee "$OUT/prefill_precompile.txt"
timeout ${TEST_S:-60} python3 -m pytest -q --maxfail=60 -m gpu tests/ttile/test_prefill_gpu.py -p no:cacheprovider \
  > "$OUT/prefill_gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -15 "$OUT/prefill_gpu_tests.txt"
timeout $(( ${BENCH_S:-140} + 30 )) python3 -m benchmarks.ttile.bench_prefill "$OUT" ${QUICK:+--quick} \
  --budget ${BENCH_S:-140} > "$OUT/prefill_bench_log.txt" 2>&1
tail -5 "$OUT/prefill_bench_log.txt"
[ -f "$OUT/ttile-prefill.json" ] && python3 benchmarks/ttile/summarize_prefill.py "$OUT/ttile-prefill.json" | head -60
ls "$OUT"
