"""Small ONNX models for the visualiser tests (built in memory with onnx.helper)."""
from __future__ import annotations

from onnx import TensorProto as T
from onnx import helper as h


def channel_shuffle(c: int = 16, hw: int = 8):
    """ShuffleNet's channel shuffle: concat -> reshape -> transpose -> reshape -> split."""
    nodes = [
        h.make_node("Concat", ["a", "b"], ["cat"], axis=1, name="concat"),
        h.make_node("Reshape", ["cat", "s1"], ["r1"], name="reshape1"),
        h.make_node("Transpose", ["r1"], ["tr"], perm=[0, 2, 1, 3, 4], name="transpose"),
        h.make_node("Reshape", ["tr", "s2"], ["r2"], name="reshape2"),
        h.make_node("Split", ["r2", "sp"], ["y1", "y2"], axis=1, name="split"),
    ]
    inits = [h.make_tensor("s1", T.INT64, [5], [1, 2, c, hw, hw]),
             h.make_tensor("s2", T.INT64, [4], [1, 2 * c, hw, hw]),
             h.make_tensor("sp", T.INT64, [2], [c, c])]
    io = lambda n: h.make_tensor_value_info(n, T.FLOAT, [1, c, hw, hw])
    g = h.make_graph(nodes, "shuffle", [io("a"), io("b")], [io("y1"), io("y2")], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def relu_add(n: int = 1024, name: str = "relu</script><b>add"):
    """Relu then Add (docs/design.md's first worked example); a node name that would break naive HTML."""
    nodes = [h.make_node("Relu", ["x"], ["t"], name=name),
             h.make_node("Add", ["t", "z"], ["y"], name="add")]
    io = lambda s: h.make_tensor_value_info(s, T.FLOAT, [n])
    g = h.make_graph(nodes, "relu_add", [io("x"), io("z")], [io("y")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def matmul_relu(m: int = 256, k: int = 256, n: int = 256):
    """A compute-bound MatMul (a library call) between two memory-bound ops."""
    import numpy as np
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    nodes = [h.make_node("Relu", ["x"], ["xr"], name="relu_in"),
             h.make_node("MatMul", ["xr", "w"], ["mm"], name="matmul"),
             h.make_node("Sigmoid", ["mm"], ["y"], name="sigmoid_out")]
    g = h.make_graph(nodes, "mm", [h.make_tensor_value_info("x", T.FLOAT, [m, k])],
                     [h.make_tensor_value_info("y", T.FLOAT, [m, n])],
                     [h.make_tensor("w", T.FLOAT, [k, n], w.ravel().tolist())])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])

