"""CUDA: the shared C renderer as is (warps of 32, shared memory, __shfl_xor_sync)."""
from __future__ import annotations

import re

from powerfusion.backends.cstyle.renderer import CRenderer

_HALF_HEADERS = ("#include <cuda_fp16.h>\n", "#include <cuda_bf16.h>\n")
# anything that may need them: a 16-bit type or conversion (__half, __nv_bfloat16, __float2half_rn,
# half2 ...) or a half intrinsic (__hadd2, __hmul ...); a false match only keeps the headers
_HALF_NAMES = re.compile(r"half|bfloat|\b__h[a-z]")


class CUDARenderer(CRenderer):
    # NVRTC has no <math.h>, so INFINITY (max/min reduction identities) comes from math_constants.h
    header = CRenderer.header + "\n#pragma nv_diag_suppress 177\n#ifndef INFINITY\n#define INFINITY CUDART_INF_F\n#endif"

    def trim_headers(self, source: str) -> str:
        """`source` without cuda_fp16.h and cuda_bf16.h where nothing in it uses them (a float32
        kernel): NVRTC, on threads compiling a model's kernels at once, spent most of its time on
        those headers (100 float32 kernels on 16 threads: 4.6 s with them, 1.8 s without)."""
        rest = source
        for h in _HALF_HEADERS:
            rest = rest.replace(h, "", 1)
        return source if _HALF_NAMES.search(rest) else rest
