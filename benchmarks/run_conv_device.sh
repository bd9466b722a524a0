#!/usr/bin/env bash
# On the GPU machine, from the repository root: install the cuDNN frontend from a wheel when it
# does not import (the machine has no network; cuDNN's own libraries come with torch's
# nvidia-cudnn-cu13), run the conv GPU tests, then benchmarks/bench_conv.py. Logs and results in $OUT.
#   CUDNN_FRONTEND_WHEEL=path/to/nvidia_cudnn_frontend-*.whl bash benchmarks/run_conv_device.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 POWERFUSION_CACHE_DIR=${POWERFUSION_CACHE_DIR:-/tmp/pf-cache}
OUT=${OUT:-$(mktemp -d)}
if ! python3 -c "import cudnn" 2>/dev/null && [ -n "${CUDNN_FRONTEND_WHEEL:-}" ]; then
  python3 -m pip install -q --no-deps --no-index "$CUDNN_FRONTEND_WHEEL" 2>&1 | tail -2
fi
python3 -c "from powerfusion.backends.cuda import cudnn_conv as c; m, why = c.load(); \
print('cudnn frontend', getattr(m, '__version__', None), 'backend', m and m.backend_version(), why)"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
    tests/runtime/test_cudnn_conv_gpu.py tests/runtime/test_blas_gpu.py > "$OUT/gpu-conv-tests.txt" 2>&1
  tail -n 25 "$OUT/gpu-conv-tests.txt"
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_S:-200}" python3 benchmarks/bench_conv.py --out "$OUT" --budget-s "${BUDGET_S:-170}" \
    ${BENCH_ARGS:-} > "$OUT/bench-conv.log" 2>&1
  tail -n 40 "$OUT/bench-conv.log"
fi
