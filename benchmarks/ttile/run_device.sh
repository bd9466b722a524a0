#!/usr/bin/env bash
# Everything the typed-GEMM work needs from a GPU, in one call: warm the kernel cache,
# run the GPU tests, benchmark. Results go to $OUT (or ./ttile_out).
set -u
OUT=${OUT:-ttile_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/ttile_device.txt" 2>&1
timeout ${PRECOMPILE_S:-150} python3 -m benchmarks.ttile.precompile ${BENCH:+--bench} ${QUICK:+--quick} 2>&1 | tail -8 | tee "$OUT/ttile_precompile.txt"
timeout ${TEST_S:-150} python3 -m pytest -q --maxfail=40 -m gpu tests/ttile -p no:cacheprovider ${PYTEST_ARGS:-} \
  > "$OUT/ttile_gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -25 "$OUT/ttile_gpu_tests.txt"
if [ -n "${BENCH:-}" ]; then
  timeout ${BENCH_S:-240} python3 -m benchmarks.ttile.bench "$OUT" ${QUICK:+--quick} commit=${COMMIT:-unknown} 2>&1 | tail -60
  [ -f "$OUT/ttile_bench.json" ] && python3 benchmarks/ttile/summarize.py "$OUT/ttile_bench.json" > /dev/null
fi
ls "$OUT"
