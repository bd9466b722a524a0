"""Run a CUDA kernel whose threads cooperate (shared memory, __syncthreads, warp shuffles,
atomics) on the CPU: the source compiled as C++20 by the host compiler, each block's threads as
std::threads (blocks one after another), __shared__ arrays as statics of the kernel function,
__syncthreads as a std::barrier over the block, __shfl_xor_sync as an exchange through memory
between two barriers of the warp. Exact for kernels whose warps only exchange through those
(every lane of a warp reaches each shuffle, as CUDA requires with a full mask). float, __half
(as _Float16) and __nv_bfloat16 (bit patterns, rounded to nearest even) operands.

cuda_emulator.py runs threads one after another and so refuses such kernels; this one is slower
(a thread per CUDA thread), so tests keep grids small."""
from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np

_PRELUDE = r"""
#include <math.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>
using std::min; using std::max;
struct uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct pf_dim3 { unsigned x, y, z; };
static thread_local pf_dim3 threadIdx, blockIdx;
static pf_dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
struct __half { _Float16 v; };
struct __nv_bfloat16 { unsigned short v; };
static inline float __half2float(__half x) { return (float)x.v; }
static inline __half __float2half_rn(float x) { return {(_Float16)x}; }
static inline float __bfloat162float(__nv_bfloat16 x) { unsigned u = (unsigned)x.v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline __nv_bfloat16 __float2bfloat16_rn(float x) {
    unsigned u; memcpy(&u, &x, 4); u += 0x7fffu + ((u >> 16) & 1u); return {(unsigned short)(u >> 16)}; }
static inline float __int_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static std::barrier<>* pf_block_barrier;
static std::barrier<>* pf_warp_barrier[64];
static float pf_lanes[64][32];
#define __syncthreads() pf_block_barrier->arrive_and_wait()
static inline float __shfl_xor_sync(unsigned, float v, int off) {
    const unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
    pf_lanes[w][l] = v;
    pf_warp_barrier[w]->arrive_and_wait();
    const float r = pf_lanes[w][l ^ (unsigned)off];
    pf_warp_barrier[w]->arrive_and_wait();
    return r;
}
"""

_LAUNCHER = r"""
extern "C" void pf_launch(void** args, unsigned gx, unsigned gy, unsigned threads) {
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            std::barrier<> block(threads);
            pf_block_barrier = &block;
            std::vector<std::unique_ptr<std::barrier<>>> warps;
            for (unsigned w = 0; w < threads / 32; ++w) {
                warps.emplace_back(new std::barrier<>(32));
                pf_warp_barrier[w] = warps.back().get();
            }
            std::vector<std::thread> team;
            for (unsigned t = 0; t < threads; ++t)
                team.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; CALL; });
            for (auto& th : team) th.join();
        }
}
"""


def build(source: str, kernel: str, params: list[tuple[str, bool]], workdir: Path):
    """Compile `source` (CUDA includes dropped) with a launcher of `kernel`, whose parameters are
    (C type, passed as a pointer) in order; returns a callable launch(args, grid, threads)."""
    body = re.sub(r"^#include <cuda_.*$", "", source, flags=re.MULTILINE)
    call = ", ".join(f"({t})args[{i}]" if ptr else f"*({t}*)args[{i}]" for i, (t, ptr) in enumerate(params))
    text = _PRELUDE + body + _LAUNCHER.replace("CALL", f"{kernel}({call})")
    src, lib = workdir / "kernel.cpp", workdir / "kernel.so"
    src.write_text(text)
    proc = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                           "-o", str(lib), str(src)], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"host compile failed:\n{proc.stderr[-3000:]}")
    so = ctypes.CDLL(str(lib))

    def launch(args, grid: tuple[int, int], threads: int) -> None:
        keep = []   # scalars must outlive the call
        ptrs = (ctypes.c_void_p * len(args))()
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                ptrs[i] = a.ctypes.data
            else:
                keep.append(a)
                ptrs[i] = ctypes.cast(ctypes.pointer(a), ctypes.c_void_p)
        so.pf_launch(ptrs, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(threads))
    return launch
