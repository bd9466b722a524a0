"""Ape: fp32 GEMMs emulated on tensor cores (FP32-F from fp16, FP32-T from TF32, FP32-B from
bf16) and int16 GEMMs from int8, with the type chosen per K panel from the data.

`reference_matmul` and `block_mask` are numpy; `matmul` runs on CuPy arrays (cuBLAS GEMMs or
our own tensor-core kernels, fed by our split kernels). See docs/ape.md for the error analysis."""
from .adapter import PANEL, Plan, Speeds, decide, f_block_fraction, panel_classes
from .reference import (MASK_B, MASK_F, MASK_FP32, MODES, ApeError, block_mask, element_class,
                        reference_matmul)
from .types import FP32_B, FP32_F, FP32_T, TYPES, EmulatedType, reconstruct, split, split_int16


def matmul(a, b, mode: str = "auto", out=None, *, k_chunk: int | None = None, speeds: Speeds | None = None,
           engine: str = "auto"):
    """C = A B on CuPy arrays: float32 in one of MODES, or int16 x int16 -> int32 (exact
    modulo 2^32). `engine`: "cublas" (split kernels feeding cuBLAS GEMMs, the top level of part
    products in K chunks), "mma" (our own tensor-core kernels, round-to-nearest accumulation),
    "auto" (cuBLAS with the default chunks; docs/ape.md says why). `k_chunk` (cuBLAS engine):
    K per GEMM of the top level, None for `engine_choice.default_chunk`, 0 for one GEMM;
    `speeds` replaces the decider's measured per-type speeds."""
    from .device import matmul as _matmul
    return _matmul(a, b, mode=mode, out=out, k_chunk=k_chunk, speeds=speeds, engine=engine)


__all__ = ["matmul", "reference_matmul", "block_mask", "element_class", "MODES", "ApeError", "PANEL",
           "Plan", "Speeds", "decide", "f_block_fraction", "panel_classes", "MASK_F", "MASK_B",
           "MASK_FP32", "FP32_F", "FP32_T", "FP32_B", "TYPES", "EmulatedType", "split", "reconstruct",
           "split_int16"]
