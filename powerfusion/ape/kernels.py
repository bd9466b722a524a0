"""CUDA source of Ape's memory-bound kernels: the splits (fp32 -> fp16 / bf16 / TF32 parts,
int16 -> int8 parts), the block-mask scan, the K-chunk reduction and the int16 combine.

One translation unit, no headers (NVRTC and nvcc take it as it is): fp16 and bf16
conversions are PTX `cvt.rn` (round to nearest even, Inf on overflow, subnormals kept), TF32
rounding is done on the bits, as `types.py` models them. The GEMMs themselves are cuBLAS.

Part layouts (P parts, Kp columns of K per part; see `device.py`): A's parts side by side
along K, [P0 | P1 | P2] (M x P*Kp), B's parts stacked in reverse, [P2; P1; P0] (P*Kp x N),
so every level of part products is one GEMM over a contiguous slice of both. A panel list
(`panels`, K panels of PANEL columns, or null for all of K in order) gathers the K columns of
one kind of panel; columns past K read as zero.
"""
from __future__ import annotations

PANEL = 128

_COMMON = r"""
#define PANEL %(panel)d
typedef unsigned short u16;
typedef unsigned int u32;
__device__ __forceinline__ u16 f2h(float x) { u16 h; asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(h) : "f"(x)); return h; }
__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %%0, %%1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2bf(float x) { u16 h; asm("cvt.rn.bf16.f32 %%0, %%1;" : "=h"(h) : "f"(x)); return h; }
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ bool finite32(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
// fp32 -> TF32 (10 mantissa bits), round to nearest even; a carry into the exponent gives Inf
__device__ __forceinline__ float tf32_rn(float x) {
    u32 u = __float_as_uint(x);
    if (!finite32(x)) return x;
    u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    return __uint_as_float(u);
}
// source column / row of destination index c (K gathered by panels, zero past K)
__device__ __forceinline__ long long gather(const int* panels, long long c, long long k) {
    long long s = panels ? (long long)panels[c / PANEL] * PANEL + c %% PANEL : c;
    return s < k ? s : -1;
}

// FP32-F: Hi = fp16(x), Lo = fp16((x - Hi) * 2^12)
__device__ __forceinline__ void split_f(float x, u16* p, long long stride) {
    bool fin = finite32(x);
    float xf = fin ? x : 0.f;
    u16 hi = f2h(xf);
    float r = xf - h2f(hi);
    u16 lo = f2h(r * 4096.f);
    p[0] = fin ? hi : f2h(x);
    p[stride] = fin ? lo : (u16)0;
}
// FP32-T: Hi = tf32(x), Lo = tf32(x - Hi), stored as fp32
__device__ __forceinline__ void split_t(float x, float* p, long long stride) {
    bool fin = finite32(x);
    float xf = fin ? x : 0.f;
    float hi = tf32_rn(xf);
    float lo = tf32_rn(xf - hi);
    p[0] = fin ? hi : x;
    p[stride] = fin ? lo : 0.f;
}
// FP32-B: Hi = bf16(x), Mi = bf16(x - Hi), Lo = bf16(x - Hi - Mi)
__device__ __forceinline__ void split_b(float x, u16* p, long long stride) {
    bool fin = finite32(x);
    float xf = fin ? x : 0.f;
    u16 hi = f2bf(xf);
    float r1 = xf - bf2f(hi);
    u16 mi = f2bf(r1);
    float r2 = r1 - bf2f(mi);
    u16 lo = f2bf(r2);
    p[0] = fin ? hi : f2bf(x);
    p[stride] = fin ? mi : (u16)0;
    p[2 * stride] = fin ? lo : (u16)0;
}
"""

_SPLIT = r"""
// A (M x K, row stride lda) -> parts side by side: out[m, p*Kp + c]
extern "C" __global__ void ape_split_%(t)s_a(const float* a, long long m, long long k, long long lda,
        const int* panels, long long kp, %(ptype)s* out) {
    long long total = m * kp;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long row = i / kp, c = i %% kp, s = gather(panels, c, k);
        float x = s >= 0 ? a[row * lda + s] : 0.f;
        split_%(t)s(x, out + row * (%(parts)d * kp) + c, kp);
    }
}
// B (K x N, row stride ldb) -> parts stacked in reverse: out[(P-1-p)*Kp + r, n]
extern "C" __global__ void ape_split_%(t)s_b(const float* b, long long k, long long n, long long ldb,
        const int* panels, long long kp, %(ptype)s* out) {
    long long total = kp * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / n, col = i %% n, s = gather(panels, r, k);
        float x = s >= 0 ? b[s * ldb + col] : 0.f;
        // parts p = 0, 1, .. go to row blocks P-1, P-2, ..: a negative stride
        split_%(t)s(x, out + ((%(parts)d - 1) * kp + r) * n + col, -kp * n);
    }
}
"""

_OTHERS = r"""
// Ape's getMask: per block of rows x cols the largest element class
// (0 FP32-F incl. zero, 1 FP32-B, 2 fp32: Inf, NaN, |x| < 2^-110, |x| >= 2^127)
__device__ __forceinline__ int elem_class(float x) {
    u32 u = __float_as_uint(x);
    int e = (u >> 23) & 0xff;
    return (u & 0x7fffffffu) == 0 ? 0 : (e < 17 || e >= 254) ? 2 : (e < 113 || e >= 142) ? 1 : 0;
}
__device__ __forceinline__ int max4_class(float4 v) {
    return max(max(elem_class(v.x), elem_class(v.y)), max(elem_class(v.z), elem_class(v.w)));
}
extern "C" __global__ void ape_block_mask(const float* x, long long rows, long long cols, long long ld,
        int br, int bc, signed char* mask) {
    long long r0 = (long long)blockIdx.y * br, c0 = (long long)blockIdx.x * bc;
    int nrows = (int)min((long long)br, rows - r0), ncols = (int)min((long long)bc, cols - c0);
    // 16-byte loads where every row of the block starts 16-byte aligned (a memory-bound scan:
    // four times fewer loads in flight per element than scalar ones)
    bool vec = ((ld | c0 | bc) & 3) == 0 && (((unsigned long long)x) & 15) == 0;
    int per_row = vec ? (ncols + 3) / 4 : ncols;
    int cls = 0;
#pragma unroll 4
    for (int i = threadIdx.x; i < nrows * per_row; i += blockDim.x) {
        int rr = i / per_row, cc = i - rr * per_row;
        const float* p = x + (r0 + rr) * ld + c0;
        if (!vec) {
            cls = max(cls, elem_class(p[cc]));
        } else if (4 * cc + 4 <= ncols) {
            cls = max(cls, max4_class(*(const float4*)(p + 4 * cc)));
        } else {
            for (int j = 4 * cc; j < ncols; ++j) cls = max(cls, elem_class(p[j]));
        }
    }
    int any1 = __syncthreads_or(cls >= 1), any2 = __syncthreads_or(cls >= 2);
    if (threadIdx.x == 0) mask[(long long)blockIdx.y * gridDim.x + blockIdx.x] = any2 ? 2 : any1 ? 1 : 0;
}

// C = (((C) + alpha W[0]) + alpha W[1]) + ...: the GEMMs of K chunks added to C in
// round-to-nearest, one at a time, in the order of the beta = 1 chain they replace
extern "C" __global__ void ape_reduce_chunks(const float* w, int nb, long long mn, float alpha, int accumulate, float* c) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < mn; i += (long long)gridDim.x * blockDim.x) {
        float s = accumulate ? c[i] : 0.f;
        for (int b = 0; b < nb; ++b) s = __fadd_rn(s, __fmul_rn(alpha, w[b * mn + i]));
        c[i] = s;
    }
}

// int16 A (M x K) -> int8 parts [Ah | Al] (M x 2Kp), x = 256 hi + lo + 128; columns past K are 0
extern "C" __global__ void ape_split_i16_a(const short* a, long long m, long long k, long long kp, signed char* out) {
    long long total = m * kp;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long row = i / kp, c = i %% kp;
        int x = c < k ? (int)a[row * k + c] : 0;
        bool pad = c >= k;
        out[row * 2 * kp + c] = pad ? 0 : (signed char)(x >> 8);
        out[row * 2 * kp + kp + c] = pad ? 0 : (signed char)((x & 255) - 128);
    }
}
// int16 B (K x N) -> transposed int8 parts [Bl | Bh] (N x 2Kp), through a 32 x 32 tile
extern "C" __global__ void ape_split_i16_b(const short* b, long long k, long long n, long long kp, signed char* out) {
    __shared__ short tile[32][33];
    long long k0 = (long long)blockIdx.y * 32, n0 = (long long)blockIdx.x * 32;
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        long long kk = k0 + r, nn = n0 + threadIdx.x;
        tile[r][threadIdx.x] = (kk < k && nn < n) ? b[kk * n + nn] : (short)0;
    }
    __syncthreads();
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        long long nn = n0 + r, kk = k0 + threadIdx.x;
        if (nn >= n || kk >= kp) continue;
        int x = tile[threadIdx.x][r];
        bool pad = kk >= k;
        out[nn * 2 * kp + kk] = pad ? 0 : (signed char)((x & 255) - 128);
        out[nn * 2 * kp + kp + kk] = pad ? 0 : (signed char)(x >> 8);
    }
}
// row sums of int16 A (one block per row) and column sums of B (one thread per column), mod 2^32
extern "C" __global__ void ape_row_sums_i16(const short* a, long long k, u32* sums) {
    __shared__ u32 part[256];
    u32 s = 0;
    for (long long c = threadIdx.x; c < k; c += blockDim.x) s += (u32)(int)a[blockIdx.x * k + c];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) sums[blockIdx.x] = part[0];
}
extern "C" __global__ void ape_col_sums_i16(const short* b, long long k, long long n, u32* sums) {
    long long col = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (col >= n) return;
    u32 s = 0;
    for (long long r = 0; r < k; ++r) s += (u32)(int)b[r * n + col];
    sums[col] = s;
}
// C = 2^16 HH + 2^8 (HL + LH) + LL + 128 (rowsum A + colsum B) - 2^14 K, wrapping mod 2^32
extern "C" __global__ void ape_combine_i16(const int* hh, const int* cross, const int* ll, const u32* rs,
        const u32* cs, long long m, long long n, long long k, int* c) {
    long long total = m * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long row = i / n, col = i %% n;
        u32 v = (u32)hh[i] * 65536u + (u32)cross[i] * 256u + (u32)ll[i] + 128u * (rs[row] + cs[col])
                - (u32)((unsigned long long)(16384ull * (unsigned long long)k) & 0xffffffffull);
        c[i] = (int)v;
    }
}
"""

SPLIT_TYPES = {"f": ("u16", 2), "t": ("float", 2), "b": ("u16", 3)}
MODE_LETTER = {"fp32-f": "f", "fp32-t": "t", "fp32-b": "b"}


def source() -> str:
    """The whole translation unit."""
    parts = [_COMMON % {"panel": PANEL}]
    for t, (ptype, n) in SPLIT_TYPES.items():
        parts.append(_SPLIT % {"t": t, "ptype": ptype, "parts": n})
    parts.append(_OTHERS % {})
    return "\n".join(parts)


KERNEL_NAMES = tuple([f"ape_split_{t}_{s}" for t in SPLIT_TYPES for s in "ab"]
                     + ["ape_block_mask", "ape_reduce_chunks", "ape_split_i16_a", "ape_split_i16_b",
                        "ape_row_sums_i16", "ape_col_sums_i16", "ape_combine_i16"])
