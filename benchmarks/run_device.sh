#!/usr/bin/env bash
# One device call: precompile (parallel), GPU tests, per-subgraph kernel check, benchmarks.
# Everything lands in $OUT. Usage on the GPU machine, from the repository root:
#   bash benchmarks/run_device.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POWERFUSION_CACHE_DIR=${POWERFUSION_CACHE_DIR:-/tmp/pf-cache}
OUT=${OUT:-$(mktemp -d)}
PLANS=/tmp/pf-plans
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/precompile.log" 2>&1
timeout "${PRECOMPILE_S:-170}" python3 benchmarks/precompile.py --out "$PLANS" --timeout-s "${COMPILE_TIMEOUT_S:-150}" \
    >> "$OUT/precompile.log" 2>&1
cp "$PLANS/compile.json" "$OUT/compile.json" 2>/dev/null
echo "precompiled: $(ls $PLANS/*.pkl 2>/dev/null | wc -l) plans"
timeout "${CHECK_S:-60}" python3 benchmarks/check_kernels_gpu.py --plans "$PLANS" --out "$OUT" 2>&1 | tail -25
timeout "${TESTS_S:-100}" python3 -m pytest -q -m gpu tests/backends tests/ttile/test_onnx_integration.py -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1
tail -2 "$OUT/gpu_tests.txt"
timeout "${BENCH_S:-300}" python3 benchmarks/bench_gir.py --suite norms subgraphs --plans "$PLANS" --out "$OUT" \
    --budget-s "${BENCH_BUDGET_S:-270}" > "$OUT/bench.log" 2>&1
tail -60 "$OUT/bench.log"
