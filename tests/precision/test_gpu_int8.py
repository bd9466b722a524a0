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


def _mlp(**kw):
    """helpers.mlp at an IR version the onnxruntime of older installs still loads."""
    model = mlp(**kw)
    model.ir_version = 9
    return model


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
    # a constant weight: a [K, N] one is transposed once and multiplied in the TN layout
    out[...] = 0
    assert gemm.gemm_into("w", cupy.asarray(a), cupy.asarray(b), out, trans_b=trans_b, b_constant=True)
    np.testing.assert_array_equal(out.get(), ref)


@pytest.mark.parametrize("a_shape,n", [((128, 768), 3072), ((1, 128, 3072), 768), ((2, 3, 64, 256), 96)])
def test_int8_weight_gemm_through_cublaslt_is_exact(a_shape, n):
    """Constant weights go through cuBLASLt's heuristic (int8_lt.py), checked against cublasGemmEx
    at the first run and here against numpy's int64 product, at the first and a later call."""
    import cupy
    from powerfusion.backends.cuda.blas import Blas
    from powerfusion.backends.cuda.blaslt import BlasLt
    from powerfusion.backends.cuda.int8_gemm import Int8Gemm
    from powerfusion.backends.cuda.int8_lt import Int8Lt
    rng = np.random.default_rng(1)
    a, b = _int8(rng, a_shape), _int8(rng, (a_shape[-1], n))
    ref = np.matmul(a.astype(np.int64), b.astype(np.int64))
    blas = Blas()
    blas.bind(cupy.cuda.get_current_stream())
    gemm = Int8Gemm(blas, Int8Lt(BlasLt()))
    for _ in range(2):
        out = cupy.zeros(ref.shape, cupy.int32)
        assert gemm.gemm_into("w", cupy.asarray(a), cupy.asarray(b), out, b_constant=True)
        np.testing.assert_array_equal(out.get(), ref)
    assert gemm.routes["w"] == "imma-lt", gemm.routes


def test_int8_gemm_refuses_other_dtypes():
    import cupy

    from powerfusion.backends.cuda.blas import Blas
    from powerfusion.backends.cuda.int8_gemm import Int8Gemm
    a = cupy.zeros((8, 8), cupy.int8)
    assert not Int8Gemm(Blas()).gemm_into("g", a, a, cupy.zeros((8, 8), cupy.float32))


@pytest.mark.parametrize("graph", [False, True])
def test_dynamic_quantized_mlp_on_cuda(graph):
    q = _ort_quantize(_mlp(k=64, m=16), False)
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    sess = InferenceSession(q, target="cuda", options={"cuda_graph": graph})
    assert rel_error(sess.run(None, {"x": x})[0], ort_run(q, {"x": x})[0]) < 1e-5


@pytest.mark.parametrize("m", [4, 32])      # 4 rows: a GEMV in a generated kernel; 32: IMMA
def test_static_qdq_mlp_on_cuda(m):
    xs = np.random.default_rng(3).standard_normal((24, m, 64)).astype(np.float32)
    q = _ort_quantize(_mlp(k=64, n=64, m=m), True, "QDQ", True, reader=_Stack(xs))
    sess = InferenceSession(q, target="cuda", options={"cuda_graph": True})
    ours = sess.run(None, {"x": xs[0]})[0]
    assert np.abs(ours - ort_run(q, {"x": xs[0]}, optimize=False)[0]).max() <= _output_step(q) * 1.001


@pytest.mark.parametrize("x_shape,w_shape,stride,pads", [
    ((1, 3, 32, 32), (8, 3, 7, 7), 2, (3, 3, 3, 3)),      # K = 147: padded to 148
    ((2, 16, 7, 7), (32, 16, 3, 3), 1, (1, 1, 1, 1)),     # 49 output positions: padded to 52
    ((1, 64, 14, 14), (128, 64, 1, 1), 2, (0, 0, 0, 0)),  # strided 1x1 (a ResNet downsample)
])
def test_int8_conv_is_exact(x_shape, w_shape, stride, pads):
    import cupy

    from powerfusion.backends.cuda.blas import Blas
    from powerfusion.backends.cuda.int8_gemm import Int8Conv, Int8Gemm

    from .test_integer_gemm import _reference_conv
    rng = np.random.default_rng(5)
    x, w = _int8(rng, x_shape), _int8(rng, w_shape)
    ref = _reference_conv(x, w, (pads[0], pads[1], pads[2], pads[3]), stride, 0)
    blas = Blas()
    blas.bind(cupy.cuda.get_current_stream())
    gemm = Int8Gemm(blas)
    out = cupy.zeros(ref.shape, cupy.int32)
    assert Int8Conv(gemm).conv_into("c", cupy.asarray(x), cupy.asarray(w), out, strides=(stride, stride),
                                    pads=pads, dilations=(1, 1), group=1)
    np.testing.assert_array_equal(out.get(), ref)
    assert gemm.routes["c"] == "imma", gemm.routes


@pytest.mark.parametrize("graph", [False, True])
def test_dynamic_quantized_cnn_on_cuda(graph):
    """ConvInteger with uint8 activations and a run-time zero point, padded convolutions."""
    from .helpers import digits, digits_data
    q = _ort_quantize(digits("digits_cnn"), False)
    x = digits_data()["x_test"][:8]
    sess = InferenceSession(q, target="cuda", shapes={"image": x.shape}, options={"cuda_graph": graph})
    assert rel_error(sess.run(None, {"image": x})[0], ort_run(q, {"image": x})[0]) < 1e-5
