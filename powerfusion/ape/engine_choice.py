"""Which engine, and which K chunk, an Ape GEMM runs with (no GPU needed to decide).

Two engines run the split parts (docs/ape.md): "cublas" (cuBLAS fp16 / bf16 / TF32 GEMMs, one
per level of part products, the top level in K chunks) and "mma" (our own tensor-core kernel,
round-to-nearest accumulation every k-tile of 32). Engine "auto" is the cuBLAS engine with the
chunk of `default_chunk`: measured on the H200 it is the faster of the two at every benchmark
shape and, with that chunk, within SGEMM's error where SGEMM runs its usual kernels
(docs/ape.md, "Which engine auto picks").

Why chunks: a tensor-core GEMM sums K in one truncating accumulator, so its error grows with
K (`accumulation.py`); only the top level (Hi Hi) carries enough of C for that to show.
"""
from __future__ import annotations

import math

ENGINES = ("auto", "mma", "cublas")
AUTO_ENGINE = "cublas"

# Chunk of the top level: the error of a top level in chunks of C columns of K is about
# c * C / sqrt(K) of sum |A||B| (c measured on the H200 at 8192^3: FP32-F 1.3e-8, FP32-B
# 1.1e-8, FP32-T 2.3e-8; TF32's mma truncates every 8 products, fp16 / bf16's every 16), so a
# chunk of X sqrt(K) gives about c X at every K: 2.1e-7 (F), 1.8e-7 (B), 2.8e-7 (T) for the X
# below, under SGEMM's 3.0e-7 at 1024^3 and its 4.4e-7 at 8192^3 (docs/ape.md)
CHUNK_PER_SQRT_K = {"fp32-f": 16, "fp32-t": 12, "fp32-b": 16}
CHUNK_ALIGN = 128
# where cuBLAS SGEMM splits K it is 5-6x more accurate (BERT FFN2 4096 x 768 x 3072: 6.7e-8;
# ResNet-50 conv5 1568 x 512 x 4608: 8.3e-8; measured on the H200): grids of fewer 128 x 128
# tiles than SPLIT_K_TILES with K >= SPLIT_K_MIN_K get chunks SPLIT_K_SHRINK times shorter
SPLIT_K_TILES, SPLIT_K_MIN_K, SPLIT_K_SHRINK = 256, 2048, 6


def tiles(m: int, n: int, tile: int = 128) -> int:
    return -(-m // tile) * -(-n // tile)


def split_k_shape(m: int, n: int, k: int) -> bool:
    """A shape where cuBLAS SGEMM is likely to split K (few output tiles, long K)."""
    return tiles(m, n) < SPLIT_K_TILES and k >= SPLIT_K_MIN_K


def default_chunk(m: int, n: int, k: int, mode: str) -> int:
    """K per GEMM of the top level on the cuBLAS engine (a multiple of CHUNK_ALIGN); 0 when
    one GEMM covers K."""
    chunk = CHUNK_PER_SQRT_K[mode] * math.sqrt(max(k, 1))
    if split_k_shape(m, n, k):
        chunk /= SPLIT_K_SHRINK
    chunk = max(CHUNK_ALIGN, int(chunk) // CHUNK_ALIGN * CHUNK_ALIGN)
    return chunk if chunk < k else 0


def default_chunk_sum(m: int, n: int, k: int, mode: str) -> str:
    """How the chunks reach C (measured on the H200, docs/ape.md): one strided-batched GEMM and
    an ordered sum kernel for FP32-T (TF32 GEMMs chained through beta = 1 ran 20 % slower at
    8192^3) and on split-K shapes (many short chunks); else a chain of GEMMs with beta = 1."""
    return "batched" if mode == "fp32-t" or split_k_shape(m, n, k) else "beta"


MMA_MIN_TILES, MMA_MIN_N = 64, 256   # our kernel's 128 x 256 block tiles (FP32-F)


def mma_fills(m: int, n: int) -> bool:
    """Whether a GEMM gives our kernel (no split-K) a grid worth its split kernels: N at least one
    block tile wide and at least MMA_MIN_TILES output tiles. Measured on the H200 (docs/ape.md):
    every benchmark GEMM that fails this ran slower than SGEMM on the mma engine (ResNet-50's
    classifier 32 x 1000: 0.06x; its 3x3 convs with N = 64 ... 512 over 26-49 tiles: 0.28-0.60x;
    1024^3, 32 tiles: 0.48x), every one that passes ran 1.09-1.67x SGEMM."""
    return n >= MMA_MIN_N and -(-m // 128) * -(-n // 256) >= MMA_MIN_TILES


CUBLAS_MIN_DIM = 256


def cublas_pays(m: int, n: int, k: int) -> bool:
    """Whether the cuBLAS engine beats SGEMM at this shape. Measured on the H200 (docs/ape.md):
    slower at ResNet-50's classifier (M = 32: 0.46x), its 3x3 conv2 (N = 64: 0.52x), 1x1 conv2
    (K = 64: 0.73x) and even at conv3 (N = 128: 1.01x); faster wherever M, N and K are all at
    least 256 (1.6-4x)."""
    return min(m, n, k) >= CUBLAS_MIN_DIM


def emulation_pays(engine: str, m: int, n: int, k: int) -> bool:
    """Whether "auto" should run an emulated plan at all on `engine` (else SGEMM, exact)."""
    return mma_fills(m, n) if engine == "mma" else cublas_pays(m, n, k)


def mma_applies(n: int, k_chunk: int | None) -> bool:
    """Whether our own tensor-core kernel can run a GEMM with N columns (its 16-byte loads of
    B's rows need N % 8 == 0; K chunks belong to the cuBLAS engine)."""
    return n % 8 == 0 and not k_chunk


def pick_engine(engine: str, n: int, k_chunk: int | None, error) -> str:
    """The engine a GEMM with N columns runs on; `error` is the exception type to raise."""
    if engine not in ENGINES:
        raise error(f"unknown Ape engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if engine == "mma" and not mma_applies(n, k_chunk):
        raise error(f"Ape engine 'mma' needs N % 8 == 0 and no k_chunk, got N = {n}, k_chunk = {k_chunk}")
    if engine == "auto":
        return AUTO_ENGINE if (AUTO_ENGINE == "cublas" or mma_applies(n, k_chunk)) else "cublas"
    return engine
