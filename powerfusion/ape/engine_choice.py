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

# grids of fewer 128 x 128 output tiles than this are where cuBLAS SGEMM splits K (measured:
# BERT FFN2 4096 x 768, 192 tiles, and ResNet-50 conv5 1568 x 512, 52 tiles, 6-10x more
# accurate than at large grids), so the emulated GEMM splits K finely there too
SPLIT_K_TILES = 256
SMALL_GRID_CHUNK = 256
# error of the chunked top level ~ c * chunk / sqrt(K) of sum |A||B| (docs/ape.md); this keeps
# it at about half of SGEMM's usual error
CHUNK_PER_SQRT_K = 16
MIN_CHUNK = 256


def tiles(m: int, n: int, tile: int = 128) -> int:
    return -(-m // tile) * -(-n // tile)


def default_chunk(m: int, n: int, k: int) -> int:
    """K per GEMM of the top level on the cuBLAS engine; 0 when one GEMM covers K."""
    if tiles(m, n) < SPLIT_K_TILES:
        chunk = SMALL_GRID_CHUNK
    else:
        chunk = max(MIN_CHUNK, 1 << int(math.log2(CHUNK_PER_SQRT_K * math.sqrt(max(k, 1)))))
    return chunk if chunk < k else 0


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
