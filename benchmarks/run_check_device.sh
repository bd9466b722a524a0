#!/usr/bin/env bash
# One device call after a round of changes: every GPU test outside the conformance sweep, in
# parallel groups, then the benchmarks that need the GPU. At most 8 files land in $OUT.
# Usage on the GPU machine, from the repository root: OUT=... bash benchmarks/run_check_device.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POWERFUSION_CACHE_DIR=${POWERFUSION_CACHE_DIR:-/tmp/pf-cache}
OUT=${OUT:-$(mktemp -d)}
LIMIT=${LIMIT_S:-560}
t0=$(date +%s)
left() { echo $((LIMIT - ($(date +%s) - t0))); }
LOGS=$(mktemp -d)
py() { timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "${@:2}"; }
T=${TESTS_S:-$((LIMIT / 3))}
( py $T tests/test_ort_dropin.py tests/test_artefact.py tests/test_bench.py tests/runtime > "$LOGS/api.txt" 2>&1 ) &
( py $T tests/precision/test_gpu_precision.py tests/ape > "$LOGS/precision-ape.txt" 2>&1 ) &
( py $T tests/backends tests/rewrite/test_gpu_rewritten.py > "$LOGS/backends.txt" 2>&1 ) &
( py $T tests/ttile > "$LOGS/ttile.txt" 2>&1 ) &
wait
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  for f in "$LOGS"/*.txt; do echo "== $(basename $f): $(tail -1 $f)"; done
  for f in "$LOGS"/*.txt; do echo; echo "######## $(basename $f)"; grep -v "^\.*s*\.*x*\s*\[" "$f" | tail -60; done
} > "$OUT/gpu-tests.txt" 2>&1
head -6 "$OUT/gpu-tests.txt"
B=$(mktemp -d)
timeout $(( $(left) / 3 )) python3 benchmarks/bench_iobinding.py > "$B/iobinding.log" 2>&1
cp benchmarks/results/iobinding-overhead.json benchmarks/results/iobinding-overhead.md "$OUT/" 2>/dev/null
timeout $(( $(left) / 2 )) python3 benchmarks/bench_precision.py --out "$OUT" > "$B/precision.log" 2>&1
timeout $(( $(left) - 10 )) python3 -m models.export_zoo --out /tmp/zoo --only swin_t maxvit_t --targets cpu,cuda > "$B/zoo.log" 2>&1
for f in iobinding precision zoo; do echo "######## $f"; tail -40 "$B/$f.log"; done > "$OUT/bench.log"
tail -60 "$OUT/bench.log"
