"""compile_check_nvcc: a good kernel compiles for sm_80 and sm_90; a bad one names its source and log."""
from __future__ import annotations


import pytest

from powerfusion.backends.cuda.runtime import compile_check_nvcc
from powerfusion.errors import CompileError

pytestmark = pytest.mark.usefixtures("nvcc")   # conftest.require_tool: skips, or fails where required

GOOD = r"""
#include <cuda_bf16.h>
extern "C" __global__ void scale(const __nv_bfloat16* x, float* y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * __bfloat162float(x[i]);
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_good_kernel_compiles(arch, tmp_path):
    path = tmp_path / "scale.cu"
    path.write_text(GOOD)
    compile_check_nvcc(path, arch)
    compile_check_nvcc(GOOD, arch)  # source text works too


def test_bad_kernel_reports_path_and_log(tmp_path):
    path = tmp_path / "broken.cu"
    path.write_text('extern "C" __global__ void k(float* y) { y[0] = undefined_name; }\n')
    with pytest.raises(CompileError) as info:
        compile_check_nvcc(path, "sm_90")
    assert str(path) in str(info.value) and "undefined_name" in str(info.value)
