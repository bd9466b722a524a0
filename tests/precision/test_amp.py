"""AMP rewrite: before / expected graphs, cast elimination, overrides, the cost rule, and
numbers against onnxruntime (fp16) or the fp32 model (bf16, which onnxruntime's CPU lacks).

Tolerances, relative to the output's max |value|: fp16 2e-2, bf16 5e-2 (one rounding of each
16-bit intermediate: 2**-11 and 2**-8 relative, accumulated over a few layers)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from powerfusion.precision import AmpConfig, AmpReport, convert_precision
from powerfusion.precision.casts import eliminate_casts
from powerfusion.session import InferenceSession

from .helpers import digits, digits_data, mlp, ort_run, rel_error

FP16_TOL, BF16_TOL = 2e-2, 5e-2


def _types(model):
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    t = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output) + list(g.input)}
    t.update({i.name: i.data_type for i in g.initializer})
    return {n.name: t[n.output[0]] for n in g.node}, g


BIG = dict(k=1024, n=1024, m=512)   # large enough that the first GEMM pays for its input's cast


def test_mlp_before_expected():
    before = mlp(**BIG)
    report = AmpReport()
    after = convert_precision(before, "fp16", report)
    node_types, g = _types(after)
    expected = {"mm1": TensorProto.FLOAT16, "add": TensorProto.FLOAT16, "relu": TensorProto.FLOAT16,
                "mm2": TensorProto.FLOAT16, "softmax": TensorProto.FLOAT}
    got = {k: v for k, v in node_types.items() if k in expected}
    assert got == expected, (onnx.printer.to_text(before.graph), onnx.printer.to_text(after.graph))
    casts = [n for n in g.node if n.op_type == "Cast"]
    # one down-cast of the graph input, one up-cast in front of Softmax; the rest cancelled
    assert len(casts) == 2 and report.casts_eliminated == report.casts_inserted - 2
    assert [i.name for i in g.input] == ["x"] and g.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    onnx.checker.check_model(after)


def test_overrides_move_ops_between_lists():
    after = convert_precision(mlp(**BIG), AmpConfig().with_ops(keep=frozenset({"Relu"})))
    node_types, _ = _types(after)
    assert node_types["relu"] == TensorProto.FLOAT and node_types["mm2"] == TensorProto.FLOAT16
    after = convert_precision(mlp(**BIG), AmpConfig().with_ops(low=frozenset({"Softmax"})))
    assert _types(after)[0]["softmax"] == TensorProto.FLOAT16


def test_cost_rule_declines_a_cast_that_costs_more_than_it_saves():
    report = AmpReport()
    tiny = mlp(k=4, n=4, m=1)      # a 1x4x4 GEMM on a graph input: the cast's launch outweighs it
    convert_precision(tiny, "fp16", report)
    assert "mm1" in report.declined
    report = AmpReport()
    convert_precision(mlp(**BIG), "fp16", report)
    assert "mm1" in report.converted


def test_bf16_conv_needs_opset_22():
    report = AmpReport()
    convert_precision(digits("digits_cnn"), "bf16", report)     # opset 17: Conv has no bf16 kernel
    assert any("Conv" in n for n in report.declined) and any("Gemm" in n for n in report.converted)


def _cast(x, y, to):
    return helper.make_node("Cast", [x], [y], to=to)


@pytest.mark.parametrize("first,second,cancels", [(TensorProto.FLOAT, TensorProto.FLOAT16, True),
                                                  (TensorProto.FLOAT16, TensorProto.FLOAT, False)])
def test_cast_elimination(first, second, cancels):
    """x -> Cast(first) -> Cast(second) -> Relu with x of type `second`: cancels only if lossless."""
    g = helper.make_graph([_cast("x", "a", first), _cast("a", "b", second), helper.make_node("Relu", ["b"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", second, [4])],
                          [helper.make_tensor_value_info("y", second, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    removed = eliminate_casts(m)
    relu = next(n for n in m.graph.node if n.op_type == "Relu")
    assert (removed == 2 and relu.input[0] == "x") if cancels else (removed == 0 and relu.input[0] == "b")


@pytest.mark.parametrize("name", ["digits_cnn", "digits_transformer"])
def test_fp16_session_matches_onnxruntime_on_converted_model(name):
    x = digits_data()["x_test"][:32]
    converted = convert_precision(digits(name), "fp16")
    ref = ort_run(converted, {"image": x})[0]
    ours = InferenceSession(digits(name), shapes={"image": x.shape}, options={"precision": "fp16"}).run(None, {"image": x})[0]
    assert ours.dtype == np.float32 and rel_error(ours, ref) < FP16_TOL


def test_bf16_session_close_to_fp32():
    x = digits_data()["x_test"][:32]
    ref = ort_run(digits("digits_transformer"), {"image": x})[0]
    ours = InferenceSession(digits("digits_transformer"), shapes={"image": x.shape},
                            options={"precision": "bf16"}).run(None, {"image": x})[0]
    assert 0 < rel_error(ours, ref) < BF16_TOL      # > 0: the rewrite really ran in bf16


def test_unknown_precision_is_an_error():
    from powerfusion.errors import PowerFusionError
    with pytest.raises(PowerFusionError, match="unknown precision"):
        InferenceSession(mlp(), options={"precision": "fp8"})
