#!/usr/bin/env bash
# One device call: the GPU tests (full CUDA conformance in shards,
# committed models, streamed rows, 16-bit models, quantized sessions), then chosen benchmark
# rows from plans precompiled elsewhere (build/plans). Few files come back: logs are merged.
#   ROWS="channel_shuffle involution" bash benchmarks/run_final_device.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
TEST_GROUPS=${TEST_GROUPS:-"models streamed dtypes ttile_onnx conformance"} OUT=$OUT bash benchmarks/run_gpu_tests.sh \
    > "$OUT/tests-summary.txt" 2>&1
for f in "$OUT"/gpu-*.txt; do echo "######## $(basename $f)"; cat "$f"; done > "$OUT/tests.txt"; rm -f "$OUT"/gpu-*.txt
cat "$OUT/tests-summary.txt" >> "$OUT/tests.txt"; rm -f "$OUT/tests-summary.txt"
k=0
for row in ${ROWS:-}; do
  mkdir -p /tmp/bench-$k
  timeout ${ROW_S:-60} python3 benchmarks/bench_gir.py --suite subgraphs norms --only "$row" --plans build/plans \
      --out /tmp/bench-$k --budget-s $(( ${ROW_S:-60} - 5 )) >> "$OUT/bench.log" 2>&1
  cp /tmp/bench-$k/*.json "$OUT/bench-$k.json" 2>/dev/null
  k=$((k + 1))
done
grep -E "powerfusion|torch-compile|geomean" "$OUT/bench.log" | tail -20
grep -E "^== |^FAILED" "$OUT/tests.txt" | head -30
