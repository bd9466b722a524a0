"""What a weight-streaming kernel can reach at the typed GEMV's sizes (a diagnostic, not a row).

    PYTHONPATH=$PWD python3 benchmarks/diag/gemv_floor.py [--json OUT]

Times, with the typed-GEMM benchmark's harness (CUDA-graph replays over buffer sets rotated
past L2), a kernel that only reads N bytes (16-byte non-caching loads, grid-stride, one word
written per thread so nothing is optimised away) at the packed-weight sizes of the benchmark's
shapes, an empty kernel (the graph's per-launch cost), and the fp16 x int4 GEMV at the same
bytes: the gap between the read kernel and the copy-bandwidth floor is what no GEMV of that
size can recover in this harness; the gap between the GEMV and the read kernel is ours.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

READ_SRC = r"""
extern "C" __global__ void __launch_bounds__(256) read_only(const uint4* __restrict__ p, unsigned long long n16,
                                                            unsigned int* __restrict__ out) {
  unsigned int acc = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  #pragma unroll 4
  for (; i < n16; i += stride) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
extern "C" __global__ void empty_kernel(unsigned int* out) { if (out == nullptr) out[0] = 1; }
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    import cupy as cp
    from benchmarks.ttile.bench import SHAPES, bench_typed, copy_bandwidth, n_sets, timed, weight_bytes
    from powerfusion.ttile.matmul import Matmul
    mod = cp.RawModule(code=READ_SRC)
    read, empty = mod.get_function("read_only"), mod.get_function("empty_kernel")
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    bw, _ = copy_bandwidth()
    out = cp.zeros(sms * 8 * 256, cp.uint32)
    t_empty, _ = timed([lambda: empty((1,), (32,), (out,))])
    rows = [dict(kind="empty kernel", time_us=t_empty * 1e6)]
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; empty kernel {t_empty * 1e6:.2f} us per launch", flush=True)
    for N, K in SHAPES:
        mm = Matmul(1, N, K, "fp16", "int4")
        nbytes = weight_bytes(mm)
        bufs = [cp.random.randint(0, 1 << 31, nbytes // 4, dtype=cp.int64).astype(cp.uint32)
                for _ in range(n_sets(nbytes))]
        best = None
        for blocks_per_sm in (2, 4, 8):
            grid = sms * blocks_per_sm
            t, _ = timed([lambda b=b, g=grid: read((g,), (256,), (b, cp.uint64(b.nbytes // 16), out)) for b in bufs])
            best = t if best is None or t < best else best
        t_gemv, _ = bench_typed(mm)
        floor = nbytes / bw
        row = dict(N=N, K=K, bytes=nbytes, floor_us=floor * 1e6, read_us=best * 1e6, gemv_us=t_gemv * 1e6,
                   read_frac=floor / best, gemv_frac=floor / t_gemv, gemv_of_read=best / t_gemv)
        rows.append(row)
        print(f"{N}x{K}: {nbytes / 2**20:.1f} MiB, floor {floor * 1e6:.1f} us, read-only {best * 1e6:.1f} us "
              f"({floor / best:.2f} of floor), int4 GEMV {t_gemv * 1e6:.1f} us ({floor / t_gemv:.2f}; "
              f"{best / t_gemv:.2f} of the read kernel)", flush=True)
        del bufs
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_bandwidth_GBps=bw / 1e9, rows=rows), indent=1))


if __name__ == "__main__":
    main()
