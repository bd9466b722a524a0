"""Prefill sizes (16 <= M) on tensor cores: the tile of each M bucket, the K split, and a numpy
model of how the kernel (`kernels/prefill_body.cu.j2`) turns packed words into mma fragments.

The kernel reads the same packed words as the M = 1 GEMV (`quant.pack_words`, "pair" layout for
integer types, byte pairs for 4-bit tables), so one packed weight serves decode and prefill and
the M bucket is picked at run time (BitBLAS's dynamic-M dispatch). Structure after Marlin: a
multistage cp.async ring for activations and packed weights, dequantisation in registers right
before `mma.m16n8k16`, K split across blocks where the tiles alone do not fill the GPU.
Written here rather than taken from Marlin / BitBLAS because those ship their own weight layouts
and launchers (PyTorch extensions / TVM), and this kernel must read the GEMV's layout."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .ttype import get_ttype

BK = 128               # K elements per pipeline stage (one group of 128: one scale per row and stage)
MIN_M = 16             # below this the CUDA-core GEMV wins (fewer wasted tensor-core rows)
SMEM_PER_SM = 227 << 10
LUT_BYTES = 256 * 4 * 16


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Block tile of the tensor-core kernel: warps_m x warps_n warps, each wm m16 x wn n8 tiles."""
    warps_m: int
    warps_n: int
    wm: int
    wn: int
    stages: int
    fp32_scale: bool = False   # group scale applied to fp32 partial sums per chunk (not per fragment)

    @property
    def bm(self) -> int:
        return self.warps_m * self.wm * 16

    @property
    def bn(self) -> int:
        return self.warps_n * self.wn * 8

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def tag(self) -> str:
        return f"t{self.warps_m}x{self.warps_n}m{self.wm}n{self.wn}s{self.stages}" + ("f" if self.fp32_scale else "")

    def smem_bytes(self, lut: bool) -> int:
        """Dynamic shared memory: the ring of activation and weight stages (+ the pair table)."""
        a = self.bm * (BK * 2 + 16)
        b = self.bn * (BK // 2 + 16)
        return self.stages * (a + b) + (LUT_BYTES if lut else 0)


# BitBLAS-style M buckets: the tile for the smallest bucket holding M (None: every larger M).
# Small M: one or two m16 tiles, 8 warps side by side along N, group scales on fp32 partial sums
# (the dequantisation is the instruction bottleneck there); larger M: 64 x 16 / 64 x 32 warp tiles.
M_BUCKETS: tuple[tuple[int | None, TileConfig], ...] = (
    (16, TileConfig(1, 8, 1, 2, 3, True)),
    (32, TileConfig(1, 8, 2, 2, 3, True)),
    (64, TileConfig(1, 8, 4, 2, 4)),
    (128, TileConfig(1, 8, 4, 2, 4)),
    (None, TileConfig(1, 8, 4, 4, 4)),
)
# (each the best geomean of CANDIDATE_TILES at its M on H200, benchmarks/results/ttile-prefill.md;
# 32 was not measured: the 2 x 2 fp32-scaled tile was within 3 % of the best at M = 64)

# the profiling step of hint-based scheduling: tiles the benchmark times against the buckets' own
CANDIDATE_TILES: tuple[TileConfig, ...] = (
    TileConfig(1, 8, 1, 2, 4), TileConfig(1, 8, 1, 2, 4, True), TileConfig(1, 8, 1, 2, 2, True),
    TileConfig(1, 4, 1, 4, 3, True), TileConfig(1, 8, 1, 4, 3, True), TileConfig(1, 4, 1, 2, 3, True),
    TileConfig(1, 8, 4, 2, 3, True), TileConfig(1, 8, 2, 2, 3, True), TileConfig(1, 8, 2, 4, 3, True),
    TileConfig(1, 8, 4, 2, 4), TileConfig(1, 8, 4, 4, 3), TileConfig(2, 4, 2, 4, 4), TileConfig(2, 4, 4, 4, 3),
    TileConfig(1, 8, 4, 4, 4))


def bucket_of(M: int) -> int:
    """Upper end of M's bucket (the largest bucket is open: its representative is 256)."""
    for top, _ in M_BUCKETS:
        if top is None or M <= top:
            return top or 256
    raise AssertionError("unreachable")


def tile_for(M: int) -> TileConfig:
    for top, tile in M_BUCKETS:
        if top is None or M <= top:
            return tile
    raise AssertionError("unreachable")


def supports(A_dtype: str, W_dtype: str, zmode: str, group: int, K: int, K_pad: int) -> str | None:
    """None if the tensor-core prefill kernel runs this GEMM, else why not."""
    tt = get_ttype(W_dtype)
    if A_dtype not in ("fp16", "bf16"):
        return f"activations {A_dtype} (fp16 / bf16 only)"
    if tt.bits != 4 or tt.kind == "block":
        return f"weights {W_dtype} (4-bit integer or table types only)"
    if zmode not in ("sym", "none", "quantized"):
        return f"zero points '{zmode}' (symmetric, none or quantized only)"
    if group != K_pad and group % BK:
        return f"group {group} (a multiple of {BK} or per channel)"
    if K % 8:
        return f"K = {K} (a multiple of 8: 16-byte activation copies)"
    return None


def registers(tile: TileConfig, zeros: bool = False) -> int:
    """Registers per thread the kernel is held to (`__launch_bounds__` gets the resulting blocks per
    SM): accumulators, double-buffered A fragments and packed words, ~24 others; with fp32 scaling
    the partial sums, the scales (and zero points) of two chunks, fewer others. Calibrated on
    nvcc 13 for sm_90 to compile without spills (63 for 1 x 2 fp32-scaled warp tiles, 166 for 4 x 4)."""
    if tile.fp32_scale:
        return 8 * tile.wm * tile.wn + 8 * tile.wm + 12 * tile.wn + 16 + (8 * tile.wn if zeros else 0)
    return 4 * tile.wm * tile.wn + 8 * tile.wm + 8 * tile.wn + 24


def occupancy(tile: TileConfig, lut: bool, zeros: bool = False) -> int:
    """Blocks per SM, by shared memory, threads and registers (64 K per SM)."""
    return max(1, min(SMEM_PER_SM // tile.smem_bytes(lut), 2048 // tile.threads,
                      65536 // (registers(tile, zeros) * tile.threads), 8))


def choose_splits(M: int, N: int, K_pad: int, tile: TileConfig, sms: int, lut: bool = False,
                  zeros: bool = False) -> int:
    """Blocks along K, only where the tiles leave block slots empty (each split adds fp32
    partials): the fewest that minimise the makespan in chunks (waves of resident blocks x
    chunks per block; a partly filled wave costs a full one), at most 2 waves, >= 4 chunks each."""
    tiles = math.ceil(M / tile.bm) * math.ceil(N / tile.bn)
    chunks = math.ceil(K_pad / BK)
    slots = sms * occupancy(tile, lut, zeros)
    if tiles >= slots:
        return 1
    top = max(1, min(chunks // 4, 2 * math.ceil(slots / tiles)))
    return min(range(1, top + 1), key=lambda s: (math.ceil(tiles * s / slots) * math.ceil(chunks / s), s))


def split_ranges(chunks: int, splits: int) -> list[tuple[int, int]]:
    """The chunk range of each K split, as the kernel computes it."""
    return [(z * chunks // splits, (z + 1) * chunks // splits) for z in range(splits)]


# ---- numpy model of the kernel's fragment flow (checked against a plain matmul on the CPU) ----

def lane_b_fragment(words: np.ndarray, bits: int, layout: str, lane: int, table=None) -> np.ndarray:
    """Codes (or table values) the kernel's lane puts in b[0], b[1] for one k16 step: pair t of
    each of the step's two words (words [8 rows, 2] of its n8 tile), for its row g = lane / 4."""
    g, t = lane // 4, lane % 4
    out = []
    for v in range(2):
        w = int(words[g, v])
        if layout == "pair":      # code 2t at bits 4t, code 2t+1 at bits 16 + 4t
            x = w >> (4 * t)
            out += [x & 0xF, (x >> 16) & 0xF]
        else:                     # natural: byte t holds codes 2t (low nibble) and 2t+1
            x = (w >> (8 * t)) & 0xFF
            out += [x & 0xF, x >> 4]
    codes = np.array(out)
    return codes if table is None else np.asarray(table)[codes]


def lane_a_fragment(a16: np.ndarray, lane: int) -> np.ndarray:
    """ldmatrix.x4 of a 16 x 16 activation tile: a0 (row g, k 2t..), a1 (row g+8), a2 (row g,
    k 8+2t..), a3 (row g+8, k 8+2t..), two elements each."""
    g, t = lane // 4, lane % 4
    return np.array([a16[g, 2 * t], a16[g, 2 * t + 1], a16[g + 8, 2 * t], a16[g + 8, 2 * t + 1],
                     a16[g, 8 + 2 * t], a16[g, 9 + 2 * t], a16[g + 8, 8 + 2 * t], a16[g + 8, 9 + 2 * t]])


def mma_m16n8k16(a_frag: list, b_frag: list) -> np.ndarray:
    """C[16, 8] of one mma from the 32 lanes' fragments (PTX's m16n8k16 fragment layout)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = a_frag[lane]
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[0:2], a[2:4]
        A[g, 8 + 2 * t:10 + 2 * t], A[g + 8, 8 + 2 * t:10 + 2 * t] = a[4:6], a[6:8]
        b = b_frag[lane]
        B[2 * t:2 * t + 2, g], B[8 + 2 * t:10 + 2 * t, g] = b[0:2], b[2:4]
    return A @ B


def emulate(A: np.ndarray, words: np.ndarray, bits: int, layout: str, splits: int = 1, table=None,
            offset: int = 0) -> np.ndarray:
    """C = A . W^T as the kernel forms it from fragments: per 16 x 8 tile, per K split, per
    chunk of BK and k16 step (scales left out: the kernel multiplies each fragment by its group's
    scale, which the plain dequantise-then-matmul reference covers). A [M, K_pad], M and N
    multiples of 16 and 8; words [N, K_pad / 8]; value = code - offset (or table[code])."""
    M, Kp = A.shape
    N = words.shape[0]
    E = 32 // bits
    C = np.zeros((M, N))
    for m0 in range(0, M, 16):
        for n0 in range(0, N, 8):
            for c0, c1 in split_ranges(math.ceil(Kp / BK), splits):
                part = np.zeros((16, 8))
                for kc in range(c0, c1):
                    for s in range(BK // 16):
                        k = kc * BK + 16 * s
                        if k >= Kp:
                            continue
                        w = words[n0:n0 + 8, k // E:k // E + 2]
                        b = [lane_b_fragment(w, bits, layout, ln, table) - (0 if table is not None else offset)
                             for ln in range(32)]
                        a = [lane_a_fragment(A[m0:m0 + 16, k:k + 16], ln) for ln in range(32)]
                        part += mma_m16n8k16(a, b)
                C[m0:m0 + 16, n0:n0 + 8] += part
    return C


def emulate_fp32_scale(A: np.ndarray, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int,
                       magic: float = 1024.0) -> np.ndarray:
    """The fp32-scaled kernel's algebra per BK chunk: the mma sees magic + code, a second mma the
    row sums of A, and acc += s * (tmp - (magic + z) * sum(A)) per column. scale, zero [N, K / group]."""
    M, K = A.shape
    acc = np.zeros((M, codes.shape[0]))
    for k0 in range(0, K, BK):
        a = A[:, k0:k0 + BK]
        tmp = a @ (magic + codes[:, k0:k0 + BK]).T
        sa = a.sum(axis=1, keepdims=True)
        s, z = scale[:, k0 // group], zero[:, k0 // group]
        acc += s * (tmp - (magic + z) * sa)
    return acc
