"""On the GPU: Conv through cuDNN (powerfusion.backends.cuda.cudnn_conv) against a float64 numpy
reference, eagerly and inside CUDA-graph capture, for fp32 / fp16 / bf16, 1-D / 2-D / 3-D,
grouped, depthwise, strided, dilated and (asymmetrically) padded; and a cuda session whose Conv
steps run through cuDNN in its captured graph with nothing reported in `fallbacks`.

Tolerance, per element: |got - want| <= RTOL[dtype] * (|x| conv |w| + |b|), the reference on the
inputs already rounded to the dtype, so only accumulation and output rounding count. fp32 1e-5
(fp32 accumulation, TF32 engines deselected; Winograd engines stay allowed), fp16 2e-3 (output
rounding 2^-11 plus fp32 accumulation), bf16 1e-2 (output rounding 2^-8)."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

RTOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}

# x shape, w shape, strides, pad begins, pad ends, dilations, group, bias
CASES = {
    "3x3": ((2, 16, 12, 12), (32, 16, 3, 3), (1, 1), (1, 1), (1, 1), (1, 1), 1, True),
    "stem7x7s2": ((1, 3, 32, 32), (16, 3, 7, 7), (2, 2), (3, 3), (3, 3), (1, 1), 1, False),
    "1x1": ((2, 64, 8, 8), (32, 64, 1, 1), (1, 1), (0, 0), (0, 0), (1, 1), 1, True),
    "grouped": ((2, 16, 10, 10), (32, 4, 3, 3), (1, 1), (1, 1), (1, 1), (1, 1), 4, True),
    "depthwise_s2": ((2, 32, 9, 9), (32, 1, 3, 3), (2, 2), (1, 0), (0, 1), (1, 1), 32, True),
    "dilated": ((1, 8, 15, 15), (8, 8, 3, 3), (1, 1), (2, 2), (2, 2), (2, 2), 1, False),
    "asym_pad_strided": ((1, 6, 11, 13), (10, 6, 3, 5), (2, 3), (1, 0), (0, 2), (1, 1), 1, True),
    "1d": ((2, 8, 50), (16, 8, 5), (2,), (2,), (1,), (1,), 1, True),
    "1d_dilated_grouped": ((1, 12, 40), (6, 4, 3), (1,), (2,), (2,), (2,), 3, False),
    "3d": ((1, 4, 6, 8, 8), (8, 4, 3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1, True),
    "3d_strided_grouped": ((2, 6, 7, 9, 9), (6, 3, 3, 3, 3), (2, 2, 1), (1, 1, 0), (1, 0, 1), (1, 1, 2), 2, False),
}


@pytest.fixture(scope="module")
def cudnn_module():
    from powerfusion.backends.cuda import cudnn_conv
    module, why = cudnn_conv.load()
    if module is None:
        pytest.skip(why)
    return module


def reference(x, w, b, strides, pb, pe, dil, group):
    """float64 convolution, written out: one einsum per kernel offset over a zero-padded input."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    nsp = x.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(pb, pe)))
    out = [(xp.shape[2 + i] - dil[i] * (w.shape[2 + i] - 1) - 1) // strides[i] + 1 for i in range(nsp)]
    n, m, cg = x.shape[0], w.shape[0], w.shape[1]
    xg = xp.reshape(n, group, cg, *xp.shape[2:])
    wg = w.reshape(group, m // group, cg, *w.shape[2:])
    y = np.zeros((n, group, m // group, *out))
    for k in np.ndindex(*w.shape[2:]):
        window = tuple(slice(k[i] * dil[i], k[i] * dil[i] + strides[i] * (out[i] - 1) + 1, strides[i])
                       for i in range(nsp))
        y += np.einsum("ngc...,gmc->ngm...", xg[(slice(None),) * 3 + window], wg[(slice(None),) * 3 + k])
    y = y.reshape(n, m, *out)
    if b is not None:
        y += b.astype(np.float64).reshape(1, m, *[1] * nsp)
    return y


def _round(a, dtype):
    import ml_dtypes
    return a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def _device(a):
    import cupy
    return cupy.asarray(a.view(np.uint16) if a.dtype.name == "bfloat16" else a)


def _host(a, dtype):
    import cupy
    import ml_dtypes
    h = cupy.asnumpy(a)
    return (h.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else h).astype(np.float64)


def _inputs(case, dtype, seed=0):
    xs, ws, strides, pb, pe, dil, group, has_bias = case
    rng = np.random.default_rng(seed)
    x = _round(rng.standard_normal(xs).astype(np.float32), dtype)
    w = _round(rng.standard_normal(ws).astype(np.float32) / np.sqrt(np.prod(ws[1:])), dtype)
    b = _round(rng.standard_normal(ws[0]).astype(np.float32), dtype) if has_bias else None
    return x, w, b


def _check(got, case, x, w, b, dtype):
    _, _, strides, pb, pe, dil, group, _ = case
    want = reference(x, w, b, strides, pb, pe, dil, group)
    bound = reference(np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64)),
                      None if b is None else np.abs(b.astype(np.float64)), strides, pb, pe, dil, group)
    assert got.shape == want.shape
    excess = np.abs(got - want) - RTOL[dtype] * bound
    assert np.all(np.isfinite(got)) and excess.max() <= 0, f"worst excess {excess.max():.3g}"


def _conv(case, dtype):
    from powerfusion.backends.cuda import cudnn_conv
    xs, ws, strides, pb, pe, dil, group, has_bias = case
    return cudnn_conv.build(cudnn_conv.ConvShape(xs, ws, has_bias, strides, pb, pe, dil, dtype), 0)


def _buffers(conv, x, w, b):
    import cupy
    out = cupy.full(conv.shape.out, 0xFFFF if conv.shape.dtype != "float32" else np.nan,
                    dtype=np.float32 if conv.shape.dtype == "float32" else np.uint16)   # NaN bits everywhere
    if conv.shape.dtype == "float16":
        out = out.view(np.float16)
    ws = cupy.empty(max(conv.workspace_bytes, 1), dtype=np.uint8)
    return _device(x), _device(w), None if b is None else _device(b), out, ws


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_matches_float64_reference(cudnn_module, name, dtype):
    import cupy
    case = CASES[name]
    x, w, b = _inputs(case, dtype)
    conv = _conv(case, dtype)
    dx, dw, db, out, ws = _buffers(conv, x, w, b)
    conv.bind(cupy.cuda.get_current_stream().ptr)
    conv(dx, dw, db, out, ws)
    _check(_host(out, dtype), case, x, w, b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["3x3", "depthwise_s2", "1d", "3d"])
def test_unfused_bias_kernel_matches_reference(cudnn_module, name, dtype):
    """The conv alone, then our bias kernel (the variant kept where it is faster than cuDNN's
    fused conv + bias), whichever variant `build` kept."""
    import cupy
    from powerfusion.backends.cuda import cudnn_conv
    case = CASES[name]
    x, w, b = _inputs(case, dtype)
    conv = _conv(case, dtype)
    variant = cudnn_conv._Variant(conv, False)
    dx, dw, db, out, _ = _buffers(conv, x, w, b)
    ws = cupy.empty(max(variant.workspace(variant.index), 1), dtype=np.uint8)
    conv.bind(cupy.cuda.get_current_stream().ptr)
    variant.execute(variant.index, dx, dw, db, out, ws)
    _check(_host(out, dtype), case, x, w, b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["3x3", "grouped", "1d", "3d_strided_grouped"])
def test_conv_inside_cuda_graph_capture(cudnn_module, name, dtype):
    """Captured once, replayed on new inputs written into the same buffers."""
    import cupy
    case = CASES[name]
    conv = _conv(case, dtype)
    x, w, b = _inputs(case, dtype, seed=1)
    dx, dw, db, out, ws = _buffers(conv, x, w, b)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        conv.bind(stream.ptr)
        stream.begin_capture()
        conv(dx, dw, db, out, ws)
        graph = stream.end_capture()
    x2, _, _ = _inputs(case, dtype, seed=2)
    dx[...] = _device(x2)
    graph.launch(stream)
    stream.synchronize()
    _check(_host(out, dtype), case, x2, w, b, dtype)


def test_graphs_are_cached_per_shape(cudnn_module):
    assert _conv(CASES["3x3"], "float16") is _conv(CASES["3x3"], "float16")
    assert _conv(CASES["3x3"], "float16") is not _conv(CASES["3x3"], "float32")


def _conv_relu_model(dtype):
    from onnx import TensorProto, helper, numpy_helper
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((64, 32, 3, 3)) / 17).astype(dtype), "w")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(dtype), "b")
    w2 = numpy_helper.from_array((rng.standard_normal((32, 64, 1, 1)) / 8).astype(dtype), "w2")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv3x3"),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv1x1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [2, 32, 28, 28])],
                              [helper.make_tensor_value_info("y", elem, [2, 32, 14, 14])], [w, b, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), (w, b, w2)


def test_plans_are_timed_and_the_fastest_kept(cudnn_module):
    conv = _conv(CASES["3x3"], "float16")
    assert conv.index in conv.plans and set(conv.times_us) == set(conv.plans)
    assert conv.time_us == min(conv.times_us.values()) > 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("route", ["cudnn", "fastest"])
def test_session_runs_convs_in_its_cuda_graph(cudnn_module, dtype, route, monkeypatch):
    """route "cudnn": the im2col comparison switched off, so both convs run through cuDNN;
    "fastest": as a session builds by default, each conv on its faster route, named in conv_routes."""
    import powerfusion
    from onnx import numpy_helper
    from powerfusion.backends.cuda.session import CudaPlanRunner
    if route == "cudnn":
        monkeypatch.setattr(CudaPlanRunner, "_prefer_faster_conv", lambda self, node, conv: None)
    model, (w, b, w2) = _conv_relu_model(dtype)
    x = np.random.default_rng(4).standard_normal((2, 32, 28, 28)).astype(dtype)
    with powerfusion.options.context(cuda_graph=True):
        sess = powerfusion.InferenceSession(model.SerializeToString(), target="cuda")
        [y] = sess.run(None, {"x": x})
        [y2] = sess.run(None, {"x": x[::-1].copy()})   # a replay on other inputs
    runner = sess._executor
    assert sess.fallbacks == {}
    if route == "cudnn":
        assert len(runner.convs) == 2
    else:
        assert len(runner.conv_routes) == 2
        assert all(("cuDNN" in r) if n in runner.convs else r.startswith("im2col") for n, r in runner.conv_routes.items())
    assert runner._cuda_graph and all(kind == "graph" for kind, _ in runner._cuda_graph)
    W, B, W2 = (numpy_helper.to_array(t) for t in (w, b, w2))
    for inp, got in ((x, y), (x[::-1].copy(), y2)):
        r = np.maximum(reference(inp, W, B, (2, 2), (1, 1), (1, 1), (1, 1), 1), 0)
        want = reference(r, W2, None, (1, 1), (0, 0), (0, 0), (1, 1), 1)
        tol = {"float32": 1e-4, "float16": 2e-2}[dtype]   # two layers, fp16 intermediate rounding
        assert np.abs(got.astype(np.float64) - want).max() <= tol * max(1.0, np.abs(want).max())
