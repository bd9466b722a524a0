"""The GPU matrix (tests/ttile/gpu_cases.py) covers what it must, checked without a GPU:
every (A, W, zeros mode, out) combination at every M of GPU_M, each on every kernel family
the scheduler allows for it (CUDA-core GEMV, tensor-core mma, dequantise + cuBLAS), with K
a multiple of no lane chunk, group or mma slab."""
from __future__ import annotations

import pytest

from powerfusion.ttile.codegen import chunk_elems, combinations
from powerfusion.ttile.device import schedule_typed_gemm
from powerfusion.ttile.ttype import get_ttype

from .gpu_cases import GPU_K, GPU_M, GPU_N, gpu_matmuls, group_for, path_matmuls, tiling_matmuls


def _families(a, w):
    out = set()
    for kernel in ("gemv", "mma", "dequant"):
        try:
            schedule_typed_gemm(16, GPU_N, GPU_K, a, w, group_for(w), kernel=kernel)
            out.add(kernel)
        except ValueError:
            pass
    return out


def test_every_combination_runs_every_family_at_every_m():
    seen, ms = {}, {}
    for mm in gpu_matmuls():
        s = mm.spec
        key = (s.A_dtype, s.W_dtype, s.zeros_mode, s.out_dtype)
        seen.setdefault(key, set()).add(mm.kind)
        ms.setdefault(key, set()).add(mm.M)
    assert set(seen) == set(combinations())
    for combo in combinations():
        assert ms[combo] == set(GPU_M), combo
        assert seen[combo] == _families(combo[0], combo[1]), combo


@pytest.mark.parametrize("combo", combinations(), ids=lambda c: "-".join(str(x) for x in c))
def test_k_is_a_multiple_of_no_tile(combo):
    w = combo[1]
    tiles = {chunk_elems(get_ttype(w).bits), 256, 512} | ({group_for(w)} if group_for(w) else {32})
    assert all(GPU_K % t for t in tiles), tiles


def test_kernel_count_fits_the_device_budget():
    """Each distinct source is one NVRTC compile (benchmarks/ttile/precompile.py warms CuPy's disk
    cache in parallel before the tests run). NVRTC 12.9 took 0.66 s per kernel for sm_90 on one
    core of the build machine: 450 kernels are ~20-45 s on the device's 16 cores."""
    names = {mm.name for mm in list(gpu_matmuls()) + list(tiling_matmuls()) + list(path_matmuls())}
    assert len(names) <= 450, len(names)
