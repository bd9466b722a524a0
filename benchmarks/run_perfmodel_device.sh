#!/usr/bin/env bash
# Perf-model calibration and accuracy in one device call (writes under $OUT).
# Needs the prepared plans (python3 benchmarks/perfmodel_accuracy.py prepare out/perfmodel_plans.pkl),
# carried to the device as out/perfmodel_plans.pkl.
set -u
export PYTHONPATH="$PWD"
OUT="${OUT:-out/device}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
timeout 75 python3 benchmarks/calibrate.py "$OUT" > "$OUT/calibrate.log" 2>&1
echo "calibrate rc=$?"
CAL=$(ls "$OUT"/calibration-*.json 2>/dev/null | head -1)
timeout "${ACCURACY_TIMEOUT:-200}" python3 benchmarks/perfmodel_accuracy.py run "${PLANS:-out/perfmodel_plans.pkl}" "$OUT" ${CAL:+"$CAL"} \
    > "$OUT/accuracy.log" 2>&1
echo "accuracy rc=$?"
timeout 60 python3 -m pytest -q -m gpu tests/perfmodel -p no:cacheprovider > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"
tail -n 25 "$OUT/accuracy.log"; tail -n 3 "$OUT/gpu-tests.txt"; cat "$OUT/calibrate.log" | head -c 3000
