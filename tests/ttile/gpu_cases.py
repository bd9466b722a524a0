"""Shared by the GPU tests and the device precompile step: the matmuls the GPU tests run."""
from __future__ import annotations

from powerfusion.ttile import prefill
from powerfusion.ttile.codegen import combinations
from powerfusion.ttile.matmul import Matmul
from powerfusion.ttile.ttype import get_ttype

GPU_M = (1, 4, 16, 64, 256)
GPU_N = 96        # not a multiple of rows per block (4 warps x 2 rows x ... ) on purpose
GPU_K = 1000      # not a multiple of any lane chunk (16..128 elements)


def group_for(w: str) -> int | None:
    """MX types carry their own block; 1-bit words hold 32 elements, so the tensor-core kernel
    (one group per word of 4 k16 steps: G >= 128) needs 128; else 64 (not a divisor of K)."""
    if w.startswith("mx"):
        return None
    return 128 if get_ttype(w).bits == 1 else 64


def gpu_matmuls(K: int = GPU_K):
    for a, w, zm, out in combinations():
        for M in GPU_M:
            yield Matmul(M, GPU_N, K, a, w, out_dtype=out, group_size=group_for(w),
                         zeros_mode=zm, with_bias=True)


TILING_COMBOS = [("fp16", "int4", None, "fp16"), ("int8", "int2", None, "fp16"), ("int8", "int4", None, "int32"),
                 ("bf16", "uint2", "original", "bf16"), ("fp16", "int1", None, "fp16"), ("fp16", "nf4", None, "fp16")]
# (R, ksplit, stages, batch): K = 4192 leaves a last step with fewer chunks than `batch` for every type
TILINGS = [(1, 1, 2, 1), (2, 1, 2, 1), (4, 1, 2, 1), (4, 4, 2, 1), (8, 4, 2, 1), (2, 1, 3, 1), (4, 4, 3, 1),
           (2, 1, 2, 4), (4, 1, 2, 2), (2, 1, 3, 4), (4, 4, 3, 2), (1, 1, 2, 8)]


def tiling_matmuls():
    for a, w, zm, out in TILING_COMBOS:
        for R, ks, st, b in TILINGS:
            for M, K in ((1, 4096 + 96), (3, 1000)):
                yield Matmul(M, 72, K, a, w, out_dtype=out, group_size=128, zeros_mode=zm, with_bias=True,
                             rows_per_warp=R, ksplit=ks, stages=st, batch=b)


PATH_COMBOS = [("fp16", "int4", None, "fp16"), ("bf16", "uint4", "original", "bf16"), ("fp16", "uint2", "rescale", "fp32"),
               ("fp16", "nf4", None, "fp16"), ("bf16", "fp8_e4m3", None, "bf16"), ("fp16", "uint8", "quantized", "fp16")]


def path_matmuls():
    for a, w, zm, out in PATH_COMBOS:
        for kernel in ("mma", "gemv", "dequant"):
            for M, K in ((16, 1000), (40, 520), (64, 256)):
                yield Matmul(M, 72, K, a, w, out_dtype=out, group_size=64, zeros_mode=zm, with_bias=True,
                             kernel=kernel)


UNALIGNED_COMBOS = [("fp16", "int4", None, "fp16"), ("bf16", "uint4", "quantized", "bf16"),
                    ("int8", "int2", None, "int32"), ("fp16", "nf4", None, "fp32")]
UNALIGNED_SHAPES = ((1, 999, 32), (3, 777, None), (16, 130, 128))   # (M, K, group); None: per channel


def unaligned_matmuls(combo=None):
    for a, w, zm, out in ([combo] if combo else UNALIGNED_COMBOS):
        for M, K, g in UNALIGNED_SHAPES:
            yield Matmul(M, 40, K, a, w, out_dtype=out, group_size=g, zeros_mode=zm, with_bias=True)


# the tensor-core prefill kernel: (A, W, zeros, out, group); N, K not multiples of the tiles
PREFILL_COMBOS = [("fp16", "int4", None, "fp16", 128), ("bf16", "int4", None, "bf16", 128),
                  ("fp16", "nf4", None, "fp16", 128), ("fp16", "uint4", "quantized", "fp16", 128),
                  ("fp16", "fp4_e2m1", None, "fp32", None), ("bf16", "int4", None, "fp32", 256)]
PREFILL_MS = (16, 17, 48, 64, 100, 256)


PREFILL_TILES = prefill.CANDIDATE_TILES


def prefill_matmuls(combo=None):
    for a, w, zm, out, g in ([combo] if combo else PREFILL_COMBOS):
        for M in PREFILL_MS:
            yield Matmul(M, 200, 1000, a, w, out_dtype=out, group_size=g, zeros_mode=zm, with_bias=True, kernel="tc")
    if combo is None:
        from powerfusion.ttile.dispatch import DynamicMatmul
        dm = DynamicMatmul(200, 1000, "fp16", "int4", group_size=128, with_bias=True)
        yield from (dm.matmul_for(M) for M in (1, 3, 16, 40, 64, 128, 256))
        yield from (Matmul(40, 136, 17 * 128, "fp16", "int4", group_size=128, with_bias=True, kernel="tc"),)
        for tile in PREFILL_TILES:
            yield from (Matmul(M, 264, 1024 + 256, "fp16", "int4", group_size=128, tile=tile, kernel="tc") for M in (16, 130))
