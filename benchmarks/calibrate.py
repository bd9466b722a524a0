"""Microbenchmarks that calibrate the perf model on the lent GPU (CuPy, run on the device).

    python3 benchmarks/calibrate.py $OUT     # writes $OUT/calibration-<key>.json

Measured, each by CUDA events around CUDA-graph replays (no host launch gaps):
- copy bandwidth: cupy device-to-device copy of 1 GiB and our float4 grid-stride copy;
- uncoalesced reads / writes: a 4096 x 4096 float transpose read-strided and write-strided,
  against a plain copy: the rate at which the extra 32-byte sectors are served;
- the smallest real kernel (one block copying 8 KiB), i.e. launch + latency + drain;
- achievable bandwidth vs resident warps per SM: the float4 copy with one block of w warps
  per SM, w = 1..32, at 1 and 4 independent loads in flight per lane; a Little's-law fit
  gives the latency the model uses (bandwidth = warps x bytes in flight / latency);
- kernel launch cost: replay of a graph of 200 empty kernels, per kernel;
- __syncthreads cost: a loop of barriers in 128-thread blocks (minus the same loop without);
- shared-memory bandwidth: float4 reads and writes of a shared array in a loop, every SM;
- L2 bandwidth: repeated reads of a buffer a quarter of the L2 size.
"""
from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SRC = r"""
extern "C" __global__ void empty_kernel() {}

extern "C" __global__ void copy4(const float4* __restrict__ x, float4* __restrict__ y, long long n) {
  long long stride = (long long)gridDim.x * blockDim.x;
  #pragma unroll 1
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) y[k] = x[k];
}

extern "C" __global__ void copy4_ilp4(const float4* __restrict__ x, float4* __restrict__ y, long long n) {
  long long stride = (long long)gridDim.x * blockDim.x;
  long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  #pragma unroll 1
  for (; k + 3 * stride < n; k += 4 * stride) {
    float4 a = x[k], b = x[k + stride], c = x[k + 2 * stride], d = x[k + 3 * stride];
    y[k] = a; y[k + stride] = b; y[k + 2 * stride] = c; y[k + 3 * stride] = d;
  }
  for (; k < n; k += stride) y[k] = x[k];
}

// y (R x C) from x (C x R): one of the two sides walks with a stride of R floats across lanes
extern "C" __global__ void strided_read(const float* __restrict__ x, float* __restrict__ y, int R, int C) {
  long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (k < (long long)R * C) { long long r = k / C, c = k % C; y[k] = x[c * R + r]; }
}
extern "C" __global__ void strided_write(const float* __restrict__ x, float* __restrict__ y, int R, int C) {
  long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (k < (long long)R * C) { long long r = k / C, c = k % C; y[c * R + r] = x[k]; }
}
extern "C" __global__ void plain_copy(const float* __restrict__ x, float* __restrict__ y, int R, int C) {
  long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (k < (long long)R * C) y[k] = x[k];
}

extern "C" __global__ void syncs(float* out, int iters, int do_sync) {
  float acc = threadIdx.x;
  for (int k = 0; k < iters; ++k) {
    acc = acc * 0.999f + 1.0f;
    if (do_sync) __syncthreads();
  }
  if (acc == -1.0f) out[0] = acc;
}

extern "C" __global__ void shared_rw(float* out, int iters) {
  __shared__ float4 s[1024];
  int t = threadIdx.x;
  s[t] = make_float4(t, t, t, t);
  __syncthreads();
  float4 acc = make_float4(0, 0, 0, 0);
  for (int k = 0; k < iters; ++k) {
    float4 v = s[(t + k) & 1023];
    acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
  }
  if (acc.x == -1.0f) out[0] = acc.x + acc.y + acc.z + acc.w;
}

extern "C" __global__ void l2_read(const float4* __restrict__ x, float* out, long long n, int reps) {
  float acc = 0.0f;
  long long stride = (long long)gridDim.x * blockDim.x;
  for (int r = 0; r < reps; ++r)
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
      float4 v = x[k]; acc += v.x + v.y + v.z + v.w;
    }
  if (acc == -1.0f) out[0] = acc;
}
"""


class Timer:
    """Seconds per call of `launch()` from CUDA-graph replays timed by events."""

    def __init__(self):
        import cupy
        self.cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def __call__(self, launch, calls: int = 1, target_s: float = 0.05) -> float:
        cp, s = self.cp, self.stream
        with s:
            launch()
            s.synchronize()
            s.begin_capture()
            for _ in range(calls):
                launch()
            g = s.end_capture()
            g.launch(s)
            s.synchronize()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            once = cp.cuda.get_elapsed_time(a, b) / 1e3
            reps = max(1, min(1000, int(target_s / max(once, 1e-7))))
            best = float("inf")
            for _ in range(3):
                a.record(s)
                for _ in range(reps):
                    g.launch(s)
                b.record(s)
                b.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(a, b) / 1e3 / (reps * calls))
        return best


def calibrate() -> dict:
    import cupy as cp
    from powerfusion.targets.calibration import target_key
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sms = props["multiProcessorCount"]
    l2 = props.get("l2CacheSize", 50 << 20)
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    k = {n: mod.get_function(n) for n in ("empty_kernel", "copy4", "copy4_ilp4", "syncs", "shared_rw", "l2_read",
                                           "strided_read", "strided_write", "plain_copy")}
    timer = Timer()
    out = {"device": name, "key": target_key(name), "sms": sms, "l2_bytes": int(l2),
           "date": _dt.date.today().isoformat(), "ilp_controlled": True}

    nbytes = 1 << 30
    x = cp.ones(nbytes // 4, dtype=cp.float32)
    y = cp.empty_like(x)
    out["cupy_copy_bandwidth"] = 2 * nbytes / timer(lambda: y.__setitem__(Ellipsis, x))
    n4 = nbytes // 16
    best = 0.0
    for blocks_per_sm in (4, 8, 16):
        t = timer(lambda: k["copy4_ilp4"]((sms * blocks_per_sm,), (256,), (x, y, np.int64(n4))))
        best = max(best, 2 * nbytes / t)
    out["copy_bandwidth"] = max(best, out["cupy_copy_bandwidth"])

    curve = []
    for ilp, kern in ((1, "copy4"), (4, "copy4_ilp4")):
        for w in (1, 2, 4, 8, 16, 32):
            t = timer(lambda: k[kern]((sms,), (32 * w,), (x, y, np.int64(n4))))
            curve.append({"warps_per_sm": w, "ilp": ilp, "bytes_in_flight_per_warp": 512 * ilp,
                          "bandwidth": 2 * nbytes / t})
    out["bw_vs_warps"] = curve
    # Little's law on the unsaturated points: latency = warps x in-flight bytes / read bandwidth
    lat = [p["warps_per_sm"] * sms * p["bytes_in_flight_per_warp"] / (p["bandwidth"] / 2)
           for p in curve if p["bandwidth"] < 0.6 * out["copy_bandwidth"]]
    out["latency_fit"] = {"latency_s": float(np.median(lat)) if lat else None, "points": len(lat)}
    if out["latency_fit"]["latency_s"] is None:
        out["latency_fit"].pop("latency_s")
    # uncoalesced accesses: every lane touches its own 32-byte sector, 8x the minimal sector
    # traffic for 4-byte elements; the extra 7x is served at the rate measured here
    R = C = 4096
    args = (x, y, np.int32(R), np.int32(C))
    grid = ((R * C + 255) // 256,)
    base = timer(lambda: k["plain_copy"](grid, (256,), args))
    extra = R * C * 4 * 7.0
    for side in ("read", "write"):
        t = timer(lambda: k[f"strided_{side}"](grid, (256,), args))
        out[f"strided_{side}_s"] = t
        out[f"scatter_{side}_bandwidth"] = extra / max(t - base, 1e-9)
    out["plain_copy_16M_s"] = base
    # the smallest real kernel: one block copies 8 KiB
    out["tiny_kernel_s"] = timer(lambda: k["copy4"]((1,), (128,), (x, y, np.int64(512))), calls=50)
    x = y = None  # free the 2 GiB before the next measurements

    out["launch_s"] = timer(lambda: k["empty_kernel"]((1,), (32,), ()), calls=200)
    sink = cp.zeros(1, dtype=cp.float32)
    iters = 4096
    with_sync = timer(lambda: k["syncs"]((sms * 4,), (128,), (sink, np.int32(iters), np.int32(1))))
    without = timer(lambda: k["syncs"]((sms * 4,), (128,), (sink, np.int32(iters), np.int32(0))))
    # 4 blocks per SM share the SM: one barrier costs the block its share of that time
    out["block_sync_s"] = max(0.0, (with_sync - without) / iters)
    out["sync_loop_s"] = {"with": with_sync, "without": without, "iters": iters, "blocks_per_sm": 4}

    iters = 4096
    t = timer(lambda: k["shared_rw"]((sms * 8,), (256,), (sink, np.int32(iters))))
    out["shared_bandwidth"] = sms * 8 * 256 * 16 * iters / t

    n = (l2 // 4) // 16
    buf = cp.ones(n * 4, dtype=cp.float32)
    reps = 64
    t = timer(lambda: k["l2_read"]((sms * 8,), (256,), (buf, sink, np.int64(n), np.int32(reps))))
    out["l2_bandwidth"] = n * 16 * reps / t
    return out


def main(out_dir: str) -> dict:
    cal = calibrate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"calibration-{cal['key'] or 'gpu'}.json").write_text(json.dumps(cal, indent=1))
    return cal


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "."), indent=1))
