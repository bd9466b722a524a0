"""Swin-T's shifted-window tail as a small ONNX model: the attention projection's bias add, the
window reverse (reshape, transpose, reshape), the roll back by the shift (slices + concat on two
axes), the residual add and LayerNorm. On CUDA the search composes the roll's moves into the add
that reads it: two masked moves fill one register tile, and the renderer once let the second
overwrite the first's rows with zeros (9.9e-2 relative error on swin_t). Checked against
onnxruntime on the CPU target and, with a GPU, on CUDA; tolerance max |diff| / max |ref| < 1e-4
(float32; LayerNorm sums in another order than onnxruntime)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

SIDE, WINDOW, SHIFT, CHANNELS = 14, 7, 3, 384


def shifted_window_tail() -> onnx.ModelProto:
    windows = (SIDE // WINDOW) ** 2
    tokens = WINDOW * WINDOW
    rng = np.random.default_rng(0)
    consts = {
        "bias": rng.standard_normal(CHANNELS).astype(np.float32),
        "gamma": (1 + 0.1 * rng.standard_normal(CHANNELS)).astype(np.float32),
        "beta": (0.1 * rng.standard_normal(CHANNELS)).astype(np.float32),
        "win_shape": np.array([1, SIDE // WINDOW, SIDE // WINDOW, WINDOW, WINDOW, CHANNELS], np.int64),
        "map_shape": np.array([1, SIDE, SIDE, CHANNELS], np.int64),
    }
    nodes = [helper.make_node("Add", ["proj", "bias"], ["biased"]),
             helper.make_node("Reshape", ["biased", "win_shape"], ["win"]),
             helper.make_node("Transpose", ["win"], ["win_t"], perm=[0, 1, 3, 2, 4, 5]),
             helper.make_node("Reshape", ["win_t", "map_shape"], ["shifted"])]
    prev = "shifted"
    for axis in (1, 2):   # torch.roll(x, SHIFT, axis): the last SHIFT rows first
        for name, lo, hi in (("tail", SIDE - SHIFT, SIDE), ("head", 0, SIDE - SHIFT)):
            for k, v in ((f"{name}{axis}_lo", lo), (f"{name}{axis}_hi", hi), (f"ax{axis}", axis)):
                consts[k] = np.array([v], np.int64)
            nodes.append(helper.make_node("Slice", [prev, f"{name}{axis}_lo", f"{name}{axis}_hi", f"ax{axis}"],
                                          [f"{name}{axis}"]))
        nodes.append(helper.make_node("Concat", [f"tail{axis}", f"head{axis}"], [f"rolled{axis}"], axis=axis))
        prev = f"rolled{axis}"
    nodes += [helper.make_node("Add", ["residual", prev], ["summed"]),
              helper.make_node("LayerNormalization", ["summed", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(
        nodes, "shifted_window_tail",
        [helper.make_tensor_value_info("proj", TensorProto.FLOAT, [windows, tokens, CHANNELS]),
         helper.make_tensor_value_info("residual", TensorProto.FLOAT, [1, SIDE, SIDE, CHANNELS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SIDE, SIDE, CHANNELS])],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    # IR version 8 (opset 17 needs no newer): onnxruntime releases older than the installed onnx read it
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds() -> dict:
    rng = np.random.default_rng(1)
    windows = (SIDE // WINDOW) ** 2
    return {"proj": rng.standard_normal((windows, WINDOW * WINDOW, CHANNELS)).astype(np.float32),
            "residual": rng.standard_normal((1, SIDE, SIDE, CHANNELS)).astype(np.float32)}


def _check(target: str) -> None:
    import onnxruntime as ort
    from powerfusion import InferenceSession
    model, feeds = shifted_window_tail(), _feeds()
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = InferenceSession(model, target=target).run(None, feeds)[0]
    err = float(np.max(np.abs(got.astype(np.float64) - want))) / float(np.max(np.abs(want)))
    assert err < 1e-4, f"{target}: relative error {err:.2e}"


def test_cpu_matches_onnxruntime():
    pytest.importorskip("onnxruntime")
    _check("cpu")


@pytest.mark.gpu
def test_cuda_matches_onnxruntime():
    pytest.importorskip("onnxruntime")
    _check("cuda")
