"""Integer and bool reductions accumulate in 64-bit integers in emitted C (a float
accumulator rounds int sums above 2^24 and turns an empty max's -inf into true)."""
import pytest
from onnx import TensorProto, helper

from powerfusion.compiler import compile_model


def _reduce(op, dtype, opset=18):
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    n = helper.make_node(op, ["x", "axes"], ["y"], keepdims=0)
    g = helper.make_graph([n], "g", [helper.make_tensor_value_info("x", dtype, [64, 300])],
                          [helper.make_tensor_value_info("y", dtype, [64])], [axes])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("op,dtype", [("ReduceSum", TensorProto.INT64), ("ReduceMax", TensorProto.INT32),
                                      ("ReduceSum", TensorProto.FLOAT)])
def test_accumulator_type_follows_the_result(op, dtype):
    plan = compile_model(_reduce(op, dtype), "cuda")
    src = "\n".join(k.source for s in plan.kernel_steps for k in s.kernels)
    if dtype == TensorProto.FLOAT:
        assert "float acc" in src and "long long acc" not in src
    else:
        assert "long long acc" in src and "float acc" not in src


@pytest.mark.parametrize("op,dtype", [("ReduceMax", TensorProto.INT32), ("ReduceMin", TensorProto.UINT8),
                                      ("ReduceMax", TensorProto.FLOAT)])
def test_warp_shuffles_run_on_every_lane(op, dtype):
    """An integer max is `a > b ? a : b`: a shuffle written as b would run only on the lanes
    taking that branch (a full-mask shuffle on some lanes: wrong maxima on the GPU)."""
    import re
    plan = compile_model(_reduce(op, dtype), "cuda")
    src = "\n".join(k.source for s in plan.kernel_steps for k in s.kernels)
    shuffles = re.findall(r"[^\n]*__shfl_xor_sync[^\n]*", src)
    assert shuffles
    for line in shuffles:
        assert re.match(r"\s*\{ const [\w ]+ o = __shfl_xor_sync\([^;]*\); acc = ", line), line


@pytest.mark.parametrize("op,identity", [("ReduceMax", "0LL"), ("ReduceMin", "1LL")])
def test_bool_max_min_start_from_false_true(op, identity):
    """A bool max starts from false (the int64 minimum cast to bool is true); a min from true."""
    plan = compile_model(_reduce(op, TensorProto.BOOL, opset=20), "cuda")   # bool max/min: opset 20
    src = "\n".join(k.source for s in plan.kernel_steps for k in s.kernels)
    assert f"long long acc = {identity};" in src
