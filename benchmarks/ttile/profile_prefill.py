"""Launch the prefill kernel's default tile a few times at M = 16, 64, 256 (N = K = 8192, W4A16),
for a profiler to capture (`ncu -k regex:ttile_tc python -m benchmarks.ttile.profile_prefill`)."""
from __future__ import annotations

import sys


def main(ms=(16, 64, 256), N=8192, K=8192):
    import cupy as cp
    from powerfusion.ttile.matmul import Matmul
    for M in ms:
        mm = Matmul(M, N, K, "fp16", "int4", group_size=128)
        w = cp.random.randint(0, 1 << 31, N * K // 8, dtype=cp.int64).astype(cp.uint32)
        sc = cp.full(N * K // 128, 0.01, cp.float16)
        a = (cp.random.standard_normal((M, K), dtype=cp.float32)).astype(cp.float16)
        mm(a, [w, sc, None, None])
        cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main(tuple(int(x) for x in sys.argv[1:]) or (16, 64, 256))
