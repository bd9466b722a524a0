"""CUDA: the shared C renderer as is (warps of 32, shared memory, __shfl_xor_sync)."""
from __future__ import annotations

from powerfusion.backends.cstyle.renderer import CRenderer


class CUDARenderer(CRenderer):
    # NVRTC has no <math.h>, so INFINITY (max/min reduction identities) comes from math_constants.h
    header = CRenderer.header + "\n#pragma nv_diag_suppress 177\n#ifndef INFINITY\n#define INFINITY CUDART_INF_F\n#endif"
