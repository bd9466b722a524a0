import numpy as np
import onnx
import pytest
from onnx import helper

from powerfusion.errors import ModelError, UnsupportedOpError
from powerfusion.frontend import import_model, load_model, parse_shapes

from tests.frontend.fe_helpers import make_model


def _relu_model(dims, opset=17):
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, dims)
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_malformed_bytes():
    with pytest.raises(ModelError, match="not a serialized ONNX model|onnx.checker"):
        load_model(b"\x00\x01 definitely not protobuf \xff\xfe")


def test_checker_failure_names_file(tmp_path):
    m = _relu_model([2])
    m.graph.node[0].input[0] = "missing"
    path = tmp_path / "bad.onnx"
    onnx.save(m, path)
    with pytest.raises(ModelError, match=r"bad\.onnx.*onnx\.checker"):
        load_model(path)


def test_missing_file():
    with pytest.raises(ModelError, match="does not exist"):
        load_model("no/such/model.onnx")


def test_dynamic_dim_without_shapes():
    with pytest.raises(ModelError) as e:
        load_model(_relu_model(["batch", 3]))
    msg = str(e.value)
    assert "'x'" in msg and "batch" in msg and "shapes={'x'" in msg and "--shapes x:" in msg


def test_dynamic_dim_with_shapes():
    m = load_model(_relu_model(["batch", 3]), shapes={"x": (4, 3)})
    dims = [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [4, 3]


def test_shapes_conflict_and_unknown_input():
    with pytest.raises(ModelError, match="static shape"):
        load_model(_relu_model([2, 3]), shapes={"x": (4, 3)})
    with pytest.raises(ModelError, match="unknown input"):
        load_model(_relu_model([2, 3]), shapes={"z": (4, 3)})


def test_caller_proto_untouched():
    m = _relu_model(["batch", 3])
    load_model(m, shapes={"x": (4, 3)})
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


@pytest.mark.parametrize("opset", [5, 6])
def test_opset_too_old(opset):
    with pytest.raises(ModelError, match=f"opset {opset}"):
        load_model(_relu_model([2], opset=opset))


def test_old_opset_is_upgraded():
    m = load_model(_relu_model([2], opset=9))
    assert m.opset_import[0].version == 11


def test_newer_opsets_accepted_only_when_ops_unchanged():
    x = np.ones((1, 1, 3, 3), np.float32)
    # opset 22 only added bfloat16 to Conv: accepted
    load_model(make_model("Conv", {"x": x}, {"w": np.ones((1, 1, 1, 1), np.float32)}, opset=22))
    # Cast gained round_mode at opset 24, which only float8e8m0 results read: accepted
    load_model(make_model("Cast", {"x": x}, attrs={"to": 10}, opset=24))
    # DequantizeLinear changed after opset 21 and is not read at its new definition: refused, naming it
    q = np.ones((2, 3), np.int8)
    with pytest.raises(ModelError, match=r"opset 24.*DequantizeLinear"):
        load_model(make_model("DequantizeLinear", {"q": q}, {"s": np.float32(0.5)}, opset=24))


def _two_input_model(dims_a, dims_b):
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, dims_a),
                           helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, dims_b)],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, dims_a)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_shared_symbols_bound_by_one_input():
    m = load_model(_two_input_model(["batch", "seq"], ["batch", "seq"]), {"a": (1, 64)})
    dims = [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in m.graph.input]
    assert dims == [[1, 64], [1, 64]]


def test_inconsistent_symbol_bindings_are_a_mismatch():
    with pytest.raises(ModelError, match=r"symbol 'seq' is 64 in a:1x64 but 32 in b:1x32"):
        load_model(_two_input_model(["batch", "seq"], ["batch", "seq"]), {"a": (1, 64), "b": (1, 32)})


def test_parse_shapes():
    assert parse_shapes("x:1x3x224x224,y:4") == {"x": (1, 3, 224, 224), "y": (4,)}
    assert parse_shapes("a:b:2x2") == {"a:b": (2, 2)}
    assert parse_shapes("s:") == {"s": ()}
    with pytest.raises(ModelError):
        parse_shapes("x=1x3")
    with pytest.raises(ModelError):
        parse_shapes("x:1xAx3")


def test_unsupported_ops_all_listed():
    x = np.ones((2, 3), np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok"),
             helper.make_node("RandomUniformLike", ["a"], ["b"], name="first_bad"),
             helper.make_node("Pad", ["b", "pads"], ["c"], name="wrap_pad", mode="wrap"),
             helper.make_node("Relu", ["c"], ["d"], name="custom", domain="com.example"),
             helper.make_node("RandomNormalLike", ["d"], ["y"], name="second_bad")]
    m = make_model(None, {"x": x}, consts={"pads": np.array([0, 1, 0, 1], np.int64)}, nodes=nodes, opset=19,
                   domains=("com.example",))
    with pytest.raises(UnsupportedOpError) as e:
        import_model(m)
    names = [n for n, *_ in e.value.nodes]
    assert names == ["first_bad", "wrap_pad", "custom", "second_bad"]
    msg = str(e.value)
    assert "RandomUniformLike" in msg and "opset 19" in msg and "'wrap'" in msg and "com.example" in msg and "(2, 3)" in msg


def test_old_opset_with_large_weights_upgrades_and_runs():
    """Opset 9 Slice (attributes) becomes opset 11 Slice (inputs) while a 256 KiB weight
    stays out of the conversion; the numbers still match onnxruntime."""
    from tests.frontend.fe_helpers import check
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    nodes = [helper.make_node("Slice", ["x"], ["s"], starts=[1], ends=[3], axes=[0]),
             helper.make_node("MatMul", ["s", "w"], ["y"])]
    model = make_model(None, {"x": x}, {"w": w}, nodes=nodes, opset=9)
    graph = check(model, {"x": x}, rtol=1e-4, atol=1e-4)
    assert graph.opset == 11 and graph.constants["w"].shape == (256, 256)
