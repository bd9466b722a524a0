"""`DynamicMatmul`: one packed weight, every M, the kernel picked by the activation rows at run
time (BitBLAS's dynamic-M dispatch): M < 16 the CUDA-core GEMV (compiled for that M), 16 <= M
the scheduler's choice for M's bucket (`prefill.M_BUCKETS`) among the kernels that read the GEMV's
packed words: the tensor-core prefill kernel (one per bucket, M a kernel argument) or, where the
scheduler predicts it slower or it does not apply (`prefill.supports`), dequantise + cuBLAS.
Decode and prefill share the weight bytes."""
from __future__ import annotations

from . import prefill
from .matmul import Matmul


class DynamicMatmul:
    def __init__(self, N: int, K: int, A_dtype: str = "fp16", W_dtype: str = "int4",
                 out_dtype: str | None = None, group_size: int | None = 128, zeros_mode: str | None = None,
                 with_bias: bool = False, arch: str = "sm_90", target: str = "h200"):
        self.N, self.K = N, K
        self._kw = dict(A_dtype=A_dtype, W_dtype=W_dtype, out_dtype=out_dtype, group_size=group_size,
                        zeros_mode=zeros_mode, with_bias=with_bias, arch=arch, target=target)
        self.decode = Matmul(1, N, K, kernel="gemv", **self._kw)
        self._by_rows: dict[int, Matmul] = {1: self.decode}
        self._kind: dict[int, str] = {}

    def kernel_for(self, M: int) -> str:
        """The scheduler's kernel at the top of M's bucket, among those that read the GEMV's words
        (gemv, tc, dequant: the per-tile mma kernel has a layout of its own)."""
        key = M if M < prefill.MIN_M else prefill.bucket_of(M)
        if key not in self._kind:
            kind = Matmul(key, self.N, self.K, **self._kw).kind
            self._kind[key] = kind if kind in ("gemv", "tc", "dequant") else "dequant"
        return self._kind[key]

    @property
    def spec(self):
        """Types, group and padding shared by every M's kernel (the decode kernel's spec)."""
        return self.decode.spec

    def matmul_for(self, M: int) -> Matmul:
        """The Matmul that runs M activation rows (built, not compiled, on first use)."""
        if M < 1:
            raise ValueError(f"activation rows must be >= 1, got {M}")
        # the GEMV and the dequantise + cuBLAS path are built per M; the prefill kernel per bucket
        kernel = "gemv" if M < prefill.MIN_M else self.kernel_for(M)
        key = prefill.bucket_of(M) if kernel == "tc" else M
        if key not in self._by_rows:
            self._by_rows[key] = Matmul(key, self.N, self.K, kernel=kernel, **self._kw)
        mm = self._by_rows[key]
        assert mm.spec.K_pad == self.decode.spec.K_pad and mm.spec.layout == self.decode.spec.layout
        return mm

    def pack(self, weight, scale=None, zeros=None, bias=None):
        """The one packed weight every M reads (the GEMV's words)."""
        return self.decode.pack(weight, scale, zeros, bias)

    def reference(self, A, packed):
        """float64 matmul of the dequantised packed weight (any number of rows)."""
        return self.decode.reference(A, packed)

    def __call__(self, A, packed, out=None):
        return self.matmul_for(A.shape[0])(A, packed, out)
