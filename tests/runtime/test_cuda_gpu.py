"""On the GPU: NVRTC compile + launch through the disk cache, and the library ops
(cuBLAS matmul / gemm, im2col conv) against numpy references.

Tolerances (inputs rounded to the dtype first, reference in float64):
fp32 rtol 1e-4 / atol 1e-4 (cuBLAS fp32, no TF32); fp16 rtol 1e-2 / atol 2e-2;
bf16 rtol 2e-2 / atol 6e-2 (8-bit mantissa; one rounding of the output).
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 2e-2), "bfloat16": (2e-2, 6e-2)}

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void axpb(const float* x, __half* yh, __nv_bfloat16* yb, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = a * x[i] + b;
        yh[i] = __float2half(v);
        yb[i] = __float2bfloat16(v);
    }
}
"""


@pytest.fixture
def cache(tmp_path):
    from powerfusion.runtime.cache import KernelCache
    return KernelCache(tmp_path / "kernels")


def test_device_info():
    from powerfusion.backends.cuda.runtime import device_info
    info = device_info()
    assert info.arch == f"sm_{info.compute_capability}" and info.compute_capability >= 70
    assert info.sm_count > 0 and info.l2_bytes > 0 and info.memory_bytes > 1 << 30


def test_nvrtc_compile_launch_and_cache_hit(cache):
    import cupy
    import ml_dtypes
    from powerfusion.backends.cuda.runtime import compile_source
    first = compile_source(SOURCE, cache=cache)
    assert not first.cache_hit and cache.status()["entries"] == 1
    second = compile_source(SOURCE, cache=cache)
    assert second.cache_hit and cache.stats.misses == 1
    n = 1000
    x = cupy.asarray(np.arange(n, dtype=np.float32) / 7)
    yh = cupy.empty(n, cupy.float16)
    yb = cupy.empty(n, cupy.uint16)
    second.kernel("axpb").launch(((n + 127) // 128,), (128,), (x, yh, yb, np.float32(2.0), np.float32(-1.0), np.int32(n)))
    ref = 2.0 * (np.arange(n, dtype=np.float32) / 7) - 1.0
    np.testing.assert_array_equal(yh.get(), ref.astype(np.float16))
    np.testing.assert_array_equal(yb.get().view(ml_dtypes.bfloat16), ref.astype(ml_dtypes.bfloat16))


def test_nvrtc_error_names_the_source(cache):
    from powerfusion.backends.cuda.runtime import compile_source
    from powerfusion.errors import CompileError
    with pytest.raises(CompileError, match=r"(?s)\.cu.*undefined_thing"):
        compile_source('extern "C" __global__ void k(float* y) { y[0] = undefined_thing; }', cache=cache)


def test_precompile_fills_the_cache_in_parallel_and_defers_failures(cache):
    from powerfusion.backends.cuda.runtime import compile_source, precompile_sources
    from powerfusion.errors import CompileError
    sources = [SOURCE.replace("axpb", f"axpb{i}") for i in range(6)]
    bad = 'extern "C" __global__ void k(float* y) { y[0] = undefined_thing; }'
    items = [(s, (), f"k{i}") for i, s in enumerate(sources)] + [(sources[0], (), "again"), (bad, (), "bad")]
    assert precompile_sources(items, jobs=4, cache=cache) == 6      # six new, one repeat, one failure
    assert cache.status()["entries"] == 6
    assert precompile_sources(items, jobs=4, cache=cache) == 0      # all cached (the failure is tried again: 0)
    for i, s in enumerate(sources):
        assert compile_source(s, cache=cache).cache_hit
    with pytest.raises(CompileError, match="undefined_thing"):   # named where the kernel is loaded
        compile_source(bad, cache=cache)


def _to_device(a, dtype):
    """(device array, logical dtype, float64 reference of the rounded input)."""
    import cupy
    import ml_dtypes
    if dtype == "bfloat16":
        r = a.astype(ml_dtypes.bfloat16)
        return cupy.asarray(r.view(np.uint16)), "bfloat16", r.astype(np.float64)
    r = a.astype(dtype)
    return cupy.asarray(r), None, r.astype(np.float64)


def _to_host(y, dtype):
    import ml_dtypes
    y = y.get()
    return y.view(ml_dtypes.bfloat16).astype(np.float64) if dtype == "bfloat16" else y.astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shapes,ta,tb", [(((64, 32), (32, 48)), False, False),
                                           (((2, 1, 8, 16), (3, 16, 5)), False, False),
                                           (((4, 16, 8), (4, 5, 16)), True, True),
                                           (((1, 33), (33, 1)), False, False)])
def test_matmul(dtype, shapes, ta, tb):
    from powerfusion.backends.cuda.library import matmul
    rng = np.random.default_rng(0)
    a, la, ar = _to_device(rng.uniform(-1, 1, shapes[0]), dtype)
    b, _, br = _to_device(rng.uniform(-1, 1, shapes[1]), dtype)
    y = matmul(a, b, trans_a=ta, trans_b=tb, logical_dtype=la)
    ref = np.matmul(np.swapaxes(ar, -1, -2) if ta else ar, np.swapaxes(br, -1, -2) if tb else br)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(_to_host(y, dtype), ref, rtol=rtol, atol=atol)


def test_bf16_native_dtype_if_cupy_has_it():
    import cupy
    import ml_dtypes
    from powerfusion.backends.cuda.library import bf16_matmul_native, matmul
    try:
        a = cupy.asarray(np.eye(8, dtype=ml_dtypes.bfloat16))
    except Exception as e:
        pytest.skip(f"CuPy has no bfloat16 dtype ({type(e).__name__}); the uint16-bits path is tested above")
    b = cupy.asarray(np.arange(64, dtype=np.float32).reshape(8, 8).astype(ml_dtypes.bfloat16))
    y = matmul(a, b)
    assert y.dtype == a.dtype
    np.testing.assert_array_equal(y.get().astype(np.float32), np.arange(64, dtype=np.float32).reshape(8, 8))
    assert isinstance(bf16_matmul_native(), bool)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gemm(dtype):
    from powerfusion.backends.cuda.library import gemm
    rng = np.random.default_rng(1)
    a, la, ar = _to_device(rng.uniform(-1, 1, (24, 40)), dtype)
    b, _, br = _to_device(rng.uniform(-1, 1, (16, 24)), dtype)
    c, _, cr = _to_device(rng.uniform(-1, 1, (16,)), dtype)
    y = gemm(a, b, c, alpha=0.5, beta=2.0, trans_a=True, trans_b=True, logical_dtype=la)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(_to_host(y, dtype), 0.5 * ar.T @ br.T + 2.0 * cr, rtol=rtol, atol=atol)


def conv_reference(x, w, b, strides, pads, dilations, group):
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    (sh, sw), (ph0, pw0, ph1, pw1), (dh, dw) = strides, pads, dilations
    xp = np.pad(x, ((0, 0), (0, 0), (ph0, ph1), (pw0, pw1)))
    oh = (h + ph0 + ph1 - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + pw0 + pw1 - dw * (kw - 1) - 1) // sw + 1
    y = np.zeros((n, m, oh, ow))
    mg = m // group
    for g in range(group):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                           j * dw:j * dw + sw * (ow - 1) + 1:sw]
                y[:, g * mg:(g + 1) * mg] += np.einsum("nchw,mc->nmhw", patch, w[g * mg:(g + 1) * mg, :, i, j])
    return y + (b.reshape(1, m, 1, 1) if b is not None else 0)


CONV_CASES = [  # x shape, w shape, strides, pads (begin h, w, end h, w), dilations, group, bias
    ((2, 3, 9, 11), (4, 3, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True),
    ((1, 4, 16, 13), (6, 2, 3, 2), (2, 3), (0, 1, 2, 0), (2, 1), 2, False),
    ((2, 8, 7, 7), (8, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 8, True),   # depthwise
    ((1, 5, 6, 6), (7, 5, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1, True),   # 1x1, strided
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[str(i) for i in range(len(CONV_CASES))])
def test_conv2d(dtype, case):
    from powerfusion.backends.cuda.library import conv
    xs, ws, strides, pads, dil, group, has_bias = case
    rng = np.random.default_rng(2)
    x, lx, xr = _to_device(rng.uniform(-1, 1, xs), dtype)
    w, _, wr = _to_device(rng.uniform(-1, 1, ws), dtype)
    b, _, br = _to_device(rng.uniform(-1, 1, ws[0]), dtype) if has_bias else (None, None, None)
    y = conv(x, w, b, strides=strides, pads=pads, dilations=dil, group=group, logical_dtype=lx)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(_to_host(y, dtype), conv_reference(xr, wr, br, strides, pads, dil, group),
                               rtol=rtol, atol=atol)


def test_conv1d_matches_onnx_reference():
    import cupy
    import onnx
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    from powerfusion.backends.cuda.library import conv
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (2, 4, 20)).astype(np.float32)
    w = rng.uniform(-1, 1, (6, 2, 3)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[2], pads=[1, 2], dilations=[2], group=2)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape),
                                            helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, w.shape)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    (ref,) = ReferenceEvaluator(helper.make_model(graph)).run(None, {"x": x, "w": w})
    y = conv(cupy.asarray(x), cupy.asarray(w), strides=(2,), pads=(1, 2), dilations=(2,), group=2)
    np.testing.assert_allclose(y.get(), ref, rtol=1e-4, atol=1e-4)


def test_conv_rejects_mismatched_groups():
    import cupy
    from powerfusion.backends.cuda.library import conv
    with pytest.raises(ValueError, match="group=2"):
        conv(cupy.zeros((1, 3, 4, 4), cupy.float32), cupy.zeros((4, 1, 1, 1), cupy.float32), group=2)


@pytest.mark.gpu
def test_device_bf16_conversion_keeps_nan_and_matches_ml_dtypes():
    """The device bf16 pair against ml_dtypes' rounding; NaN (any payload) stays NaN."""
    import cupy
    import ml_dtypes
    from powerfusion.ttile.runtime import bf16_bits_to_f32, f32_to_bf16_bits
    x = np.array([1.0, -2.5, 3.14159, 1e-40, 65504.0, np.inf, -np.inf, np.nan], np.float32)
    x = np.concatenate([x, np.array([0x7F800001, 0x7FFFFFFF], np.uint32).view(np.float32)])
    bits = f32_to_bf16_bits(cupy.asarray(x)).get()
    want = x.astype(ml_dtypes.bfloat16)
    got = bits.view(ml_dtypes.bfloat16)
    assert np.array_equal(np.isnan(got.astype(np.float32)), np.isnan(x))
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite].astype(np.float32), want[finite].astype(np.float32))
    back = bf16_bits_to_f32(cupy.asarray(bits)).get()
    np.testing.assert_array_equal(np.isnan(back), np.isnan(x))
