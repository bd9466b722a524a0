"""CUDA source of Ape's own tensor-core GEMMs (`ape_mma_f`, `ape_mma_t`, `ape_mma_b`): C (+)=
the emulated product of the split parts, with round-to-nearest fp32 accumulation.

Why our own kernel: cuBLAS accumulates each GEMM on the tensor cores, which truncate every
partial sum, and that error grows with K (docs/ape.md). Here each k-step's top product (Hi x Hi,
one m16n8k16 fp16 / bf16 or m16n8k8 TF32 mma) starts from zero and is added to an fp32
accumulator with an ordinary (round-to-nearest) FADD; the lower levels (cross terms, 2^-11 of
C or less) run in a second mma accumulator that is folded in with an FFMA at the end of every
BK-wide k-tile. So no truncating sum runs longer than one mma for the top level or one k-tile
for the rest. `reference.fused_matmul` models this order.

The kernel reads the parts written by the split kernels (`kernels.py`, same layouts as the
cuBLAS path: A's parts side by side along K, B's parts stacked in reverse), not fp32: a split
inside the loop costs per element a convert, a subtract, a multiply and a second convert,
either in every warp that reads the element (issue slots the mma loop needs) or once per block
through a second shared-memory buffer (shared-memory bandwidth the fragment loads need); the
split kernels cost one memory-bound pass instead (docs/ape.md gives the measured times).

Structure (as in ttile's prefill kernel): a block computes BM x BN = 128 x 128 of C with 8 warps
(2 x 4, 64 x 32 each: 4 m16 x 4 n8 tiles); a STAGES-deep cp.async ring brings BK = 32 columns
of every part of A and rows of every part of B to shared memory (rows padded by 16 bytes so
ldmatrix reads hit distinct banks); fragments come from ldmatrix (ldmatrix.trans for 16-bit B,
scalar loads for TF32 B). Tiles are visited in groups of 8 block rows so a wave of blocks
shares A and B panels in L2. Needs N % 8 == 0 and K padded to a multiple of BK (the split
kernels write zeros past K); rows past M are zero-filled. No host synchronisation: capturable.
"""
from __future__ import annotations

from .reference import MMA_K_TILE
from .types import TYPES, EmulatedType

BM, BN, BK = 128, 128, MMA_K_TILE
THREADS = 256
GROUP_M = 8

_COMMON = r"""
typedef unsigned int u32;
#define BM %(bm)d
#define BN %(bn)d
#define BK %(bk)d
#define THREADS %(threads)d
#define GROUP_M %(group_m)d
#define WARPS_N 4
#define WM 4
#define WN 4
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned s;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %%1; cvt.u32.u64 %%0, t; }" : "=r"(s) : "l"(p));
    return s;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
    // bytes == 0 zero-fills the 16 bytes (rows past M, columns past N)
    unsigned s = smem_addr(smem);
    asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16, %%2;\n" :: "r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %%0;\n" :: "n"(N)); }
__device__ __forceinline__ void ldsm_x4(u32* r, const void* smem) {
    unsigned s = smem_addr(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%%0, %%1, %%2, %%3}, [%%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* smem) {
    unsigned s = smem_addr(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%%0, %%1, %%2, %%3}, [%%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
// block tile of this block: groups of GROUP_M block rows, column-major inside a group
__device__ __forceinline__ void tile_of(long long m, long long n, int* tm, int* tn) {
    int rows = (int)((m + BM - 1) / BM), cols = (int)((n + BN - 1) / BN);
    int pid = blockIdx.x, per_group = GROUP_M * cols;
    int first = (pid / per_group) * GROUP_M;
    int size = rows - first < GROUP_M ? rows - first : GROUP_M;
    *tm = first + (pid %% per_group) %% size;
    *tn = (pid %% per_group) / size;
}
"""

# 16-bit parts (fp16 for FP32-F, bf16 for FP32-B): m16n8k16, ldmatrix for A and B
_KERNEL16 = r"""
#define %(p)s_A_PITCH (BK * 2 + 16)
#define %(p)s_B_PITCH (BN * 2 + 16)
#define %(p)s_A_PART (BM * %(p)s_A_PITCH)
#define %(p)s_B_PART (BK * %(p)s_B_PITCH)
#define %(p)s_STAGE (%(parts)d * (%(p)s_A_PART + %(p)s_B_PART))
__device__ __forceinline__ void %(p)s_mma(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.%(ptx)s.%(ptx)s.f32 {%%0, %%1, %%2, %%3}, "
                 "{%%4, %%5, %%6, %%7}, {%%8, %%9}, {%%0, %%1, %%2, %%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void %(p)s_mma0(float* c, const u32* a, const u32* b) {   // c = a b (from zero)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.%(ptx)s.%(ptx)s.f32 {%%0, %%1, %%2, %%3}, "
                 "{%%4, %%5, %%6, %%7}, {%%8, %%9}, {%%10, %%10, %%10, %%10};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}
// k-tile kt of every part -> one stage; each thread copies 2 pieces of 16 bytes per part and operand
__device__ __forceinline__ void %(p)s_load(unsigned char* st, const unsigned short* ap, const unsigned short* bp,
        long long m, long long n, long long kp, int m0, int n0, int kt) {
    const int tid = threadIdx.x;
    #pragma unroll
    for (int p = 0; p < %(parts)d; ++p) {
        #pragma unroll
        for (int it = 0; it < BM * (BK / 8) / THREADS; ++it) {
            int row = tid / (BK / 8) + it * (THREADS / (BK / 8)), col = tid %% (BK / 8);
            bool ok = m0 + row < m;
            const unsigned short* src = ok ? ap + (m0 + row) * (long long)(%(parts)d * kp) + p * kp + kt * BK + col * 8 : ap;
            cp_async16(st + p * %(p)s_A_PART + row * %(p)s_A_PITCH + col * 16, src, ok ? 16 : 0);
        }
        #pragma unroll
        for (int it = 0; it < BK / (THREADS / (BN / 8)); ++it) {
            int row = tid / (BN / 8) + it * (THREADS / (BN / 8)), col = tid %% (BN / 8);
            bool ok = n0 + col * 8 < n;
            const unsigned short* src = ok ? bp + ((%(parts)d - 1 - p) * kp + kt * BK + row) * n + n0 + col * 8 : bp;
            cp_async16(st + %(parts)d * %(p)s_A_PART + p * %(p)s_B_PART + row * %(p)s_B_PITCH + col * 16, src, ok ? 16 : 0);
        }
    }
}
extern "C" __global__ void __launch_bounds__(THREADS, 1)
ape_mma_%(p)s(const unsigned short* __restrict__ ap, const unsigned short* __restrict__ bp, long long m, long long n,
              long long kp, float* __restrict__ c, int accumulate) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / WARPS_N, wn = warp %% WARPS_N;
    int tm, tn;
    tile_of(m, n, &tm, &tn);
    const int m0 = tm * BM, n0 = tn * BN;
    const int ktiles = (int)(kp / BK);
    float acc[WM][WN][4], lo[WM][WN][4];
    #pragma unroll
    for (int i = 0; i < WM; ++i)
        #pragma unroll
        for (int j = 0; j < WN; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) { acc[i][j][r] = 0.f; lo[i][j][r] = 0.f; }
    #pragma unroll
    for (int s = 0; s < %(stages)d - 1; ++s) {
        if (s < ktiles) %(p)s_load(smem + s * %(p)s_STAGE, ap, bp, m, n, kp, m0, n0, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<%(stages)d - 2>();
        __syncthreads();   // stage kt is in; every warp is done with the stage the next load overwrites
        if (kt + %(stages)d - 1 < ktiles)
            %(p)s_load(smem + ((kt + %(stages)d - 1) %% %(stages)d) * %(p)s_STAGE, ap, bp, m, n, kp, m0, n0, kt + %(stages)d - 1);
        cp_async_commit();
        const unsigned char* st = smem + (kt %% %(stages)d) * %(p)s_STAGE;
        #pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            u32 bf[%(parts)d][WN][2];
            #pragma unroll
            for (int p = 0; p < %(parts)d; ++p)
                #pragma unroll
                for (int jj = 0; jj < WN / 2; ++jj) {
                    u32 r[4];
                    ldsm_x4_t(r, st + %(parts)d * %(p)s_A_PART + p * %(p)s_B_PART + (ks * 16 + (lane & 15)) * %(p)s_B_PITCH
                                 + (wn * (WN * 8) + jj * 16 + (lane >> 4) * 8) * 2);
                    bf[p][2 * jj][0] = r[0]; bf[p][2 * jj][1] = r[1];
                    bf[p][2 * jj + 1][0] = r[2]; bf[p][2 * jj + 1][1] = r[3];
                }
            #pragma unroll
            for (int i = 0; i < WM; ++i) {
                u32 af[%(parts)d][4];
                #pragma unroll
                for (int p = 0; p < %(parts)d; ++p)
                    ldsm_x4(af[p], st + p * %(p)s_A_PART + (wm * (WM * 16) + i * 16 + (lane & 15)) * %(p)s_A_PITCH
                                   + (ks * 16 + (lane >> 4) * 8) * 2);
                #pragma unroll
                for (int j = 0; j < WN; ++j) {
                    float t[4];
                    %(p)s_mma0(t, af[0], bf[0][j]);   // the top level from zero, added in round-to-nearest
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) acc[i][j][r] += t[r];
%(lower)s
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < WM; ++i)
            #pragma unroll
            for (int j = 0; j < WN; ++j)
                #pragma unroll
                for (int r = 0; r < 4; ++r) { acc[i][j][r] = fmaf(lo[i][j][r], %(scale)s, acc[i][j][r]); lo[i][j][r] = 0.f; }
    }
    cp_async_wait<0>();
%(epilogue)s
}
"""

# TF32 parts (FP32-T, fp32 storage): m16n8k8, ldmatrix for A (8 x 4 fp32 = 8 x 8 b16), scalar B loads
_KERNEL_TF32 = r"""
#define %(p)s_A_PITCH ((BK + 4) * 4)
#define %(p)s_B_PITCH ((BN + 8) * 4)
#define %(p)s_A_PART (BM * %(p)s_A_PITCH)
#define %(p)s_B_PART (BK * %(p)s_B_PITCH)
#define %(p)s_STAGE (%(parts)d * (%(p)s_A_PART + %(p)s_B_PART))
__device__ __forceinline__ void %(p)s_mma(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%%0, %%1, %%2, %%3}, "
                 "{%%4, %%5, %%6, %%7}, {%%8, %%9}, {%%0, %%1, %%2, %%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void %(p)s_mma0(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%%0, %%1, %%2, %%3}, "
                 "{%%4, %%5, %%6, %%7}, {%%8, %%9}, {%%10, %%10, %%10, %%10};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}
__device__ __forceinline__ void %(p)s_load(unsigned char* st, const float* ap, const float* bp,
        long long m, long long n, long long kp, int m0, int n0, int kt) {
    const int tid = threadIdx.x;
    #pragma unroll
    for (int p = 0; p < %(parts)d; ++p) {
        #pragma unroll
        for (int it = 0; it < BM * (BK / 4) / THREADS; ++it) {
            int row = tid / (BK / 4) + it * (THREADS / (BK / 4)), col = tid %% (BK / 4);
            bool ok = m0 + row < m;
            const float* src = ok ? ap + (m0 + row) * (long long)(%(parts)d * kp) + p * kp + kt * BK + col * 4 : ap;
            cp_async16(st + p * %(p)s_A_PART + row * %(p)s_A_PITCH + col * 16, src, ok ? 16 : 0);
        }
        #pragma unroll
        for (int it = 0; it < BK / (THREADS / (BN / 4)); ++it) {
            int row = tid / (BN / 4) + it * (THREADS / (BN / 4)), col = tid %% (BN / 4);
            bool ok = n0 + col * 4 < n;
            const float* src = ok ? bp + ((%(parts)d - 1 - p) * kp + kt * BK + row) * n + n0 + col * 4 : bp;
            cp_async16(st + %(parts)d * %(p)s_A_PART + p * %(p)s_B_PART + row * %(p)s_B_PITCH + col * 16, src, ok ? 16 : 0);
        }
    }
}
extern "C" __global__ void __launch_bounds__(THREADS, 1)
ape_mma_%(p)s(const float* __restrict__ ap, const float* __restrict__ bp, long long m, long long n,
              long long kp, float* __restrict__ c, int accumulate) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / WARPS_N, wn = warp %% WARPS_N;
    const int g = lane >> 2, t4 = lane & 3;
    int tm, tn;
    tile_of(m, n, &tm, &tn);
    const int m0 = tm * BM, n0 = tn * BN;
    const int ktiles = (int)(kp / BK);
    float acc[WM][WN][4], lo[WM][WN][4];
    #pragma unroll
    for (int i = 0; i < WM; ++i)
        #pragma unroll
        for (int j = 0; j < WN; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) { acc[i][j][r] = 0.f; lo[i][j][r] = 0.f; }
    #pragma unroll
    for (int s = 0; s < %(stages)d - 1; ++s) {
        if (s < ktiles) %(p)s_load(smem + s * %(p)s_STAGE, ap, bp, m, n, kp, m0, n0, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<%(stages)d - 2>();
        __syncthreads();
        if (kt + %(stages)d - 1 < ktiles)
            %(p)s_load(smem + ((kt + %(stages)d - 1) %% %(stages)d) * %(p)s_STAGE, ap, bp, m, n, kp, m0, n0, kt + %(stages)d - 1);
        cp_async_commit();
        const unsigned char* st = smem + (kt %% %(stages)d) * %(p)s_STAGE;
        #pragma unroll
        for (int ks = 0; ks < BK / 8; ++ks) {
            u32 bf[%(parts)d][WN][2];
            #pragma unroll
            for (int p = 0; p < %(parts)d; ++p)
                #pragma unroll
                for (int j = 0; j < WN; ++j) {
                    const u32* bs = (const u32*)(st + %(parts)d * %(p)s_A_PART + p * %(p)s_B_PART)
                                    + (ks * 8 + t4) * (%(p)s_B_PITCH / 4) + wn * (WN * 8) + j * 8 + g;
                    bf[p][j][0] = bs[0];
                    bf[p][j][1] = bs[4 * (%(p)s_B_PITCH / 4)];
                }
            #pragma unroll
            for (int i = 0; i < WM; ++i) {
                u32 af[%(parts)d][4];
                #pragma unroll
                for (int p = 0; p < %(parts)d; ++p)
                    ldsm_x4(af[p], st + p * %(p)s_A_PART + (wm * (WM * 16) + i * 16 + (lane & 15)) * %(p)s_A_PITCH
                                   + (ks * 8 + (lane >> 4) * 4) * 4);
                #pragma unroll
                for (int j = 0; j < WN; ++j) {
                    float t[4];
                    %(p)s_mma0(t, af[0], bf[0][j]);
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) acc[i][j][r] += t[r];
%(lower)s
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < WM; ++i)
            #pragma unroll
            for (int j = 0; j < WN; ++j)
                #pragma unroll
                for (int r = 0; r < 4; ++r) { acc[i][j][r] = fmaf(lo[i][j][r], %(scale)s, acc[i][j][r]); lo[i][j][r] = 0.f; }
    }
    cp_async_wait<0>();
%(epilogue)s
}
"""

# C fragment of an m16n8 tile: (row g, cols 2t, 2t+1) and (row g + 8, same cols); N % 8 == 0
_EPILOGUE = r"""
    const int eg = lane >> 2, et = lane & 3;
    #pragma unroll
    for (int i = 0; i < WM; ++i)
        #pragma unroll
        for (int j = 0; j < WN; ++j) {
            const long long col = n0 + wn * (WN * 8) + j * 8 + 2 * et;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long row = m0 + wm * (WM * 16) + i * 16 + eg + 8 * h;
                if (row < m && col < n) {
                    float2* dst = (float2*)(c + row * n + col);
                    float2 v = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                    if (accumulate) { float2 o = *dst; v.x += o.x; v.y += o.y; }
                    *dst = v;
                }
            }
        }
"""

_PTX = {"float16": "f16", "bfloat16": "bf16"}
STAGES = {"fp32-f": 4, "fp32-b": 3, "fp32-t": 3}


def lower_products(t: EmulatedType) -> tuple[tuple[int, int], ...]:
    """The part products below the top level, in the order the kernel issues them."""
    return tuple(pair for level in t.levels[1:] for pair in level)


def lower_scale(t: EmulatedType) -> float:
    """The one scale of every level below the top (the kernel folds them with one FFMA)."""
    scales = set(t.level_scale[1:])
    if len(scales) != 1:
        raise ValueError(f"{t.name}: levels below the top have different scales {sorted(scales)}")
    return scales.pop()


def smem_bytes(mode: str, stages: int | None = None, bk: int = BK) -> int:
    t = TYPES[mode]
    item = 4 if t.part_dtype == "tf32" else 2
    a_pitch = (bk + 4) * 4 if item == 4 else bk * 2 + 16
    b_pitch = (BN + 8) * 4 if item == 4 else BN * 2 + 16
    return (stages or STAGES[mode]) * t.parts * (BM * a_pitch + bk * b_pitch)


def _lower_code(p: str, t: EmulatedType) -> str:
    return "\n".join(f"                    {p}_mma(lo[i][j], af[{pa}], bf[{pb}][j]);" for pa, pb in lower_products(t))


def kernel_source(mode: str, stages: int | None = None) -> str:
    t = TYPES[mode]
    p = mode[-1]
    body = _KERNEL_TF32 if t.part_dtype == "tf32" else _KERNEL16
    return body % {"p": p, "parts": t.parts, "ptx": _PTX.get(t.part_dtype, ""), "stages": stages or STAGES[mode],
                   "lower": _lower_code(p, t), "scale": f"{lower_scale(t):.9e}f", "epilogue": _EPILOGUE}


def source(stages: dict[str, int] | None = None, group_m: int = GROUP_M, bk: int = BK) -> str:
    """The translation unit of the three kernels (no headers: NVRTC takes it as it is);
    `stages` / `group_m` / `bk` override the ring depth per mode, the tile grouping and the
    k-tile (for tuning; the numpy model follows BK only)."""
    head = _COMMON % {"bm": BM, "bn": BN, "bk": bk, "threads": THREADS, "group_m": group_m}
    stages = stages or {}
    return "\n".join([head] + [kernel_source(mode, stages.get(mode)) for mode in ("fp32-f", "fp32-t", "fp32-b")])


KERNEL_NAMES = ("ape_mma_f", "ape_mma_t", "ape_mma_b")


def grid(m: int, n: int) -> int:
    return -(-m // BM) * -(-n // BN)
