"""CUDA source of Ape's own tensor-core GEMMs (`ape_mma_f`, `ape_mma_t`, `ape_mma_b`): C (+)=
the emulated product of the split parts, with round-to-nearest fp32 accumulation.

Why our own kernel: cuBLAS sums each GEMM's K in one tensor-core accumulator, which truncates
every partial sum, and that error grows with K (docs/ape.md; the cuBLAS engine bounds it with
K chunks of the top level, at some cost in speed). Here, per k-tile of BK = 32, each
output tile's part products are summed from zero on the tensor cores (mma.sync: m16n8k16 fp16 /
bf16, m16n8k8 TF32; FP32-F's 2^-12-scaled cross terms in a second sum, folded in with one FFMA)
and the tile's sum is added to fp32 registers with an ordinary round-to-nearest FADD. No
truncating sum runs over more than one k-tile. `reference.mma_matmul` models this order.

The kernel reads the parts written by the split kernels (`kernels.py`, the layouts of the
cuBLAS path: A's parts side by side along K, B's parts stacked in reverse), not fp32: a split
inside the loop costs per element two converts, a subtract and a multiply, either in every warp
that reads the element (issue slots the mma loop needs) or once per block through a second
shared-memory buffer (bandwidth the fragment loads need); the split kernels cost one
memory-bound pass instead (docs/ape.md gives the measured times).

Structure (as in ttile's prefill kernel): 8 warps (2 x 4) per block, each 64 x 8 WN of C
(`TILINGS`: 64 x 64 for FP32-F, 64 x 32 for the others); a `stages`-deep cp.async ring brings
every part's k-tile of A and B to shared memory (rows padded by 16 bytes so ldmatrix reads hit
distinct banks); fragments come from ldmatrix (ldmatrix.trans for 16-bit B, scalar loads for
TF32 B); per k-tile a warp loads its B fragments once and its A fragments per m16 row of tiles,
so only the fp32 accumulators persist across k-tiles. Tiles are visited in groups of GROUP_M
block rows so a wave of blocks shares A and B panels in L2. Needs N % 8 == 0 and K padded to a
multiple of BK (the split kernels write zeros past K); rows past M are zero-filled. No host
synchronisation: capturable. Measured speed and its limits: docs/ape.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from .reference import MMA_K_STEP, MMA_K_TILE
from .types import TYPES, EmulatedType

BM, BK = 128, MMA_K_TILE
THREADS = 256
GROUP_M = 8


@dataclass(frozen=True)
class Tiling:
    """Per mode: n8 tiles per warp (the block is 2 x 4 warps of 64 x 8 WN), the ring depth and
    the blocks per SM the registers are budgeted for (launch bounds)."""
    wn: int
    stages: int
    blocks_per_sm: int = 1

    @property
    def bn(self) -> int:
        return 4 * self.wn * 8


# FP32-F: 64 x 64 warp tiles (its fragments are the smallest: 2 parts of 16 bits); FP32-T and
# FP32-B: 64 x 32 (3 parts, or fp32-sized TF32 parts, leave no registers for more)
TILINGS = {"fp32-f": Tiling(8, 3), "fp32-t": Tiling(4, 3), "fp32-b": Tiling(4, 3)}

_COMMON = r"""
typedef unsigned int u32;
#define BM %(bm)d
#define BK %(bk)d
#define THREADS %(threads)d
#define GROUP_M %(group_m)d
#define WARPS_N 4
#define WM 4
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
__device__ __forceinline__ void tile_of(long long m, long long n, int bn, int* tm, int* tn) {
    int rows = (int)((m + BM - 1) / BM), cols = (int)((n + bn - 1) / bn);
    int pid = blockIdx.x, per_group = GROUP_M * cols;
    int first = (pid / per_group) * GROUP_M;
    int size = rows - first < GROUP_M ? rows - first : GROUP_M;
    *tm = first + (pid %% per_group) %% size;
    *tn = (pid %% per_group) / size;
}
"""

# One kernel per mode; %(p)s prefixes its names. 16-bit parts (fp16 FP32-F, bf16 FP32-B):
# m16n8k16, ldmatrix for A and ldmatrix.trans for B. TF32 parts (fp32 storage): m16n8k8,
# ldmatrix for A (an 8 x 4 block of fp32 is an 8 x 8 block of b16) and scalar loads for B.
_KERNEL = r"""
#define %(p)s_WN %(wn)d
#define %(p)s_BN (WARPS_N * %(p)s_WN * 8)
#define %(p)s_KS (BK / %(kstep)d)
#define %(p)s_A_PITCH (%(a_pitch)d)
#define %(p)s_B_PITCH (%(b_pitch)d)
#define %(p)s_A_PART (BM * %(p)s_A_PITCH)
#define %(p)s_B_PART (BK * %(p)s_B_PITCH)
#define %(p)s_STAGE (%(parts)d * (%(p)s_A_PART + %(p)s_B_PART))
#define %(p)s_EPR (16 / %(item)d)   // elements per 16-byte piece
__device__ __forceinline__ void %(p)s_mma(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.%(shape)s.row.col.f32.%(ptx)s.%(ptx)s.f32 {%%0, %%1, %%2, %%3}, "
                 "{%%4, %%5, %%6, %%7}, {%%8, %%9}, {%%0, %%1, %%2, %%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void %(p)s_mma0(float* c, const u32* a, const u32* b) {   // c = a b (from zero)
    asm volatile("mma.sync.aligned.%(shape)s.row.col.f32.%(ptx)s.%(ptx)s.f32 {%%0, %%1, %%2, %%3}, "
                 "{%%4, %%5, %%6, %%7}, {%%8, %%9}, {%%10, %%10, %%10, %%10};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}
// k-tile kt of every part -> one stage, in 16-byte pieces spread over the threads
__device__ __forceinline__ void %(p)s_load(unsigned char* st, const %(ctype)s* ap, const %(ctype)s* bp,
        long long m, long long n, long long kp, int m0, int n0, int kt) {
    const int tid = threadIdx.x;
    constexpr int A_PR = BK / %(p)s_EPR, B_PR = %(p)s_BN / %(p)s_EPR;   // pieces per row
    #pragma unroll
    for (int p = 0; p < %(parts)d; ++p) {
        #pragma unroll
        for (int it = 0; it < BM * A_PR / THREADS; ++it) {
            int row = tid / A_PR + it * (THREADS / A_PR), col = tid %% A_PR;
            bool ok = m0 + row < m;
            const %(ctype)s* src = ok ? ap + (m0 + row) * (long long)(%(parts)d * kp) + p * kp + kt * BK + col * %(p)s_EPR : ap;
            cp_async16(st + p * %(p)s_A_PART + row * %(p)s_A_PITCH + col * 16, src, ok ? 16 : 0);
        }
        #pragma unroll
        for (int it = 0; it < BK * B_PR / THREADS; ++it) {
            int row = tid / B_PR + it * (THREADS / B_PR), col = tid %% B_PR;
            bool ok = n0 + col * %(p)s_EPR < n;
            const %(ctype)s* src = ok ? bp + ((%(parts)d - 1 - p) * kp + kt * BK + row) * n + n0 + col * %(p)s_EPR : bp;
            cp_async16(st + %(parts)d * %(p)s_A_PART + p * %(p)s_B_PART + row * %(p)s_B_PITCH + col * 16, src, ok ? 16 : 0);
        }
    }
}
// B fragments of k-step ks, all n8 tiles of the warp, part p
__device__ __forceinline__ void %(p)s_load_b(u32 (*bf)[2], const unsigned char* bs, int ks, int wn, int lane) {
%(load_b)s
}
extern "C" __global__ void __launch_bounds__(THREADS, %(minb)d)
ape_mma_%(p)s(const %(ctype)s* __restrict__ ap, const %(ctype)s* __restrict__ bp, long long m, long long n,
              long long kp, float* __restrict__ c, int accumulate) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / WARPS_N, wn = warp %% WARPS_N;
    int tm, tn;
    tile_of(m, n, %(p)s_BN, &tm, &tn);
    const int m0 = tm * BM, n0 = tn * %(p)s_BN;
    const int ktiles = (int)(kp / BK);
    float acc[WM][%(p)s_WN][4];
    #pragma unroll
    for (int i = 0; i < WM; ++i)
        #pragma unroll
        for (int j = 0; j < %(p)s_WN; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
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
        u32 bf[%(parts)d][%(p)s_KS][%(p)s_WN][2];
        #pragma unroll
        for (int p = 0; p < %(parts)d; ++p)
            #pragma unroll
            for (int ks = 0; ks < %(p)s_KS; ++ks)
                %(p)s_load_b(bf[p][ks], st + %(parts)d * %(p)s_A_PART + p * %(p)s_B_PART, ks, wn, lane);
        #pragma unroll
        for (int i = 0; i < WM; ++i) {
            u32 af[%(parts)d][%(p)s_KS][4];
            #pragma unroll
            for (int p = 0; p < %(parts)d; ++p)
                #pragma unroll
                for (int ks = 0; ks < %(p)s_KS; ++ks)
                    ldsm_x4(af[p][ks], st + p * %(p)s_A_PART + (wm * (WM * 16) + i * 16 + (lane & 15)) * %(p)s_A_PITCH
                                       + (ks * %(kstep)d + (lane >> 4) * (%(kstep)d / 2)) * %(item)d);
            #pragma unroll
            for (int j = 0; j < %(p)s_WN; ++j) {
                // this k-tile's products from zero (a short truncating sum), added in round-to-nearest
                float t[4];
                %(p)s_mma0(t, af[0][0], bf[0][0][j]);
                #pragma unroll
                for (int ks = 1; ks < %(p)s_KS; ++ks) %(p)s_mma(t, af[0][ks], bf[0][ks][j]);
%(lower)s
            }
        }
    }
    cp_async_wait<0>();
%(epilogue)s
}
"""

_LOAD_B16 = r"""    #pragma unroll
    for (int jj = 0; jj < %(p)s_WN / 2; ++jj) {
        u32 r[4];
        ldsm_x4_t(r, bs + (ks * 16 + (lane & 15)) * %(p)s_B_PITCH + (wn * (%(p)s_WN * 8) + jj * 16 + (lane >> 4) * 8) * 2);
        bf[2 * jj][0] = r[0]; bf[2 * jj][1] = r[1];
        bf[2 * jj + 1][0] = r[2]; bf[2 * jj + 1][1] = r[3];
    }"""

_LOAD_BTF32 = r"""    const int g = lane >> 2, t4 = lane & 3;
    #pragma unroll
    for (int j = 0; j < %(p)s_WN; ++j) {
        const u32* b = (const u32*)bs + (ks * 8 + t4) * (%(p)s_B_PITCH / 4) + wn * (%(p)s_WN * 8) + j * 8 + g;
        bf[j][0] = b[0];
        bf[j][1] = b[4 * (%(p)s_B_PITCH / 4)];
    }"""

# C fragment of an m16n8 tile: (row g, cols 2t, 2t+1) and (row g + 8, same cols); N % 8 == 0
_EPILOGUE = r"""
    const int eg = lane >> 2, et = lane & 3;
    #pragma unroll
    for (int i = 0; i < WM; ++i)
        #pragma unroll
        for (int j = 0; j < %(p)s_WN; ++j) {
            const long long col = n0 + wn * (%(p)s_WN * 8) + j * 8 + 2 * et;
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

_PTX = {"float16": "f16", "bfloat16": "bf16", "tf32": "tf32"}


def lower_products(t: EmulatedType) -> tuple[tuple[int, int], ...]:
    """The part products below the top level, in the order the kernel issues them."""
    return tuple(pair for level in t.levels[1:] for pair in level)


def lower_scale(t: EmulatedType) -> float:
    """The one scale of every level below the top."""
    scales = set(t.level_scale[1:])
    if len(scales) != 1:
        raise ValueError(f"{t.name}: levels below the top have different scales {sorted(scales)}")
    return scales.pop()


def _pitches(mode: str, bk: int = BK, tiling: Tiling | None = None) -> tuple[int, int, int]:
    """(bytes per part element, A row pitch, B row pitch): rows padded by 16 bytes so the 8 rows
    of one ldmatrix (or TF32 B's 4 x 8 scalar loads) fall in distinct banks."""
    t, bn = TYPES[mode], (tiling or TILINGS[mode]).bn
    item = 4 if t.part_dtype == "tf32" else 2
    return item, bk * item + 16, bn * item + (32 if item == 4 else 16)


def smem_bytes(mode: str, tiling: Tiling | None = None, bk: int = BK) -> int:
    tiling = tiling or TILINGS[mode]
    _, a_pitch, b_pitch = _pitches(mode, bk, tiling)
    return tiling.stages * TYPES[mode].parts * (BM * a_pitch + bk * b_pitch)


def _lower_code(p: str, t: EmulatedType) -> str:
    """The lower levels' mmas of one (i, j) tile and the add into acc. Scale 1 (FP32-T / B):
    into the same truncating k-tile sum; FP32-F's 2^-12: a sum of their own, folded in by FFMA."""
    ind = " " * 16
    pairs = lower_products(t)
    if lower_scale(t) == 1.0:
        lines = [f"{ind}#pragma unroll", f"{ind}for (int ks = 0; ks < {p}_KS; ++ks) {{"]
        lines += [f"{ind}    {p}_mma(t, af[{pa}][ks], bf[{pb}][ks][j]);" for pa, pb in pairs]
        lines += [f"{ind}}}", f"{ind}#pragma unroll",
                  f"{ind}for (int r = 0; r < 4; ++r) acc[i][j][r] += t[r];"]
        return "\n".join(lines)
    (pa0, pb0), rest = pairs[0], pairs[1:]
    lines = [f"{ind}float l[4];", f"{ind}{p}_mma0(l, af[{pa0}][0], bf[{pb0}][0][j]);"]
    lines += [f"{ind}{p}_mma(l, af[{pa}][0], bf[{pb}][0][j]);" for pa, pb in rest]
    lines += [f"{ind}#pragma unroll", f"{ind}for (int ks = 1; ks < {p}_KS; ++ks) {{"]
    lines += [f"{ind}    {p}_mma(l, af[{pa}][ks], bf[{pb}][ks][j]);" for pa, pb in pairs]
    lines += [f"{ind}}}", f"{ind}#pragma unroll",
              f"{ind}for (int r = 0; r < 4; ++r) acc[i][j][r] += fmaf(l[r], {lower_scale(t):.9e}f, t[r]);"]
    return "\n".join(lines)


def kernel_source(mode: str, tiling: Tiling | None = None, bk: int = BK) -> str:
    t, tiling = TYPES[mode], tiling or TILINGS[mode]
    p = mode[-1]
    item, a_pitch, b_pitch = _pitches(mode, bk, tiling)
    tf32 = t.part_dtype == "tf32"
    fill = {"p": p}
    return _KERNEL % {
        "p": p, "parts": t.parts, "ptx": _PTX[t.part_dtype], "stages": tiling.stages, "wn": tiling.wn, "minb": tiling.blocks_per_sm,
        "kstep": MMA_K_STEP[mode], "item": item, "a_pitch": a_pitch, "b_pitch": b_pitch,
        "shape": "m16n8k8" if tf32 else "m16n8k16", "ctype": "float" if tf32 else "unsigned short",
        "load_b": (_LOAD_BTF32 if tf32 else _LOAD_B16) % fill, "lower": _lower_code(p, t),
        "epilogue": _EPILOGUE % fill}


def source(tilings: dict[str, Tiling] | None = None, group_m: int = GROUP_M, bk: int = BK,
           modes: tuple[str, ...] = ("fp32-f", "fp32-t", "fp32-b")) -> str:
    """The translation unit of the kernels of `modes` (no headers: NVRTC takes it as it is);
    `tilings` / `group_m` / `bk` override the tiling per mode, the tile grouping and the
    k-tile (for tuning; the numpy model follows BK)."""
    head = _COMMON % {"bm": BM, "bk": bk, "threads": THREADS, "group_m": group_m}
    tilings = tilings or {}
    return "\n".join([head] + [kernel_source(mode, tilings.get(mode), bk) for mode in modes])


KERNEL_NAMES = ("ape_mma_f", "ape_mma_t", "ape_mma_b")


def grid(m: int, n: int, mode: str, tiling: Tiling | None = None) -> int:
    return -(-m // BM) * -(-n // (tiling or TILINGS[mode]).bn)
