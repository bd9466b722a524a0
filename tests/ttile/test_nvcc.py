"""Every generated kernel compiles with nvcc for sm_80 and sm_90 (skipped without nvcc)."""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from powerfusion.ttile.codegen import combinations
from powerfusion.ttile.matmul import Matmul

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _kernels():
    """Fused kernel at M = 1 (split-K tiling) and M = 4, plus the dequantise kernel (M = 64)."""
    for a, w, zm, out in combinations():
        g = None if w.startswith("mx") else 64
        for M in (1, 4, 64):
            mm = Matmul(M, 200, 1000, a, w, out_dtype=out, group_size=g, zeros_mode=zm, with_bias=True,
                        rows_per_warp=4 if M == 1 else None)
            if M == 64 and a == "int8" and out == "fp16":
                continue   # same fused kernel family as M = 4
            yield mm


def _nvcc(tmp_path, mm):
    src = tmp_path / f"{mm.name}.cu"
    src.write_text(mm.source)
    cmd = ["nvcc", "-std=c++17", "-fatbin", "-gencode", "arch=compute_80,code=sm_80",
           "-gencode", "arch=compute_90,code=sm_90", "-Werror", "all-warnings", "-o",
           str(src.with_suffix(".fatbin")), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return mm.name, r.returncode, r.stderr[-2000:]


def test_all_kernels_compile_for_sm80_and_sm90(tmp_path):
    kernels = list(_kernels())
    assert len({mm.name for mm in kernels}) == len(kernels)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda mm: _nvcc(tmp_path, mm), kernels))
    failed = [(n, err) for n, rc, err in results if rc]
    assert not failed, failed[:3]
