"""LayerNorm, RMSNorm and softmax over the last axis, fp32 and bf16, M x N with
M = 32768 and N in {256, 1024, 4096, 16384, 65536}: torch eager and torch.compile baselines.

Shapes are capped at 2^28 elements per tensor (1 GiB in fp32) by lowering M for the
largest N (N = 16384 -> M = 16384, N = 65536 -> M = 4096): it keeps every row width and
every case within a few minutes of GPU time, and each tensor is still far beyond L2.
`--budget-s` stops early; cases not reached are written as rows with an error saying so.

    PYTHONPATH=$PWD python3 benchmarks/bench_norms.py [--out DIR] [--budget-s 150]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import bench_torch, torch_impls  # noqa: E402
from harness import copy_bandwidth, l2_bytes, run_metadata, write_results  # noqa: E402

M, NS, MAX_ELEMENTS, EPS = 32768, (256, 1024, 4096, 16384, 65536), 1 << 28, 1e-5


def cases():
    import torch
    import torch.nn.functional as F

    def layernorm(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS)

    def rmsnorm(x, w, b):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    def softmax(x, w, b):
        return torch.softmax(x, dim=-1)
    # case -> (fn, how many N-vectors of parameters it reads)
    return {"layernorm": (layernorm, 2), "rmsnorm": (rmsnorm, 1), "softmax": (softmax, 0)}


def shapes():
    return [(min(M, MAX_ELEMENTS // n), n) for n in NS]


def main(argv=None) -> int:
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    copy_bw, l2 = copy_bandwidth(), l2_bytes()
    meta = run_metadata(copy_bandwidth_GBps=round(copy_bw / 1e9, 1), l2_bytes=l2,
                        notes=["bytes = input read + output written + parameters read; "
                               "bw_fraction = bytes / device time / measured copy bandwidth",
                               f"tensors capped at {MAX_ELEMENTS} elements by lowering M",
                               "device time from CUDA-graph replay over input sets that exceed 2x L2; "
                               "latency = wall time of one call + synchronize (median)"])
    rows = []
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        for case, (fn, nparams) in cases().items():
            impls = torch_impls(fn)  # one torch.compile object per case: recompiles per shape
            for m, n in shapes():
                if time.perf_counter() - start > args.budget_s:
                    rows += [{"case": case, "dtype": dtype_name, "shape": [m, n], "impl": impl,
                              "device_time_s": None, "error": "skipped: time budget spent"} for impl in impls]
                    continue
                size = dtype.itemsize
                moved = 2 * m * n * size + nparams * n * size

                def make_args(m=m, n=n, dtype=dtype):
                    x = torch.randn(m, n, device="cuda", dtype=dtype)
                    return x, torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
                try:
                    rows += bench_torch(case, dtype_name, (m, n), impls, make_args, moved, copy_bw, l2,
                                        bytes_per_set=m * n * size)
                except Exception as e:  # record the failure, keep the other cases
                    rows.append({"case": case, "dtype": dtype_name, "shape": [m, n], "impl": "all",
                                 "device_time_s": None, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                torch.cuda.empty_cache()
                print(f"{time.perf_counter() - start:6.1f}s {case} {dtype_name} {m}x{n}", flush=True)
                write_results("norms", rows, meta, args.out)  # partial results survive a timeout
    json_path, md_path = write_results("norms", rows, meta, args.out)
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
