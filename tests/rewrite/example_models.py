"""Small ONNX models of docs/design.md's worked examples, built with onnx.helper (float32, batch 1)."""
import numpy as np
from onnx import helper as h, TensorProto as TP, numpy_helper as nh

def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, TP.FLOAT, s) for n, s in inputs],
                     [h.make_tensor_value_info(n, TP.FLOAT, s) for n, s in outputs], list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m

def channel_shuffle(C=8, H=4, W=4):
    shape = [1, C, H, W]
    nodes = [h.make_node("Concat", ["a", "b"], ["c"], axis=1),
             h.make_node("Reshape", ["c", "s1"], ["r1"]),
             h.make_node("Transpose", ["r1"], ["t"], perm=[0, 2, 1, 3, 4]),
             h.make_node("Reshape", ["t", "s2"], ["r2"]),
             h.make_node("Split", ["r2", "sp"], ["o1", "o2"], axis=1)]
    inits = [nh.from_array(np.array([1, 2, C, H, W], np.int64), "s1"), nh.from_array(np.array([1, 2 * C, H, W], np.int64), "s2"),
             nh.from_array(np.array([C, C], np.int64), "sp")]
    return _model(nodes, [("a", shape), ("b", shape)], [("o1", shape), ("o2", shape)], inits)

def residual_layernorm(R=8, D=64):
    nodes = [h.make_node("Add", ["x", "r"], ["s"]),
             h.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal(D).astype(np.float32), "g"), nh.from_array(rng.standard_normal(D).astype(np.float32), "b")]
    return _model(nodes, [("x", [R, D]), ("r", [R, D])], [("y", [R, D])], inits)

def scale_mask_softmax(H=2, S=16):
    nodes = [h.make_node("Mul", ["x", "scale"], ["xs"]), h.make_node("Add", ["xs", "mask"], ["xm"]),
             h.make_node("Softmax", ["xm"], ["y"], axis=-1)]
    inits = [nh.from_array(np.array(0.125, np.float32), "scale")]
    return _model(nodes, [("x", [H, S, S]), ("mask", [1, S, S])], [("y", [H, S, S])], inits)

def decode_attention(Hd=2, S=32, D=16):
    nodes = [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             h.make_node("MatMul", ["q", "kt"], ["sc"]), h.make_node("Mul", ["sc", "scale"], ["ss"]),
             h.make_node("Softmax", ["ss"], ["p"], axis=-1), h.make_node("MatMul", ["p", "v"], ["o"])]
    inits = [nh.from_array(np.array(1 / np.sqrt(D), np.float32), "scale")]
    return _model(nodes, [("q", [Hd, 1, D]), ("k", [Hd, S, D]), ("v", [Hd, S, D])], [("o", [Hd, 1, D])], inits)
