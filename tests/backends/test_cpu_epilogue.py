"""Activations applied by the cpu driver's convolutions (backends/cpu/epilogue.py): a Conv
followed by a subgraph that only applies ReLU, Clip, HardSigmoid, HardSwish, Sigmoid or SiLU
to its output applies it itself, on every convolution path of driver.h (1x1 GEMM, tiled and
whole-plane im2col, channel-blocked depthwise, direct), and the result matches onnxruntime
within 1e-5 of the convolution's largest output magnitude (summation order, and the inline
float32 exp within 2 ulp). Where the convolution's output is read elsewhere too, or is a
model output, the subgraph runs as before.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from powerfusion import InferenceSession

TOL = 1e-5

ACTIVATIONS = {
    "relu": lambda y, z: [helper.make_node("Relu", [y], [z])],
    "relu6": lambda y, z: [helper.make_node("Clip", [y, "lo", "hi"], [z])],
    "hardsigmoid": lambda y, z: [helper.make_node("HardSigmoid", [y], [z], alpha=0.25, beta=0.4)],
    "hardswish": lambda y, z: [helper.make_node("HardSwish", [y], [z])],
    "sigmoid": lambda y, z: [helper.make_node("Sigmoid", [y], [z])],
    "silu": lambda y, z: [helper.make_node("Sigmoid", [y], ["s"]), helper.make_node("Mul", [y, "s"], [z])],
}
CONVS = {   # x shape, w shape, stride, pad, group: each takes a different path of driver.h
    "pointwise": ((1, 16, 9, 9), (24, 16, 1, 1), 1, 0, 1),
    "im2col_tiled": ((1, 16, 64, 64), (16, 16, 3, 3), 1, 1, 1),
    "im2col_plane": ((1, 8, 12, 12), (32, 8, 3, 3), 2, 1, 1),
    "depthwise": ((1, 20, 15, 15), (20, 1, 5, 5), 2, 2, 20),
    "direct": ((1, 6, 10, 10), (6, 2, 3, 3), 1, 1, 3),
}


def model(conv: str, act: str, extra_use: bool = False, conv_is_output: bool = False) -> onnx.ModelProto:
    x_shape, w_shape, stride, pad, group = CONVS[conv]
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(w_shape[0]).astype(np.float32), "B"),
             numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(1.5, np.float32), "hi")]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["y"], strides=[stride] * 2, pads=[pad] * 4, group=group),
             *ACTIVATIONS[act]("y", "z")]
    side = (x_shape[2] + 2 * pad - w_shape[2]) // stride + 1
    out_shape = [1, w_shape[0], side, side]
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, out_shape)]
    if extra_use:   # the convolution's output is read by a second consumer
        nodes.append(helper.make_node("Neg", ["y"], ["n"]))
        outputs.append(helper.make_tensor_value_info("n", TensorProto.FLOAT, out_shape))
    if conv_is_output:
        outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape))
    graph = helper.make_graph(nodes, "conv_act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def fused_steps(sess: InferenceSession) -> list[str]:
    return [line for d in sess.cpu_plan.pieces if hasattr(d, "names")
            for line in d.source_lines if "applied by the convolution" in line]


def check(m: onnx.ModelProto) -> InferenceSession:
    """Run `m` here and in onnxruntime; the error is measured against the largest magnitude of
    the convolution's output (its summation order is what differs; a clip can make the
    activation's own output much smaller than that)."""
    import onnxruntime as ort
    sess = InferenceSession(m)
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32) * 2
    x.flat[::97] = np.nan   # NaN passes through every activation, as in onnxruntime
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    if "y" not in [o.name for o in probe.graph.output]:
        probe.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    ref = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    *want, y = ref.run(None, {"x": x})
    want = want[:len(m.graph.output)]
    got = sess.run(None, {"x": x})
    scale = max(float(np.nanmax(np.abs(y))), 1.0)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        err = float(np.nanmax(np.abs(g.astype(np.float64) - w))) / scale
        assert err < TOL, f"output {k}: error {err:.2e} of the convolution's {scale:.2e}"
    return sess


@pytest.mark.parametrize("conv", sorted(CONVS))
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_convolution_applies_the_activation(conv, act):
    sess = check(model(conv, act))
    assert len(fused_steps(sess)) == 1, "the activation subgraph should be applied by the convolution"


@pytest.mark.parametrize("extra_use,conv_is_output", [(True, False), (False, True)])
def test_activation_stays_apart_when_the_conv_output_is_needed(extra_use, conv_is_output):
    sess = check(model("depthwise", "hardswish", extra_use, conv_is_output))
    assert not fused_steps(sess)
