"""Dtypes other than float32. fp16/bf16 models are compared with onnxruntime on the float32
version of the same model fed the same (rounded) values; tolerances in fe_helpers.TOL."""
import ml_dtypes
import numpy as np
import pytest

from tests.frontend.fe_helpers import check, make_model, run_ort
from powerfusion.frontend import import_model

R = np.random.default_rng(1)
BF16 = np.dtype(ml_dtypes.bfloat16)


def f(*s):
    return R.standard_normal(s).astype(np.float32)


# bfloat16 Conv, MaxPool and InstanceNormalization exist from opset 22 on
LOW = [
    ("Add", {"a": f(2, 3), "b": f(3)}, {}, {}, 17),
    ("Div", {"a": f(8, 64), "b": np.abs(f(8, 1)) + 0.5}, {}, {}, 17),   # a reciprocal per row, in fp32
    ("Relu", {"x": f(4, 5)}, {}, {}, 17),
    ("Softmax", {"x": f(3, 16) * 4}, {}, {}, 17),
    ("LayerNormalization", {"x": f(2, 4, 32)}, {"s": f(32), "b": f(32)}, {}, 17),
    ("LayerNormalization", {"x": f(2, 32768) + 3}, {"s": f(32768), "b": f(32768)}, {}, 17),   # a long row
    ("ReduceMean", {"x": f(4, 64)}, {"axes": np.array([1], np.int64)}, {}, 18),
    ("Gelu", {"x": f(4, 8)}, {}, {}, 20),
    ("MatMul", {"a": f(4, 16), "b": f(16, 8)}, {}, {}, 17),
    ("Conv", {"x": f(1, 3, 6, 6)}, {"w": f(4, 3, 3, 3)}, {"pads": [1, 1, 1, 1]}, 22),
    ("MaxPool", {"x": f(1, 2, 6, 6)}, {}, {"kernel_shape": [2, 2], "strides": [2, 2]}, 22),
    ("InstanceNormalization", {"x": f(2, 3, 4, 4)}, {"s": f(3), "b": f(3)}, {}, 22),
]


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op,feeds,consts,attrs,opset", LOW, ids=[c[0] for c in LOW])
def test_low_precision_against_fp32_reference(dtype, op, feeds, consts, attrs, opset):
    low = {k: v.astype(dtype) for k, v in feeds.items()}
    low_c = {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in consts.items()}
    ref = run_ort(make_model(op, {k: v.astype(np.float32) for k, v in low.items()},
                             {k: v.astype(np.float32) if v.dtype == dtype else v for k, v in low_c.items()},
                             attrs, opset=opset), {k: v.astype(np.float32) for k, v in low.items()})
    model = make_model(op, low, low_c, attrs, opset=opset)
    graph = check(model, low, reference=ref)
    assert graph.outputs[0].dtype == dtype
    if op in ("Softmax", "LayerNormalization", "InstanceNormalization"):  # computed in fp32 between casts
        assert any(n.kind == "elementwise" and n.op.fn == "cast" and n.op.param("to") == np.float32
                   for n in graph.nodes)


EXACT = [
    ("Add", {"a": np.arange(-6, 6, dtype=np.int8).reshape(3, 4), "b": np.arange(4, dtype=np.int8)}),
    ("Mul", {"a": np.arange(12, dtype=np.int64).reshape(3, 4), "b": np.arange(4, dtype=np.int64)}),
    ("Sub", {"a": np.arange(12, dtype=np.int32).reshape(3, 4), "b": np.arange(4, dtype=np.int32)}),
    ("Max", {"a": np.arange(12, dtype=np.uint8).reshape(3, 4), "b": np.full(4, 5, np.uint8)}),
    ("Equal", {"a": np.arange(12, dtype=np.int64).reshape(3, 4) % 3, "b": np.arange(4, dtype=np.int64) % 3}),
    ("Add", {"a": R.standard_normal((3, 4)), "b": R.standard_normal(4)}),
    ("Exp", {"x": R.standard_normal((3, 4))}),
    ("Transpose", {"x": np.arange(24, dtype=np.uint8).reshape(2, 3, 4)}),
    ("Concat", {"a": np.ones((2, 2), np.int8), "b": np.zeros((2, 1), np.int8)}),
]


@pytest.mark.parametrize("op,feeds", EXACT, ids=[f"{c[0]}-{next(iter(c[1].values())).dtype}" for c in EXACT])
def test_integer_bool_float64(op, feeds):
    attrs = {"axis": 1} if op == "Concat" else {}
    check(make_model(op, feeds, attrs=attrs), feeds)


def test_maxpool_int8_pads_with_lowest_value():
    x = (np.arange(-20, 16, dtype=np.int8)).reshape(1, 1, 6, 6)
    check(make_model("MaxPool", {"x": x}, attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, opset=12), {"x": x})


def test_unsupported_dtype_is_listed():
    from powerfusion.errors import UnsupportedOpError
    x = np.ones((2, 2), np.uint16)
    with pytest.raises(UnsupportedOpError, match="uint16"):
        import_model(make_model("Identity", {"x": x}))
