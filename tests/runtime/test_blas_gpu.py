"""On the GPU: the direct cuBLAS path (powerfusion.backends.cuda.blas) against cupy.matmul,
outside and inside CUDA-graph capture, and the capturable Conv (im2col + GEMM into a
planned buffer) against the allocating one.

Tolerances as tests/runtime/test_cuda_gpu.py: fp32 1e-4 (no TF32 on either side), fp16 1e-2,
bf16 2e-2 relative to the largest reference element."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOL = {"float32": 1e-4, "float16": 1e-2}

CASES = [  # a shape, b shape, trans_a, trans_b
    ((64, 96), (96, 128), False, False),
    ((96, 64), (96, 128), True, False),
    ((64, 96), (128, 96), False, True),
    ((3, 64, 96), (96, 40), False, False),          # weight broadcast over the batch
    ((197, 1, 48), (40, 48), False, True),          # one-row products sharing a weight: one GEMM
    ((3, 96, 64), (96, 40), True, False),           # A transposed per batch, weight broadcast
    ((2, 3, 5, 32), (2, 3, 32, 7), False, False),   # both batched
    ((1, 17, 33), (4, 33, 9), False, False),        # left operand broadcast
]


def _close(got, want, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() <= rtol * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("sa,sb,ta,tb", CASES)
def test_gemm_into_matches_cupy(dtype, sa, sb, ta, tb):
    import cupy
    from powerfusion.backends.cuda.blas import Blas
    rng = np.random.default_rng(0)
    a = cupy.asarray(rng.standard_normal(sa).astype(dtype))
    b = cupy.asarray(rng.standard_normal(sb).astype(dtype))
    want = cupy.matmul(cupy.swapaxes(a, -1, -2) if ta else a, cupy.swapaxes(b, -1, -2) if tb else b)
    out = cupy.full(want.shape, np.nan, dtype=dtype)
    blas = Blas()
    blas.bind(cupy.cuda.get_current_stream())
    assert blas.gemm_into(a, b, out, trans_a=ta, trans_b=tb)
    assert _close(cupy.asnumpy(out), cupy.asnumpy(want), TOL[dtype])


def test_gemm_into_refuses_a_partial_broadcast():
    import cupy
    from powerfusion.backends.cuda.blas import Blas
    a, b = cupy.ones((2, 1, 4, 8), np.float32), cupy.ones((1, 3, 8, 5), np.float32)
    assert not Blas().gemm_into(a, b, cupy.empty((2, 3, 4, 5), np.float32))


def test_gemm_into_is_captured_in_a_cuda_graph():
    import cupy
    from powerfusion.backends.cuda.blas import Blas
    rng = np.random.default_rng(1)
    a = cupy.asarray(rng.standard_normal((4, 64, 96)).astype(np.float32))
    b = cupy.asarray(rng.standard_normal((96, 80)).astype(np.float32))
    out = cupy.zeros((4, 64, 80), np.float32)
    blas, stream = Blas(), cupy.cuda.Stream(non_blocking=True)
    blas.bind(stream)
    with stream:
        stream.begin_capture()
        assert blas.gemm_into(a, b, out)
        graph = stream.end_capture()
    stream.synchronize()
    assert float(cupy.abs(out).max()) == 0.0     # captured, not run
    graph.launch(stream)
    stream.synchronize()
    assert _close(cupy.asnumpy(out), cupy.asnumpy(cupy.matmul(a, b)), 1e-4)
    a[...] = 2 * a                               # a replay reads the buffers' current contents
    graph.launch(stream)
    stream.synchronize()
    assert _close(cupy.asnumpy(out), cupy.asnumpy(cupy.matmul(a, b)), 1e-4)


@pytest.mark.parametrize("group,n", [(1, 2), (4, 1), (1, 1)])
def test_conv_into_matches_conv(group, n):
    import cupy
    from powerfusion.backends.cuda import library
    from powerfusion.backends.cuda.blas import Blas
    rng = np.random.default_rng(2)
    x = cupy.asarray(rng.standard_normal((n, 8, 12, 10)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal((16, 8 // group, 3, 3)).astype(np.float32))
    bias = cupy.asarray(rng.standard_normal(16).astype(np.float32))
    kw = dict(strides=(2, 1), pads=(1, 0, 1, 2), dilations=(1, 2), group=group)
    want = library.conv(x, w, bias, **kw)
    out = cupy.full(want.shape, np.nan, np.float32)
    blas = Blas()
    blas.bind(cupy.cuda.get_current_stream())
    assert library.conv_into(blas, x, w, bias, out, {}, **kw)
    assert _close(cupy.asnumpy(out), cupy.asnumpy(want), 1e-4)


def test_conv_into_declines_batch_and_groups_together():
    import cupy
    from powerfusion.backends.cuda import library
    from powerfusion.backends.cuda.blas import Blas
    x, w = cupy.ones((2, 8, 6, 6), np.float32), cupy.ones((8, 2, 3, 3), np.float32)
    assert not library.conv_into(Blas(), x, w, None, cupy.empty((2, 8, 4, 4), np.float32), {}, group=4)


@pytest.mark.parametrize("group", [1, 2])
def test_pointwise_conv_reads_x_directly(group):
    """1x1, stride 1, no padding: no im2col (the columns are x); checked against numpy."""
    import cupy
    from powerfusion.backends.cuda import library
    from powerfusion.backends.cuda.blas import Blas
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 8, 5, 7)).astype(np.float32)
    w = rng.standard_normal((6, 8 // group, 1, 1)).astype(np.float32)
    xg = x.reshape(1, group, 8 // group, 35)
    wg = w.reshape(group, 6 // group, 8 // group)
    want = np.einsum("gmc,ngcp->ngmp", wg, xg).reshape(1, 6, 5, 7)
    cols: dict = {}
    out = cupy.full((1, 6, 5, 7), np.nan, np.float32)
    blas = Blas()
    blas.bind(cupy.cuda.get_current_stream())
    assert library.conv_into(blas, cupy.asarray(x), cupy.asarray(w), None, out, cols, group=group)
    assert not cols   # no columns buffer was made
    assert _close(cupy.asnumpy(out), want, 1e-4)
    assert _close(cupy.asnumpy(library.conv(cupy.asarray(x), cupy.asarray(w), group=group)), want, 1e-4)
