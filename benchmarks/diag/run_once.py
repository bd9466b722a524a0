"""Build a CUDA session for an ONNX model and run it once (eagerly, no CUDA graph): the process
to put under Nsight Compute to see our generated kernels one by one, e.g.
    ncu --kernel-name regex:'sg[0-9]+_k' --launch-count 8 --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats python3 benchmarks/diag/run_once.py MODEL.onnx
"""
from __future__ import annotations

import sys

import numpy as np


def main(path: str) -> None:
    from powerfusion import InferenceSession
    sess = InferenceSession(path, target="cuda")
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        dt = np.dtype({"tensor(float16)": np.float16, "tensor(int64)": np.int64}.get(i.type, np.float32))
        feeds[i.name] = (rng.integers(0, 100, i.shape) if dt.kind == "i" else rng.standard_normal(i.shape)).astype(dt)
    sess.run(None, feeds)
    print("ran", path, "with", {k: v.shape for k, v in feeds.items()})


if __name__ == "__main__":
    main(sys.argv[1])
