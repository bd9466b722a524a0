"""int8 x int8 -> int32 GEMMs on the GPU (backends/cuda/int8_gemm.py) against numpy's int64
product (exact), the IMMA route and its fallback, and quantised models through a captured
CUDA-graph session against onnxruntime (tolerances as in test_qdq.py)."""
from __future__ import annotations

import numpy as np
import pytest

from powerfusion.session import InferenceSession

from .helpers import mlp, ort_run, rel_error
from .test_qdq import _ort_quantize, _output_step, _Stack

pytestmark = pytest.mark.gpu     # skipped without a GPU (tests/conftest.py)


def _int8(rng, shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


@pytest.mark.parametrize("a_shape,b_shape,trans_b,route", [
    ((128, 768), (768, 3072), False, "imma"),
    ((1, 128, 3072), (3072, 768), False, "imma"),   # BERT's FFN down projection, K = 3072
    ((2, 3, 64, 256), (256, 96), False, "imma"),    # batch broadcast over B
    ((4, 64, 128), (4, 32, 128), True, "imma"),     # batched, B transposed
    ((16, 30), (30, 64), False, "fallback"),        # K not a multiple of 4
    ((16, 64), (64, 10), False, "fallback"),        # N (ldc) not a multiple of 4
])
def test_int8_gemm_is_exact(a_shape, b_shape, trans_b, route):
    import cupy
    from powerfusion.backends.cuda.blas import Blas
    from powerfusion.backends.cuda.int8_gemm import Int8Gemm
    rng = np.random.default_rng(0)
    a, b = _int8(rng, a_shape), _int8(rng, b_shape)
    bt = np.swapaxes(b, -1, -2) if trans_b else b
    ref = np.matmul(a.astype(np.int64), bt.astype(np.int64))
    blas = Blas()
    blas.bind(cupy.cuda.get_current_stream())
    gemm = Int8Gemm(blas)
    out = cupy.zeros(ref.shape, cupy.int32)
    assert gemm.gemm_into("g", cupy.asarray(a), cupy.asarray(b), out, trans_b=trans_b)
    np.testing.assert_array_equal(out.get(), ref)
    assert gemm.routes["g"].startswith(route), gemm.routes


def test_int8_gemm_refuses_other_dtypes():
    import cupy
    from powerfusion.backends.cuda.blas import Blas
    from powerfusion.backends.cuda.int8_gemm import Int8Gemm
    a = cupy.zeros((8, 8), cupy.int8)
    assert not Int8Gemm(Blas()).gemm_into("g", a, a, cupy.zeros((8, 8), cupy.float32))


@pytest.mark.parametrize("graph", [False, True])
def test_dynamic_quantized_mlp_on_cuda(graph):
    q = _ort_quantize(mlp(k=64, m=16), False)
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    sess = InferenceSession(q, target="cuda", options={"cuda_graph": graph})
    assert rel_error(sess.run(None, {"x": x})[0], ort_run(q, {"x": x})[0]) < 1e-5


@pytest.mark.parametrize("m", [4, 32])      # 4 rows: a GEMV in a generated kernel; 32: IMMA
def test_static_qdq_mlp_on_cuda(m):
    xs = np.random.default_rng(3).standard_normal((24, m, 64)).astype(np.float32)
    q = _ort_quantize(mlp(k=64, n=64, m=m), True, "QDQ", True, reader=_Stack(xs))
    sess = InferenceSession(q, target="cuda", options={"cuda_graph": True})
    ours = sess.run(None, {"x": xs[0]})[0]
    assert np.abs(ours - ort_run(q, {"x": xs[0]}, optimize=False)[0]).max() <= _output_step(q) * 1.001
