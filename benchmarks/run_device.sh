#!/usr/bin/env bash
# One device call: finish precompiling plans (parallel; plans compiled elsewhere are carried in
# build/plans), warm torch.compile's caches in parallel, then time everything. Results in $OUT.
# Usage on the GPU machine, from the repository root:
#   SUITES="norms subgraphs" bash benchmarks/run_device.sh
# PRECOMPILE_ARGS=--tune: plans compiled as `powerfusion compile --tune` (the model's top plans
# timed on this device, the measured best kept); the rows then measure tuned plans.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POWERFUSION_CACHE_DIR=${POWERFUSION_CACHE_DIR:-/tmp/pf-cache}
OUT=${OUT:-$(mktemp -d)}
PLANS=${PLANS:-build/plans}
SUITES=${SUITES:-norms subgraphs}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
git rev-parse HEAD >> "$OUT/device.txt" 2>/dev/null
timeout "${PRECOMPILE_S:-150}" python3 benchmarks/precompile.py --out "$PLANS" --suites $SUITES --skip-existing ${PRECOMPILE_ARGS:-} \
    --jobs "${JOBS:-12}" --timeout-s "${COMPILE_TIMEOUT_S:-140}" > "$OUT/precompile.log" 2>&1 &
PRE=$!
timeout "${WARM_S:-150}" python3 benchmarks/warm_torch_compile.py --suites $SUITES --jobs "${WARM_JOBS:-4}" ${WARM_ARGS:-} \
    > "$OUT/warm.log" 2>&1
wait $PRE
cp "$PLANS/compile.json" "$OUT/compile.json" 2>/dev/null
echo "plans: $(ls $PLANS/*.pkl 2>/dev/null | wc -l); $(tail -1 $OUT/warm.log)"
timeout "${BENCH_S:-280}" python3 benchmarks/bench_gir.py --suite $SUITES --plans "$PLANS" --out "$OUT" \
    --budget-s "${BENCH_BUDGET_S:-260}" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
tail -70 "$OUT/bench.log"
