#!/usr/bin/env bash
# On the GPU machine, from the repository root: GPU runtime tests, CuPy/NVRTC probe,
# and the norm baselines. Everything lands in $OUT (default: a temporary folder).
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-$(mktemp -d)}
export POWERFUSION_CACHE_DIR=$(mktemp -d)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv > "$OUT/nvidia-smi.csv" 2>&1
python3 benchmarks/harness.py probe > "$OUT/probe.json" 2> "$OUT/probe.err"
timeout "${PYTEST_TIMEOUT_S:-150}" python3 -m pytest tests/runtime -m gpu -q -rs -p no:cacheprovider > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest_gpu.txt"
tail -3 "$OUT/pytest_gpu.txt"
timeout "${BENCH_TIMEOUT_S:-200}" python3 benchmarks/bench_norms.py --out "$OUT" --budget-s "${BENCH_BUDGET_S:-160}" \
    > "$OUT/bench_norms.log" 2>&1
echo "bench exit $?"
tail -40 "$OUT/bench_norms.log"
cat "$OUT/probe.json"; cp "$OUT/pytest_gpu.txt" "$OUT/runtime-gpu-tests.txt"
