"""HIP: the shared C renderer with 64-lane wavefronts, LDS and HIP's spellings."""
from __future__ import annotations

from powerfusion.backends.cstyle.renderer import CRenderer


class HIPRenderer(CRenderer):
    lanes = 64
    # HIP compiles the CUDA skeleton as is (threadIdx, blockIdx, extern __shared__), so it keeps skeleton_package
    header = ("#include <hip/hip_runtime.h>\n#include <hip/hip_fp16.h>\n#include <hip/hip_bfloat16.h>\n"
              "#include <math.h>")
    warp_sync = "__builtin_amdgcn_wave_barrier()"
    ctype = {**CRenderer.ctype, "bfloat16": "hip_bfloat16"}
    to_float = {"float16": "__half2float({})", "bfloat16": "static_cast<float>({})"}
    from_float = {"float16": "__float2half({})", "bfloat16": "hip_bfloat16({})"}

    def shfl_xor(self, value: str, mask: int) -> str:
        return f"__shfl_xor({value}, {mask})"
