#!/usr/bin/env bash
# One device call after a round of changes: every GPU test outside the conformance sweep, in
# parallel groups (installing the cuDNN frontend from a carried .whl/ when it does not import),
# and, when PROFILE_CASE is set (e.g. "convnext_tiny fp16"), a per-kernel profile of one zoo
# case beside them (its timings are then only indicative: the tests share the GPU).
# Usage on the GPU machine, from the repository root: OUT=... bash benchmarks/run_check_device.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POWERFUSION_CACHE_DIR=${POWERFUSION_CACHE_DIR:-/tmp/pf-cache}
OUT=${OUT:-$(mktemp -d)}
T=${TESTS_S:-420}
if ! python3 -c "import cudnn" 2>/dev/null; then
  for w in .whl/nvidia_cudnn_frontend-*.whl; do [ -f "$w" ] && python3 -m pip install -q --no-deps --no-index "$w"; done
fi
LOGS=$(mktemp -d)
py() { timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "${@:2}"; }
( py $T tests/test_*.py tests/unit tests/runtime tests/viz > "$LOGS/api-runtime.txt" 2>&1 ) &
( py $T tests/precision tests/ape tests/reliability > "$LOGS/precision-ape-reliability.txt" 2>&1 ) &
( py $T tests/backends tests/rewrite tests/gir tests/templates tests/perfmodel > "$LOGS/backends-rewrite.txt" 2>&1 ) &
( py $T tests/ttile tests/frontend tests/models > "$LOGS/ttile-frontend-models.txt" 2>&1 ) &
if [ -n "${PROFILE_CASE:-}" ]; then
  set -- $PROFILE_CASE
  ( POWERFUSION_SEARCH_BUDGET_S=2 timeout $T python3 benchmarks/bench_zoo.py --models "$1" --batches 1 --dtypes "$2" \
      --impls powerfusion,torch-compile --profile "$1" --out "$LOGS/prof" --exports build/zoo-onnx > "$LOGS/prof.log" 2>&1
    cp "$LOGS/prof/zoo-profile.md" "$OUT/profile-$1-$2.md" 2>/dev/null ) &
fi
wait
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  for f in "$LOGS"/*.txt; do echo "== $(basename $f): $(tail -n 1 $f)"; done
  for f in "$LOGS"/*.txt; do echo; echo "######## $(basename $f)"; grep -v "^\.*s*\.*x*\s*\[" "$f" | tail -n 60; done
} > "$OUT/gpu-tests.txt" 2>&1
[ -f "$LOGS/prof.log" ] && tail -n 20 "$LOGS/prof.log" > "$OUT/profile.log"
head -n 6 "$OUT/gpu-tests.txt"
