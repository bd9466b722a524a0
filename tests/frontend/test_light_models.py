"""The onnx package's nine `light_*` CNNs (opset 9, upgraded to 11 on import).

Their weights are ConstantOfShape fills, so the stored reference output is a uniform
softmax; each model is therefore also run with random weights against onnxruntime,
which exercises the real numerics (rtol 1e-3 / atol 1e-6 after ~50 fp32 layers)."""
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fe_helpers import run_ort
from powerfusion.frontend import import_model, partition_graph, run_basic_graph

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
FAST = {"squeezenet", "resnet50"}
NAMES = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
         "vgg19", "zfnet512"]


def _param(name):
    return pytest.param(name, id=name, marks=() if name in FAST else pytest.mark.slow)


def _dummy_input(model):
    # the onnx backend runner's input for these models: arange / n
    inits = {t.name for t in model.graph.initializer}
    inp = next(vi for vi in model.graph.input if vi.name not in inits)
    shape = tuple(d.dim_value for d in inp.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return inp.name, (np.arange(n).reshape(shape) / n).astype(np.float32)


@pytest.mark.parametrize("name", [_param(n) for n in NAMES])
def test_light_model_matches_reference_output(name):
    path = os.path.join(LIGHT, f"light_{name}.onnx")
    model = onnx.load(path)
    key, x = _dummy_input(model)
    graph = import_model(path)
    (out,) = run_basic_graph(graph, {key: x}).values()
    ref = numpy_helper.to_array(onnx.load_tensor(os.path.join(LIGHT, f"light_{name}_output_0.pb")))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)
    partition_graph(graph, "cpu")


def _with_random_weights(model, rng):
    """Replace each ConstantOfShape fill by He-scaled random values (1-D: U(0.5, 1.5), positive
    so that BatchNormalization variances stay valid)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    keep, new = [], []
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in inits[node.input[0]])
            if len(shape) >= 2:
                v = rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / np.prod(shape[1:])))
            else:
                v = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            new.append(numpy_helper.from_array(v.astype(np.float32), node.output[0]))
        else:
            keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    model.graph.initializer.extend(new)
    model.ir_version = max(model.ir_version, 4)  # initializers that are not graph inputs need IR >= 4
    return model


@pytest.mark.parametrize("name", [_param(n) for n in NAMES])
def test_light_model_random_weights_match_onnxruntime(name):
    model = _with_random_weights(onnx.load(os.path.join(LIGHT, f"light_{name}.onnx")), np.random.default_rng(0))
    key, _ = _dummy_input(model)
    x = np.random.default_rng(1).standard_normal(_dummy_input(model)[1].shape).astype(np.float32)
    ref = run_ort(model, {key: x})
    graph = import_model(model)
    ours = run_basic_graph(graph, {key: x})
    for k, v in ref.items():
        assert v.std() > 1e-6, "degenerate reference"
        np.testing.assert_allclose(ours[k], v, rtol=1e-3, atol=1e-6, err_msg=k)
