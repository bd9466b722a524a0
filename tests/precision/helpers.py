"""Small models and runners shared by the precision tests."""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS = os.path.join(ROOT, "models", "digits")


def digits(name: str) -> onnx.ModelProto:
    return onnx.load(os.path.join(DIGITS, f"{name}.onnx"))


def digits_data():
    return np.load(os.path.join(DIGITS, "digits_data.npz"))


def ort_run(model: onnx.ModelProto, feeds: dict, optimize: bool = True) -> list[np.ndarray]:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so).run(None, feeds)


def mlp(k: int = 16, n: int = 32, m: int = 4, opset: int = 17, seed: int = 0) -> onnx.ModelProto:
    """x[m, k] -> MatMul -> Add -> Relu -> MatMul -> Softmax."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32) * 0.1, "b1"),
             numpy_helper.from_array(rng.standard_normal((n, 10)).astype(np.float32) * 0.3, "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["z"], name="mm2"),
             helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=-1)]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
