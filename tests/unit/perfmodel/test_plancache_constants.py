"""Two subgraphs with the same structure and names but different constant values (Elu with
alpha 2, then alpha 1) share a cached decision; each must run with its own constants."""
import numpy as np
from onnx import TensorProto, helper

from powerfusion.compiler import compile_model
from powerfusion.gir.interpreter import run_gir


def _elu(alpha):
    n = helper.make_node("Elu", ["x"], ["y"], alpha=alpha)
    g = helper.make_graph([n], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4, 5])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_cached_plan_binds_this_subgraphs_constant_values(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERFUSION_CACHE_DIR", str(tmp_path))
    x = np.random.default_rng(0).standard_normal(60).astype(np.float32)
    for alpha in (2.0, 1.0):   # the second is a cache hit with equal names
        g = compile_model(_elu(alpha), "cuda", codegen=False).kernel_steps[0].gir
        y = run_gir(g, {g.inputs[0]: x})[g.outputs[0]]
        # float32 exp: 1e-6 relative is ample
        np.testing.assert_allclose(y, np.where(x > 0, x, alpha * (np.exp(x) - 1)), rtol=1e-6, atol=1e-6)
