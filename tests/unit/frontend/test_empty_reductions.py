"""Reductions over an empty set become constants (frontend/empty_reductions.py): the reduction's
identity, as ONNX defines it, on every target (CUDA refused such a model before: its kernels do
not read zero-size tensors)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

from powerfusion.frontend.empty_reductions import identity


def _model(op: str, elem: int, extra=()):
    axes = h.make_tensor("axes", T.INT64, [1], [1])
    nodes = [h.make_node(op, ["x", "axes"], ["r"], keepdims=1), *extra]
    out = "y" if extra else "r"
    g = h.make_graph(nodes, "empty", [h.make_tensor_value_info("x", elem, [2, 0, 4])],
                     [h.make_tensor_value_info(out, elem, [2, 1, 4])], [axes])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18)])


@pytest.mark.parametrize("fn,dtype,want", [
    ("sum", np.float32, 0.0), ("prod", np.float32, 1.0), ("max", np.float32, -np.inf), ("min", np.float16, np.inf),
    ("max", np.int32, np.iinfo(np.int32).min), ("min", np.uint8, 255), ("max", np.bool_, False)])
def test_identity_values(fn, dtype, want):
    v = identity(fn, np.dtype(dtype))
    assert v.dtype == np.dtype(dtype) and v == want


def test_float8_without_infinity_takes_its_lowest_finite_value():
    import ml_dtypes
    v = identity("max", np.dtype(ml_dtypes.float8_e4m3fn))
    assert float(v) == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).min)


@pytest.mark.parametrize("op,elem,npdt,want", [
    ("ReduceMax", T.FLOAT, np.float32, -np.inf), ("ReduceMin", T.INT32, np.int32, np.iinfo(np.int32).max),
    ("ReduceSum", T.FLOAT, np.float32, 0.0), ("ReduceProd", T.INT64, np.int64, 1)])
def test_empty_reduction_runs_on_cpu_and_compiles_for_cuda(op, elem, npdt, want):
    import powerfusion
    from powerfusion.compiler import compile_model
    model = _model(op, elem)
    compile_model(model, "cuda")   # refused before: "kernels over zero-size tensors are not generated"
    got = powerfusion.InferenceSession(model.SerializeToString(), target="cpu").run(None, {"x": np.zeros((2, 0, 4), npdt)})[0]
    np.testing.assert_array_equal(got, np.full((2, 1, 4), want, npdt))


def test_ops_after_an_empty_reduction_read_its_constant():
    import powerfusion
    from powerfusion.compiler import compile_model
    model = _model("ReduceSum", T.FLOAT, [h.make_node("Log", ["r"], ["y"])])   # ReduceLogSum's body
    assert compile_model(model, "cuda").kernel_steps
    got = powerfusion.InferenceSession(model.SerializeToString(), target="cpu").run(None, {"x": np.zeros((2, 0, 4), np.float32)})[0]
    np.testing.assert_array_equal(got, np.full((2, 1, 4), -np.inf, np.float32))
