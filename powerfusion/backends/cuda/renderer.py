"""CUDA: the shared C renderer as is (warps of 32, shared memory, __shfl_xor_sync)."""
from __future__ import annotations

from powerfusion.backends.c_renderer import CRenderer


class CUDARenderer(CRenderer):
    header = CRenderer.header + "\n#pragma nv_diag_suppress 177"
