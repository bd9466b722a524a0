"""Typed low-precision GEMM (Ladder / BitBLAS): tType, tTile, transforms, hint-based
scheduling, and generated W{int8,int4,int2,int1,nf4,fp4,fp8,mxfp4,mxfp8} x A{fp16,bf16,int8} kernels."""
from .matmul import Matmul, PackedWeight
from .quant import QuantizedWeight, dequantize, pack_bits, quantize, unpack_bits
from .ttype import REGISTRY, TType, get_ttype

__all__ = ["Matmul", "PackedWeight", "QuantizedWeight", "TType", "REGISTRY", "get_ttype",
           "quantize", "dequantize", "pack_bits", "unpack_bits"]
