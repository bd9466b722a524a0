"""numpy model of how a tensor-core GEMM sums its products (the cuBLAS engine's GEMMs).

Each part product is exact (11 x 11 or 8 x 8 significant bits). The tensor cores add them in
groups of `step` products to the fp32 accumulator: every addend (the group's products and the
accumulator) is aligned to the largest exponent among them and cut to fp32's 24 bits at that
magnitude plus 2 bits by truncation (round toward zero), the aligned values are summed
exactly, and the sum is truncated to fp32 (the structure Fasi, Higham, Mikaitis and Pranesh
found for V100 / A100, "Numerical behavior of NVIDIA tensor cores", 2021). On the H200 this
model with groups of 16 and 2 extra bits reproduces cuBLAS's fp16 and bf16 GEMMs bit for bit
in 94-100 % of outputs (`benchmarks/diag/ape_chunk_sweep.py`, docs/ape.md); for TF32 the
group of 8 is the mma instruction's K, not measured (cuBLAS split K at the probe's size). Each group thus loses up to about one fp32 ulp of the running sum, always
toward zero, where an fp32 FMA loses half an ulp either way. Over one long K the losses add
up: the error grows with K, unlike SGEMM's, and a long GEMM's error is well above SGEMM's.

`tc_matmul` is the model of one such GEMM; `reference.emulated_matmul(..., truncate=True)`
uses it for every level of part products. Finite values only (overflow is not modelled).
"""
from __future__ import annotations

import numpy as np

# products per truncating group: one mma instruction's K (m16n8k16 fp16 / bf16, m16n8k8 TF32)
TC_STEP = {"float16": 16, "bfloat16": 16, "tf32": 8}
FP32_BITS = 24
ALIGN_EXTRA_BITS = 2     # addends keep 2 bits below the fp32 ulp of the largest (measured, H200)


def _quantum(big: np.ndarray, extra: int = 0) -> np.ndarray:
    """fp32's ulp at magnitude `big` (float64 array), 2^(e - 24) for big in [2^(e-1), 2^e),
    divided by 2^extra."""
    _, e = np.frexp(big)
    return np.ldexp(1.0, e - FP32_BITS - extra)


def truncate_to_fp32(x: np.ndarray) -> np.ndarray:
    """float64 -> the fp32 value nearer zero (round toward zero to 24 significant bits),
    kept as float64."""
    q = _quantum(np.abs(x))
    return np.trunc(x / q) * q


def tc_matmul(lhs: np.ndarray, rhs: np.ndarray, step: int) -> np.ndarray:
    """fp32 C = lhs @ rhs summed as the tensor cores do (module docstring): per group of
    `step` products along K, all addends aligned to the largest and truncated, summed exactly,
    the sum truncated to fp32. Exact in float64: products have at most 24 bits, and the aligned
    addends are integers below 2^26 in units of the group's quantum."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    acc = np.zeros((lhs.shape[0], rhs.shape[1]), np.float64)
    for k0 in range(0, lhs.shape[1], step):
        terms = lhs[:, k0:k0 + step, None] * rhs[None, k0:k0 + step, :]        # (M, step, N)
        q = _quantum(np.maximum(np.abs(acc), np.abs(terms).max(axis=1)), ALIGN_EXTRA_BITS)
        total = np.trunc(acc / q) * q + (np.trunc(terms / q[:, None]) * q[:, None]).sum(axis=1)
        acc = truncate_to_fp32(total)
    return acc.astype(np.float32)
