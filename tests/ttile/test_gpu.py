"""Generated kernels against the numpy reference on a GPU.

Tolerances (max |C - ref| relative to max |ref|): fp16 activations 5e-3, bf16 3e-2
(products and <= 16-element partial sums are formed in the activation type, then
accumulated in fp32), int8 activations with fp16 output 2e-3; int32 output bit-exact."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.ttile.codegen import combinations
from tests.conftest import gpu_missing_reason

from .gpu_cases import (GPU_K, GPU_M, GPU_N, PATH_COMBOS, TILING_COMBOS, TILINGS, UNALIGNED_COMBOS, group_for,
                        unaligned_matmuls)

pytestmark = pytest.mark.gpu
TOL = {"fp16": 5e-3, "bf16": 3e-2, "int8": 2e-3}


@pytest.fixture(autouse=True)
def _need_gpu():
    if gpu_missing_reason():
        pytest.skip(gpu_missing_reason())


def _activations(rng, A_dtype, M, K):
    import ml_dtypes
    if A_dtype == "int8":
        return rng.integers(-128, 128, (M, K)).astype(np.int8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    return x.astype(np.float16) if A_dtype == "fp16" else x.astype(ml_dtypes.bfloat16)


def _to_host(c, out_dtype):
    import cupy as cp
    h = cp.asnumpy(c)
    if out_dtype == "bf16":
        return (h.astype(np.uint32) << 16).view(np.float32)
    return h


def check(mm, rng, weight_scale=1.0):
    import cupy as cp
    from powerfusion.ttile.matmul import _bits
    w = rng.standard_normal((mm.N, mm.K)).astype(np.float32) * weight_scale
    bias = rng.standard_normal(mm.N) if mm.spec.out_dtype != "int32" else rng.integers(-50, 50, mm.N)
    packed = mm.pack(w, bias=bias)
    A = _activations(rng, mm.spec.A_dtype, mm.M, mm.K)
    ref = mm.reference(A, packed)
    got = _to_host(mm(cp.asarray(_bits(A)), packed), mm.spec.out_dtype)
    if mm.spec.out_dtype == "int32":
        np.testing.assert_array_equal(got, ref)
        return
    ref = ref.astype(np.float32)
    err = np.abs(got.astype(np.float32) - ref).max() / max(np.abs(ref).max(), 1e-6)
    assert err <= TOL[mm.spec.A_dtype], f"{mm.name}: relative error {err:.2e}"


@pytest.mark.parametrize("combo", combinations(), ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("M", GPU_M)
def test_matches_reference(combo, M):
    from powerfusion.ttile.matmul import Matmul
    a, w, zm, out = combo
    mm = Matmul(M, GPU_N, GPU_K, a, w, out_dtype=out, group_size=group_for(w), zeros_mode=zm, with_bias=True)
    check(mm, np.random.default_rng(M))


@pytest.mark.parametrize("combo", UNALIGNED_COMBOS, ids=lambda c: "-".join(str(x) for x in c))
def test_unaligned_k_and_per_channel(combo):
    for mm in unaligned_matmuls(combo):
        check(mm, np.random.default_rng(mm.K))


@pytest.mark.parametrize("combo", TILING_COMBOS, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("tiling", TILINGS)
def test_tilings(combo, tiling):
    """Rows per warp, split-K across warps, steps in flight and chunks per step (the benchmark picks among these)."""
    from powerfusion.ttile.matmul import Matmul
    a, w, zm, out = combo
    for M, K in ((1, 4096 + 96), (3, 1000)):
        mm = Matmul(M, 72, K, a, w, out_dtype=out, group_size=128, zeros_mode=zm, with_bias=True,
                    rows_per_warp=tiling[0], ksplit=tiling[1], stages=tiling[2], batch=tiling[3])
        check(mm, np.random.default_rng(K + tiling[0]))


@pytest.mark.parametrize("combo", PATH_COMBOS, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("kernel", ["mma", "gemv", "dequant"])
def test_every_path_at_small_m(combo, kernel):
    """The fused CUDA-core, fused tensor-core and dequantise + cuBLAS paths agree."""
    from powerfusion.ttile.matmul import Matmul
    a, w, zm, out = combo
    for M, K in ((16, 1000), (40, 520), (64, 256)):
        mm = Matmul(M, 72, K, a, w, out_dtype=out, group_size=64, zeros_mode=zm, with_bias=True, kernel=kernel)
        check(mm, np.random.default_rng(M))
