#!/usr/bin/env bash
# One device call of the model-zoo benchmark: installs the cuDNN frontend from a carried wheel
# when it does not import (the GPU machine has no network), runs bench_zoo.py on the models
# given, merging into benchmarks/results/zoo.{json,md}, and copies those into $OUT.
#   MODELS=vit_b_16,bert BATCHES=1 DTYPES=fp32 BUDGET_S=480 POWERFUSION_GIT_COMMIT=<sha> bash benchmarks/run_zoo_device.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POWERFUSION_CACHE_DIR=${POWERFUSION_CACHE_DIR:-/tmp/pf-cache}
# the search runs with its defaults (a plan-count budget, no wall-clock cap), as a user gets it
OUT=${OUT:-$(mktemp -d)}
if ! python3 -c "import cudnn" 2>/dev/null; then
  for w in .whl/nvidia_cudnn_frontend-*.whl; do [ -f "$w" ] && python3 -m pip install -q --no-deps --no-index "$w"; done
fi
timeout $(( ${BUDGET_S:-480} + 100 )) python3 benchmarks/bench_zoo.py --models "${MODELS:-resnet18}" \
  --batches "${BATCHES:-1}" --dtypes "${DTYPES:-fp32}" --merge --out benchmarks/results \
  --exports build/zoo-onnx --budget-s "${BUDGET_S:-480}" ${PROFILE:+--profile "$PROFILE"} > "$OUT/zoo.log" 2>&1
cp benchmarks/results/zoo* "$OUT/" 2>/dev/null
tail -n 30 "$OUT/zoo.log"
