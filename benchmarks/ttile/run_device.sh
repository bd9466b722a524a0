#!/usr/bin/env bash
# Everything the typed-GEMM work needs from a GPU, in one call: warm the kernel cache,
# run the GPU tests, benchmark. Results go to $OUT (or ./ttile_out).
#   BENCH=1 M1_ONLY=1 BENCH_S=120 TEST_K="nf4 or lowbit" POWERFUSION_GIT_COMMIT=<sha> bash benchmarks/ttile/run_device.sh
set -u
OUT=${OUT:-ttile_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/ttile_device.txt" 2>&1
timeout ${PRECOMPILE_S:-150} python3 -m benchmarks.ttile.precompile ${BENCH:+--bench} ${QUICK:+--quick} ${M1_ONLY:+--m1-only} \
  2>&1 | tail -8 | tee "$OUT/ttile_precompile.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_S:-150} python3 -m pytest -q --maxfail=40 -m gpu tests/ttile -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} \
    > "$OUT/ttile_gpu_tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -25 "$OUT/ttile_gpu_tests.txt"
fi
if [ -n "${BENCH:-}" ]; then
  timeout $(( ${BENCH_S:-240} + 30 )) python3 -m benchmarks.ttile.bench "$OUT" ${QUICK:+--quick} ${M1_ONLY:+--m1-only} \
    --budget ${BENCH_S:-240} 2>&1 | tail -40
  [ -f "$OUT/ttile.json" ] && python3 benchmarks/ttile/summarize.py "$OUT/ttile.json" > /dev/null
fi
ls "$OUT"
