"""Generated kernels compile with nvcc for sm_80 and sm_90 (skipped without nvcc).
The full set (every combination: CUDA-core, tensor-core and dequantise kernels) is marked slow."""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from powerfusion.ttile.codegen import combinations
from powerfusion.ttile.matmul import Matmul

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
REPRESENTATIVE = [("fp16", "int4", None, "fp16", 1), ("bf16", "int4", None, "bf16", 32), ("bf16", "uint2", "original", "bf16", 3),
                  ("fp16", "nf4", None, "fp32", 1), ("bf16", "fp8_e4m3", None, "bf16", 1),
                  ("fp16", "mxfp4", None, "fp16", 16), ("int8", "int2", None, "fp16", 1),
                  ("int8", "int4", None, "int32", 4), ("fp16", "uint8", "quantized", "fp16", 512)]


def _matmul(a, w, zm, out, M, **kw):
    return Matmul(M, 200, 1000, a, w, out_dtype=out, group_size=None if w.startswith("mx") else 64,
                  zeros_mode=zm, with_bias=True, **kw)


def _nvcc(tmp_path, mm):
    src = tmp_path / f"{mm.name}.cu"
    src.write_text(mm.source)
    cmd = ["nvcc", "-std=c++17", "-fatbin", "-gencode", "arch=compute_80,code=sm_80",
           "-gencode", "arch=compute_90,code=sm_90", "-Werror", "all-warnings", "-o",
           str(src.with_suffix(".fatbin")), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return mm.name, r.returncode, r.stderr[-2000:]


def _compile_all(tmp_path, kernels):
    assert len({mm.name for mm in kernels}) == len(kernels)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda mm: _nvcc(tmp_path, mm), kernels))
    failed = [(n, err) for n, rc, err in results if rc]
    assert not failed, failed[:3]


def test_representative_kernels_compile(tmp_path):
    _compile_all(tmp_path, [_matmul(*c) for c in REPRESENTATIVE] +
                 [_matmul("fp16", "int2", None, "fp16", 1, rows_per_warp=8, ksplit=4)])


@pytest.mark.slow
def test_every_kernel_compiles(tmp_path):
    kernels = []
    for a, w, zm, out in combinations():
        kernels.append(_matmul(a, w, zm, out, 1))
        if a != "int8":
            kernels.append(_matmul(a, w, zm, out, 1024))   # the dequantise kernel
            if not w.startswith("mx"):
                kernels.append(Matmul(32, 200, 1000, a, w, out_dtype=out, zeros_mode=zm, with_bias=True,
                                      group_size=128, kernel="mma"))
    _compile_all(tmp_path, kernels)
