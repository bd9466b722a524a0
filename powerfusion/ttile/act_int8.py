"""Int8-activation typed GEMM for MatMulLowBit's act_dtype int8 (W4A8, W2A8):

    s[m] = max_k |A[m, k]| / 127,  q = rint(A / s) (half to even, in [-127, 127]),
    Y = s[m] * (q @ dequant(W)^T) + bias

three launches on preallocated buffers (row quantisation, the dp4a typed GEMM with the
weight scales applied, the row rescale), so a CUDA graph can capture them. The rounding
is a separate step here; fusing it into the kernel that produces A is the GIR's job.
"""
from __future__ import annotations

import numpy as np

from .matmul import Matmul, PackedWeight
from .quant import QuantizedWeight, quantize_rows_int8

_ROWS_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ float ld(const {T}* p, long i) {{ return {LOAD}; }}
extern "C" __global__ void __launch_bounds__(256)
quant_rows_{TAG}(const {T}* __restrict__ A, signed char* __restrict__ Q, float* __restrict__ S, int K) {{
  __shared__ float red[8];
  const long row = blockIdx.x;
  float m = 0.0f;
  for (int k = threadIdx.x; k < K; k += 256) m = fmaxf(m, fabsf(ld(A, row * K + k)));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < 8; ++w) m = fmaxf(m, red[w]);
  const float s = m > 0.0f ? m / 127.0f : 1.0f;
  for (int k = threadIdx.x; k < K; k += 256) {{
    float q = rintf(ld(A, row * K + k) / s);
    Q[row * K + k] = (signed char)fminf(fmaxf(q, -127.0f), 127.0f);
  }}
  if (threadIdx.x == 0) S[row] = s;
}}
extern "C" __global__ void scale_rows_{TAG}(const float* __restrict__ acc, const float* __restrict__ S,
    const float* __restrict__ bias, {O}* __restrict__ Y, int M, int N, int has_bias) {{
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)M * N) return;
  float v = acc[i] * S[i / N] + (has_bias ? bias[i % N] : 0.0f);
  Y[i] = {STORE};
}}
"""
_LOAD = {"fp16": ("__half", "__half2float(p[i])"), "bf16": ("unsigned short", "__uint_as_float(((unsigned)p[i]) << 16)"),
         "fp32": ("float", "p[i]")}
_STORE = {"fp16": ("__half", "__float2half_rn(v)"), "fp32": ("float", "v"),
          "bf16": ("__nv_bfloat16", "__float2bfloat16_rn(v)")}


def rows_source(A_dtype: str, out_dtype: str) -> tuple[str, str]:
    t, load = _LOAD[A_dtype]
    o, store = _STORE[out_dtype]
    tag = f"{A_dtype}_{out_dtype}"
    return tag, _ROWS_SRC.format(T=t, LOAD=load, O=o, STORE=store, TAG=tag)


class Int8ActMatmul:
    """Matmul's interface (pack, to_device, __call__) for fp16 / bf16 activations rounded to
    int8 per row on the device; out_dtype fp16, bf16 or fp32."""

    def __init__(self, M: int, N: int, K: int, A_dtype: str, W_dtype: str, out_dtype: str,
                 group_size: int | None, with_bias: bool):
        if A_dtype not in ("fp16", "bf16"):
            raise ValueError(f"int8 activations are rounded from fp16 / bf16, not {A_dtype}")
        if out_dtype not in _STORE:
            raise ValueError(f"out_dtype must be one of {sorted(_STORE)}, got {out_dtype!r}")
        self.inner = Matmul(M, N, K, "int8", W_dtype, out_dtype="fp32", group_size=group_size)
        self.M, self.N, self.K = M, N, K
        self.A_dtype, self.out_dtype, self.with_bias = A_dtype, out_dtype, with_bias
        self.kind = "int8-" + self.inner.kind
        self.fused = self.inner.fused     # capturable when the GEMM is (no cuBLAS call)
        self.spec = self.inner.spec
        self._fns = None
        self._buf = {}

    def pack(self, qw: QuantizedWeight, bias=None) -> PackedWeight:
        if self.with_bias != (bias is not None):
            raise ValueError(f"with_bias={self.with_bias} but bias {'missing' if bias is None else 'given'}")
        p = self.inner.pack(qw)
        b = None if bias is None else np.asarray(bias, np.float32).reshape(self.N)
        return PackedWeight(p.words, p.scale, p.zeros, b, p.layout, p.K)

    def reference(self, A: np.ndarray, packed: PackedWeight) -> np.ndarray:
        """numpy: per-row int8 rounding in float64, the integer GEMM's reference, rescale."""
        q, s = quantize_rows_int8(np.asarray(A, np.float32))
        inner = PackedWeight(packed.words, packed.scale, packed.zeros, None, packed.layout, packed.K)
        y = self.inner.reference(q.astype(np.int8), inner).astype(np.float64) * s
        return y + (0 if packed.bias is None else packed.bias.astype(np.float64))

    def to_device(self, packed: PackedWeight):
        return self.inner.to_device(packed)

    @property
    def rows_source(self) -> tuple[str, str]:
        """(tag, CUDA source) of the row quantisation and rescale kernels."""
        return rows_source(self.A_dtype, self.out_dtype)

    def _kernels(self):
        if self._fns is None:
            from .runtime import compile_kernel
            tag, src = self.rows_source
            self._fns = (compile_kernel(src, f"quant_rows_{tag}"), compile_kernel(src, f"scale_rows_{tag}"))
        return self._fns

    def _buffer(self, key, shape, dtype):
        import cupy as cp
        if key not in self._buf:
            self._buf[key] = cp.zeros(shape, dtype)
        return self._buf[key]

    def __call__(self, A, packed, out=None):
        import cupy as cp
        dev = self.to_device(packed) if isinstance(packed, PackedWeight) else packed
        words, scale, zeros, bias = dev
        want = cp.float16 if self.A_dtype == "fp16" else cp.uint16
        if A.shape != (self.M, self.K) or A.dtype != want:
            raise ValueError(f"A has shape {A.shape} and dtype {A.dtype}, expected {(self.M, self.K)} {np.dtype(want)}")
        odt = {"fp16": cp.float16, "bf16": cp.uint16, "fp32": cp.float32}[self.out_dtype]
        out = out if out is not None else cp.empty((self.M, self.N), odt)
        quant, rescale = self._kernels()
        q = self._buffer("q", (self.M, self.K), cp.int8)
        s = self._buffer("s", (self.M,), cp.float32)
        acc = self._buffer("acc", (self.M, self.N), cp.float32)
        stream = cp.cuda.get_current_stream()
        quant((self.M,), (256,), (cp.ascontiguousarray(A), q, s, np.int32(self.K)), stream=stream)
        self.inner(q, [words, scale, zeros, None], out=acc)
        null = self._buffer("null", (1,), cp.float32)
        n = self.M * self.N
        rescale((-(-n // 256),), (256,), (acc, s, null if bias is None else bias, out, np.int32(self.M),
                                          np.int32(self.N), np.int32(bias is not None)), stream=stream)
        return out
