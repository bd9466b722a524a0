"""Conv routing (powerfusion.backends.cuda.cudnn_conv) without a GPU: where the cuDNN frontend
does not import, every Conv is routed to im2col + cuBLAS once, with the reason, and shapes
cuDNN is not asked for are named."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from powerfusion.backends.cuda import cudnn_conv
from powerfusion.basic import Conv
from powerfusion.frontend import import_model


def _conv_model(x_shape, w_shape, y_shape, **attrs):
    w = numpy_helper.from_array(np.ones(w_shape, np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _conv_nodes(graph):
    return [n for n in graph.nodes if isinstance(n.op, Conv)]


@pytest.fixture
def no_cudnn(monkeypatch):
    """A process where `import cudnn` fails (None in sys.modules makes the import raise)."""
    monkeypatch.setitem(sys.modules, "cudnn", None)
    monkeypatch.setattr(cudnn_conv, "_preload_library", lambda: None)
    cudnn_conv.load.cache_clear()
    yield
    cudnn_conv.load.cache_clear()


def test_fallback_is_chosen_and_reported_without_the_frontend(no_cudnn):
    graph = import_model(_conv_model((1, 8, 16, 16), (16, 8, 3, 3), (1, 16, 16, 16), pads=[1, 1, 1, 1]))
    [node] = _conv_nodes(graph)
    module, why = cudnn_conv.load()
    assert module is None and "import of cudnn halted" in why
    routes, fallbacks = cudnn_conv.plan_convs(graph, [node])
    assert routes == {}
    assert fallbacks == {node.name: f"Conv through im2col + cuBLAS: {why}"}


def test_no_conv_means_no_probe(no_cudnn):
    assert cudnn_conv.plan_convs(None, []) == ({}, {})


def test_conv_shape_reads_the_node():
    graph = import_model(_conv_model((2, 4, 9, 11), (6, 2, 3, 1), (2, 6, 4, 12), strides=[2, 1], dilations=[1, 2],
                                     pads=[1, 0, 0, 1], group=2))
    [node] = _conv_nodes(graph)
    shape = cudnn_conv.conv_shape(graph, node)
    assert shape == cudnn_conv.ConvShape((2, 4, 9, 11), (6, 2, 3, 1), False, (2, 1), (1, 0), (0, 1), (1, 2), "float32")
    assert shape.out == (2, 6, 4, 12)


def test_one_d_is_two_d_of_height_one():
    s = cudnn_conv.ConvShape((2, 3, 50), (4, 3, 5), True, (2,), (2,), (1,), (3,), "float16")
    t = s.as_2d()
    assert t == cudnn_conv.ConvShape((2, 3, 1, 50), (4, 3, 1, 5), True, (1, 2), (0, 2), (0, 1), (1, 3), "float16")
    assert t.out == (2, 4, 1, s.out[2])


@pytest.mark.parametrize("shape,words", [
    (cudnn_conv.ConvShape((1, 2, 4, 4), (2, 2, 1, 1), False, (1, 1), (0, 0), (0, 0), (1, 1), "float64"), "dtype float64"),
    (cudnn_conv.ConvShape((1, 2, 4, 4, 4, 4), (2, 2, 1, 1, 1, 1), False, (1,) * 4, (0,) * 4, (0,) * 4, (1,) * 4,
                          "float32"), "4 spatial dimensions"),
    (cudnn_conv.ConvShape((1, 2, 2, 2), (2, 2, 3, 3), False, (1, 1), (0, 0), (0, 0), (1, 1), "float32"), "empty output"),
])
def test_shapes_cudnn_is_not_asked_for(shape, words):
    assert words in cudnn_conv.unsupported_reason(shape)


def test_supported_shape_has_no_reason():
    s = cudnn_conv.ConvShape((1, 2, 8), (4, 1, 3), True, (1,), (1,), (1,), (1,), "bfloat16")
    assert cudnn_conv.unsupported_reason(s) is None
