"""Typed low-precision GEMM (Ladder / BitBLAS): tType, tTile, transforms, hint-based
scheduling, and generated W{int8,int4,int2,int1,nf4,fp4,fp8,mxfp4,mxfp8} x A{fp16,bf16,int8} kernels."""
from .dispatch import DynamicMatmul
from .matmul import Matmul, PackedWeight
from .onnx_quant import (dequantize_matmul_to_typed, matmul_nbits_reference, matmul_nbits_to_typed,
                         quantize_weights)
from .quant import QuantizedWeight, dequantize, pack_bits, quantize, unpack_bits
from .ttype import REGISTRY, TType, get_ttype

__all__ = ["Matmul", "DynamicMatmul", "PackedWeight", "quantize_weights", "matmul_nbits_reference", "matmul_nbits_to_typed",
           "dequantize_matmul_to_typed", "QuantizedWeight", "TType", "REGISTRY", "get_ttype",
           "quantize", "dequantize", "pack_bits", "unpack_bits"]
