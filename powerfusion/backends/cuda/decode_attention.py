"""Decode attention (basic.Attention with a few query rows) as split-KV flash-decoding: one
kernel of ours, its chunks combined by the last block to finish.

Why our own kernel: a decode step (one query token against a KV cache of 1K-32K) reads K and V
once and does almost no arithmetic, so it is bound by DRAM bandwidth. The decomposed graph
took four kernels (scores, softmax, P.V partials, their sum) and cuDNN's fused attention
wants fp16 / bf16 and parallelises over query rows, of which a decode step has one. What
this does (Dao et al., "Flash-Decoding for long-context inference", 2023):

  - the grid is (KV chunk, batch x KV head); a block reads its chunk of K once, keeps the
    chunk's scores in shared memory, takes their max m_c and l_c = sum exp(s - m_c), then
    reads its chunk of V once: acc_c = sum exp(s - m_c) v;
  - grouped-query attention is the same kernel with G > 1 query rows per KV head (Q stored
    [B, Hkv, G, D]): the G rows share every load of K and V;
  - each block writes (m_c, l_c, acc_c) in float32 and counts itself in on its head's arrival
    counter; the last block of a head combines the chunks (M = max m_c,
    y = sum acc_c 2^(m_c - M) / sum l_c 2^(m_c - M)), writes y and re-arms the counter. So one
    launch does both steps: a second kernel for the combine would add a launch to a step whose
    copy-bandwidth floor is 6 us at KV 1K (GPT-2, batch 4, fp32);
  - the chunk length sizes the grid to one wave of the blocks that are resident together.

Scores are kept in the log2 domain (the scale times log2(e) folded into q) and every sum is in
float32; the probabilities are not rounded to the operands' type before the second product
(basic.Attention's decomposed form rounds them), which is at least as accurate.
`split_kv_reference` is the same algorithm in numpy, for tests without a GPU.

Measured on the H200 at 816dcfe (benchmarks/results/gir-decode.md; docs/cuda-attention.md): 0.90-1.03 of
the copy-bandwidth floor at KV 16K-32K in fp32, 0.40-0.82 at 1K-4K, where latency dominates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from powerfusion.basic import plain_view

_ELEM = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
THREADS = 256
MAX_GROUP = 8                  # query rows per KV head (LLaMA-style GQA groups are 4 or 8)
SHARED_FLOATS = 12288          # 48 KiB of static shared memory: scores, per-warp sums, stats
MIN_CHUNK = 64
CHUNK_ALIGN = 16               # chunk lengths in whole 16-row steps (a tile's rows per pass)


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """Q [heads, G, D] (heads = batch x KV heads), K and V [heads, T, D], row-major; the output
    [heads, G, D] in Q's memory order. tail > 0: K and V are [heads, T - tail, D] (the cache) and
    K_tail, V_tail [heads, tail, D] the rows after it (basic.Attention.kv_tail), read in place."""
    heads: int
    group: int
    kv_len: int
    head_size: int
    dtype: str
    scale: float
    tail: int = 0


def decode_shape(graph, node) -> tuple[DecodeShape | None, str]:
    """(the shape, "") where the split-KV kernel runs this Attention node, else (None, why)."""
    op, t = node.op, graph.tensors
    tail = int(getattr(op, "kv_tail", 0))
    if len(node.inputs) > (5 if tail else 3):
        return None, "a bias (the decode kernel takes none)"
    if op.nan_to_zero or any(op.in_perms) or not all(plain_view(v, t[n].shape) for v, n in zip(op.in_views, node.inputs)):
        return None, "a NaN guard or operands read through a transpose or strided view"
    views = op.in_views or ((),) * 3   # plain views (checked above): the same bytes in this shape
    q, k, v = (tuple(int(d) for d in (views[i][1] if views[i] else t[n].shape)) for i, n in enumerate(node.inputs[:3]))
    dtype = np.dtype(t[node.inputs[0]].dtype).name
    if dtype not in _ELEM or len(q) < 3 or k != v or q[:-2] != k[:-2] or q[-1] != k[-1]:
        return None, f"operands {q}, {k}, {v} of {dtype}"
    if tail:
        kt, vt = (tuple(int(d) for d in t[n].shape) for n in node.inputs[3:5])
        if kt != vt or kt[:-2] != k[:-2] or kt[-1] != k[-1] or kt[-2] != tail:
            return None, f"appended rows {kt}, {vt} that do not continue the cache {k}"
    group, d, kv_len = q[-2], q[-1], k[-2] + tail
    if group > MAX_GROUP or d not in (8, 16, 32, 64, 128) or kv_len < 1:
        return None, f"{group} query rows of head size {d} over {kv_len} keys"
    if op.out_perm and not _moves_ones_only((*q[:-1], d), op.out_perm):
        return None, f"an output transpose {op.out_perm} that moves data"
    heads = int(np.prod(q[:-2], dtype=np.int64))
    return DecodeShape(heads, group, kv_len, d, dtype, float(op.scale), tail), ""


def _moves_ones_only(shape, perm) -> bool:
    """A transpose that keeps the memory order (only extent-1 axes move)."""
    return [a for a in perm if shape[a] != 1] == sorted(a for a in perm if shape[a] != 1)


def resident_blocks(shape: DecodeShape) -> int:
    """Blocks of THREADS per SM the kernel is compiled for (__launch_bounds__): 4 (at most 64
    registers a thread) where a thread's q, sums and one tile of packs take at most 56 of them,
    else 2 (at most 128). Checked with ptxas -v for sm_90: no spills at fp32 / fp16 / bf16, head
    sizes 8-128, G = 1, 2, 4, 8."""
    lanes = lanes_per_row(shape)
    packs = max(1, shape.head_size * _ITEMSIZE[shape.dtype] // 16) // lanes
    floats = 2 * shape.group * packs * (16 // _ITEMSIZE[shape.dtype]) + 4 * _unroll(packs) * packs
    return 4 if floats <= 56 else 2


def _unroll(packs_per_thread: int) -> int:
    """Row steps per tile: 8 packs (128 bytes) in flight per thread."""
    return max(1, 8 // packs_per_thread)


def chunk_rows(shape: DecodeShape, sm_count: int) -> int:
    """KV rows per block: the KV length split evenly over as many chunks per head as one wave of
    resident blocks holds (rounded up to CHUNK_ALIGN rows, at least MIN_CHUNK), so that no partial
    second wave runs on part of the SMs and each block streams as long a chunk as the parallelism
    allows (fewer partials to combine). Not a power of two: 1025 rows (a 1K cache and the step's
    token) over 32 fp16 heads of 128 (2 resident blocks an SM) take 8 chunks of 144 rows (256
    blocks) where powers of two gave 5 of 256 (160 blocks, the last with one row). The kernel masks
    the rows past a chunk's end."""
    wave = resident_blocks(shape) * sm_count
    per_head = max(1, wave // max(shape.heads, 1))
    rows = max(MIN_CHUNK, -(-shape.kv_len // per_head))
    rows = -(-rows // CHUNK_ALIGN) * CHUNK_ALIGN
    return min(rows, _max_chunk(shape))


def _max_chunk(shape: DecodeShape) -> int:
    """The largest power-of-two chunk whose scores fit beside the per-warp sums in shared memory."""
    free = SHARED_FLOATS - (THREADS // 32) * shape.group * shape.head_size - 2 * shape.group - 8
    rows = MIN_CHUNK
    while 2 * rows * shape.group <= free:
        rows *= 2
    return rows


def lanes_per_row(shape: DecodeShape) -> int:
    """Threads that share one K / V row (each loads 16-byte packs of it): 8, so a row's dot
    product takes 3 shuffle steps, or more where a thread would otherwise hold over 32 floats of
    q (and as many of its sums) for the G query rows."""
    packs = max(1, shape.head_size * _ITEMSIZE[shape.dtype] // 16)
    return min(packs, max(8, shape.group * shape.head_size // 32))


def decode_source(shape: DecodeShape, chunk: int) -> str:
    """The kernel's CUDA source for one shape (constants baked in; disk-cached by content)."""
    packs = max(1, shape.head_size * _ITEMSIZE[shape.dtype] // 16)
    lanes = lanes_per_row(shape)
    if shape.head_size * _ITEMSIZE[shape.dtype] < 16:
        raise ValueError(f"head size {shape.head_size} of {shape.dtype} is less than one 16-byte pack")
    consts = {"ELEM": _ELEM[shape.dtype], "HEAD": shape.head_size, "GROUP": shape.group, "CHUNK": chunk,
              "THREADS": THREADS, "RESIDENT": resident_blocks(shape), "LPR": lanes, "PPT": packs // lanes, "UNROLL": _unroll(packs // lanes), "TAIL": shape.tail}
    head = "".join(f"#define {k} {v}\n" for k, v in consts.items())
    return _PRELUDE + head + _KERNEL


_PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
"""

_KERNEL = r"""
#define VEC (16 / (int)sizeof(ELEM))           // elements per 16-byte pack
#define STEP (THREADS / LPR)                    // rows a block covers per step
#define WARPS (THREADS / 32)
#define NEG_INF __int_as_float(0xff800000u)   // NVRTC has no <math.h> INFINITY
#define OUTS (GROUP * HEAD)                     // outputs per KV head
#define SPLIT (OUTS >= THREADS ? 1 : (THREADS / OUTS < WARPS ? THREADS / OUTS : WARPS))

union Pack { uint4 raw; ELEM e[VEC]; };
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float x, float* y) { *y = x; }
__device__ __forceinline__ void from_f(float x, __half* y) { *y = __float2half_rn(x); }
__device__ __forceinline__ void from_f(float x, __nv_bfloat16* y) { *y = __float2bfloat16_rn(x); }

// (m, l) <- the pair for the union of two sets: max, and sum of 2^(x - max)
__device__ __forceinline__ void merge_ml(float& m, float& l, float m2, float l2) {
    const float big = fmaxf(m, m2);
    if (big == NEG_INF) return;   // both empty
    l = l * exp2f(m - big) + l2 * exp2f(m2 - big);
    m = big;
}

// row `row` of a head's keys or values: of its `cache` (`cached` rows), past them of `tail`
__device__ __forceinline__ const ELEM* kv_row(const ELEM* __restrict__ cache, const ELEM* __restrict__ tail,
                                              int cached, int row) {
#if TAIL
    return row < cached ? cache + (size_t)row * HEAD : tail + (size_t)(row - cached) * HEAD;
#else
    return cache + (size_t)row * HEAD;
#endif
}

// one tile (UNROLL steps of STEP rows) of a chunk's K or V rows (the chunk starts at row0);
// rows past the chunk read as 0
__device__ __forceinline__ void load_tile(Pack (&t)[UNROLL][PPT], const ELEM* __restrict__ src,
                                          const ELEM* __restrict__ tail, int cached, int row0, int base,
                                          int rows, int sub, int col) {
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int r = base + u * STEP + sub;
        const ELEM* row = kv_row(src, tail, cached, row0 + r);
        #pragma unroll
        for (int j = 0; j < PPT; ++j)
            t[u][j].raw = r < rows ? __ldcs((const uint4*)(row + (col + j * LPR) * VEC)) : make_uint4(0, 0, 0, 0);
    }
}

// thread t reads packs (t % LPR) + j * LPR, j < PPT, of rows t / LPR + STEP * i
extern "C" __global__ void __launch_bounds__(THREADS, RESIDENT) pf_decode_attention(
    const ELEM* __restrict__ q, const ELEM* __restrict__ k, const ELEM* __restrict__ v,
    ELEM* __restrict__ y, float* __restrict__ part, unsigned int* __restrict__ arrivals,
    int T, float scale_log2, const ELEM* __restrict__ k_tail, const ELEM* __restrict__ v_tail)
{
    __shared__ float s_p[GROUP][CHUNK];
    __shared__ float s_acc[WARPS][GROUP][HEAD];
    __shared__ float s_m[GROUP], s_l[GROUP];
    __shared__ int s_last;
    const int chunk = blockIdx.x, head = blockIdx.y, chunks = gridDim.x;
    const int tid = threadIdx.x, col = tid % LPR, sub = tid / LPR;
    const int row0 = chunk * CHUNK, rows = min(CHUNK, T - row0);
    // T rows: the cache's T - TAIL, then TAIL rows appended (the step's new token), read in place
    const int cached = T - TAIL;
    const ELEM* __restrict__ kc = k + (size_t)head * cached * HEAD;
    const ELEM* __restrict__ vc = v + (size_t)head * cached * HEAD;
    const ELEM* __restrict__ kt = k_tail + (size_t)head * TAIL * HEAD;
    const ELEM* __restrict__ vt = v_tail + (size_t)head * TAIL * HEAD;

    Pack kp[UNROLL][PPT];
    load_tile(kp, kc, kt, cached, row0, 0, rows, sub, col);   // in flight while q is read
    float qf[GROUP][PPT][VEC];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g)
        #pragma unroll
        for (int j = 0; j < PPT; ++j) {
            Pack p; p.raw = *(const uint4*)(q + ((size_t)head * GROUP + g) * HEAD + (col + j * LPR) * VEC);
            #pragma unroll
            for (int i = 0; i < VEC; ++i) qf[g][j][i] = to_f(p.e[i]) * scale_log2;
        }

    // pass 1: scores of the chunk (log2 domain) into shared memory; K read once
    for (int base = 0; base < rows; base += STEP * UNROLL) {
        if (base > 0) load_tile(kp, kc, kt, cached, row0, base, rows, sub, col);
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int r = base + u * STEP + sub;
            float d[GROUP];
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                d[g] = 0.f;
                #pragma unroll
                for (int j = 0; j < PPT; ++j)
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) d[g] = fmaf(qf[g][j][i], to_f(kp[u][j].e[i]), d[g]);
            }
            #pragma unroll
            for (int off = LPR / 2; off > 0; off >>= 1)
                #pragma unroll
                for (int g = 0; g < GROUP; ++g) d[g] += __shfl_xor_sync(0xffffffffu, d[g], off);
            if (col == 0 && r < rows)
                #pragma unroll
                for (int g = 0; g < GROUP; ++g) s_p[g][r] = d[g];
        }
    }
    Pack vp[UNROLL][PPT];
    load_tile(vp, vc, vt, cached, row0, 0, rows, sub, col);   // in flight through the max and sum below
    __syncthreads();

    // the chunk's max and sum of 2^(s - max) per query row; one warp per row
    for (int g = tid / 32; g < GROUP; g += WARPS) {
        const int lane = tid % 32;
        float m = NEG_INF;
        for (int r = lane; r < rows; r += 32) m = fmaxf(m, s_p[g][r]);
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        float l = 0.f;
        for (int r = lane; r < rows; r += 32) { const float e = exp2f(s_p[g][r] - m); s_p[g][r] = e; l += e; }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        if (lane == 0) { s_m[g] = m; s_l[g] = l; }
    }
    __syncthreads();

    // pass 2: acc = sum_r p_r v_r; V read once
    float acc[GROUP][PPT][VEC];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g)
        #pragma unroll
        for (int j = 0; j < PPT; ++j)
            #pragma unroll
            for (int i = 0; i < VEC; ++i) acc[g][j][i] = 0.f;
    for (int base = 0; base < rows; base += STEP * UNROLL) {
        if (base > 0) load_tile(vp, vc, vt, cached, row0, base, rows, sub, col);
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int r = base + u * STEP + sub;
            if (r >= rows) continue;
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float p = s_p[g][r];
                #pragma unroll
                for (int j = 0; j < PPT; ++j)
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[g][j][i] = fmaf(p, to_f(vp[u][j].e[i]), acc[g][j][i]);
            }
        }
    }
    // sum over the rows a warp's lanes covered, then over warps through shared memory
    #pragma unroll
    for (int off = LPR; off < 32; off <<= 1)
        #pragma unroll
        for (int g = 0; g < GROUP; ++g)
            #pragma unroll
            for (int j = 0; j < PPT; ++j)
                #pragma unroll
                for (int i = 0; i < VEC; ++i) acc[g][j][i] += __shfl_xor_sync(0xffffffffu, acc[g][j][i], off);
    if (tid % 32 < LPR)
        #pragma unroll
        for (int g = 0; g < GROUP; ++g)
            #pragma unroll
            for (int j = 0; j < PPT; ++j)
                #pragma unroll
                for (int i = 0; i < VEC; ++i) s_acc[tid / 32][g][(col + j * LPR) * VEC + i] = acc[g][j][i];
    __syncthreads();

    // this chunk's partial (m, l, acc) per query row, float32; partials [heads][chunks][GROUP]
    float* pacc = part + ((size_t)head * chunks + chunk) * OUTS;
    float* pml = part + (size_t)gridDim.y * chunks * OUTS + ((size_t)head * chunks + chunk) * GROUP * 2;
    for (int x = tid; x < OUTS; x += THREADS) {
        float s = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) s += s_acc[w][x / HEAD][x % HEAD];
        pacc[x] = s;
    }
    if (tid < GROUP) { pml[tid * 2] = s_m[tid]; pml[tid * 2 + 1] = s_l[tid]; }
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(&arrivals[head], 1u) == (unsigned)(chunks - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();

    // the last block of this head combines the chunks (read through L2): (M, L) per query row
    // by a block-wide merge of the (m_c, l_c), then y = sum_c acc_c 2^(m_c - M) / L with SPLIT
    // threads per output, so that only a few L2 round trips are in series
    const float* hacc = part + (size_t)head * chunks * OUTS;
    const float* hml = part + (size_t)gridDim.y * chunks * OUTS + (size_t)head * chunks * GROUP * 2;
    float cm[GROUP], cl[GROUP];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) { cm[g] = NEG_INF; cl[g] = 0.f; }
    for (int c = tid; c < chunks; c += THREADS)
        #pragma unroll
        for (int g = 0; g < GROUP; ++g)
            merge_ml(cm[g], cl[g], __ldcg(hml + (c * GROUP + g) * 2), __ldcg(hml + (c * GROUP + g) * 2 + 1));
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float m2 = __shfl_xor_sync(0xffffffffu, cm[g], off), l2 = __shfl_xor_sync(0xffffffffu, cl[g], off);
            merge_ml(cm[g], cl[g], m2, l2);
        }
    if (tid % 32 == 0)
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) { s_p[g][tid / 32] = cm[g]; s_p[g][WARPS + tid / 32] = cl[g]; }
    __syncthreads();
    if (tid < GROUP) {
        float m = NEG_INF, l = 0.f;
        for (int w = 0; w < WARPS; ++w) merge_ml(m, l, s_p[tid][w], s_p[tid][WARPS + w]);
        s_m[tid] = m;
        s_l[tid] = l;
    }
    __syncthreads();
    float* s_split = &s_acc[0][0][0];   // SPLIT x OUTS partial sums (SPLIT <= WARPS)
    for (int x0 = tid; x0 < OUTS * SPLIT; x0 += THREADS) {
        const int x = x0 % OUTS, first = x0 / OUTS, g = x / HEAD;
        const float big = s_m[g];
        float o = 0.f;
        #pragma unroll 4
        for (int c = first; c < chunks; c += SPLIT)
            o = fmaf(exp2f(__ldcg(hml + (c * GROUP + g) * 2) - big), __ldcg(hacc + (size_t)c * OUTS + x), o);
        s_split[first * OUTS + x] = o;
    }
    __syncthreads();
    for (int x = tid; x < OUTS; x += THREADS) {
        float o = 0.f;
        #pragma unroll
        for (int s = 0; s < SPLIT; ++s) o += s_split[s * OUTS + x];
        from_f(o / s_l[x / HEAD], y + (size_t)head * OUTS + x);
    }
    if (tid == 0) arrivals[head] = 0u;   // re-armed for the next launch
}
"""


class DecodeAttention:
    """One decode attention's kernel, compiled and with its partials and arrival counters
    allocated once (so CUDA-graph capture sees no allocation); `__call__` enqueues it on the
    current CuPy stream."""

    kernels = 1

    def __init__(self, shape: DecodeShape, device_id: int = 0):
        import cupy

        from powerfusion.backends.cuda.runtime import compile_source, device_info
        self.shape = shape
        self.chunk = chunk_rows(shape, device_info(device_id).sm_count)
        self.chunks = math.ceil(shape.kv_len / self.chunk)
        module = compile_source(decode_source(shape, self.chunk), name="pf_decode_attention", device=device_id)
        self.kernel = module.kernel("pf_decode_attention")
        self.part = cupy.empty(shape.heads * self.chunks * shape.group * (shape.head_size + 2), np.float32)
        self.arrivals = cupy.zeros(shape.heads, np.uint32)
        self.scale_log2 = np.float32(shape.scale * math.log2(math.e))

    def misfit(self, q, k, v, out, k_tail=None, v_tail=None) -> str:
        """"" where the arrays suit the kernel (contiguous, 16-byte aligned, of the planned sizes),
        else what does not (the session's arena aligns every tensor to 256 bytes; arrays bound by
        a caller may not be)."""
        s = self.shape
        cached = s.kv_len - s.tail
        arrays = [("q", q, s.heads * s.group), ("k", k, s.heads * cached), ("v", v, s.heads * cached),
                  ("output", out, s.heads * s.group)]
        if s.tail:
            if k_tail is None or v_tail is None:
                return f"decode attention: {s.tail} appended row(s) planned, no k_tail / v_tail given"
            arrays += [("k_tail", k_tail, s.heads * s.tail), ("v_tail", v_tail, s.heads * s.tail)]
        for name, x, n in arrays:
            if x.size != n * s.head_size or x.data.ptr % 16 or not x.flags.c_contiguous:
                return (f"decode attention: {name} must be a contiguous, 16-byte aligned array of "
                        f"{n * s.head_size} elements, got shape {x.shape}")
        return ""

    def __call__(self, q, k, v, out, k_tail=None, v_tail=None) -> None:
        s = self.shape
        why = self.misfit(q, k, v, out, k_tail, v_tail)
        if why:
            raise ValueError(why)
        tails = (k_tail, v_tail) if s.tail else (k, v)   # unread without a tail
        self.kernel.launch((self.chunks, s.heads), (THREADS,),
                           (q, k, v, out, self.part, self.arrivals, np.int32(s.kv_len), self.scale_log2, *tails))


def plan_decode(graph, nodes, device_id: int = 0) -> tuple[dict[str, DecodeAttention], dict[str, str]]:
    """({node: its split-KV kernel}, {node: why not}) for Attention nodes."""
    routes, why = {}, {}
    for node in nodes:
        shape, reason = decode_shape(graph, node)
        if shape is None:
            why[node.name] = reason
            continue
        routes[node.name] = DecodeAttention(shape, device_id)
    return routes, why


def split_kv_reference(q, k, v, scale: float, chunk: int) -> np.ndarray:
    """The kernel's algorithm in numpy float32 (chunk partials, then the combine): q [heads, G, D],
    k and v [heads, T, D]; the result [heads, G, D] in float32."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    qs = q * np.float32(scale * math.log2(math.e))
    ms, ls, accs = [], [], []
    for c0 in range(0, k.shape[1], chunk):
        s = qs @ np.swapaxes(k[:, c0:c0 + chunk], 1, 2)            # [heads, G, rows]
        m = s.max(axis=-1, keepdims=True)
        p = np.exp2(s - m)
        ms.append(m)
        ls.append(p.sum(axis=-1, keepdims=True))
        accs.append(p @ v[:, c0:c0 + chunk])
    big = np.max(ms, axis=0)
    w = [np.exp2(m - big) for m in ms]
    total = sum(wi * li for wi, li in zip(w, ls))
    return (sum(wi * a for wi, a in zip(w, accs)) / total).astype(np.float32)
