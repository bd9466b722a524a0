"""conv.depthwise.stencil rendered: every candidate of the stencil cases compiles with nvcc
(sm_80, sm_90) and renders for HIP; on a GPU each runs and matches the interpreter
(float32 rtol 2e-5 / atol 2e-5; float16 1e-3 / 1e-3: the same float32 sum rounded once, with
the device's fused multiply-adds), and a conv + BatchNorm + SiLU compiled by the pipeline
runs as one kernel that matches numpy."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import require_tool  # noqa: E402
from powerfusion.backends.hip.renderer import HIPRenderer  # noqa: E402
from powerfusion.templates import buffer_names  # noqa: E402
from tests.backends.kernel_checks import assert_gpu_matches_interpreter, assert_nvcc_compiles  # noqa: E402
from tests.unit.templates.test_stencil import CASES, conv_case, stencil_candidates  # noqa: E402

def _graphs(target="cuda"):
    out = []
    for cid, (shape, k, stride, pads, dil, mult, dtype) in CASES.items():
        case = conv_case(shape, k, stride, pads, dil, mult, dtype)
        for c in stencil_candidates(case, target):
            out.append((f"{cid}:{c.label}", case, c.build()))
    return out


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_stencil_kernels_compile_with_nvcc(arch, tmp_path):
    require_tool("nvcc")
    assert_nvcc_compiles(_graphs(), arch, tmp_path)


def test_stencil_kernels_render_for_hip():
    for label, _, gir in _graphs("hip"):
        ks = HIPRenderer().render(gir)
        assert len(ks) == 1 and "__syncthreads()" in ks[0].source, label


@pytest.mark.gpu
@pytest.mark.parametrize("label,case,gir", _graphs(), ids=lambda x: x if isinstance(x, str) else "")
def test_stencil_kernel_on_gpu_matches_interpreter(label, case, gir):
    g, values = case
    names = buffer_names(list(g.graph.tensors))
    node = g.graph.nodes[-1]
    assert_gpu_matches_interpreter(label, gir, {names[t]: values[t] for t in node.inputs})


def dwconv_bn_silu_model(dtype: str, c: int = 384, hw: int = 14):
    """Depthwise 7x7 (no bias) + BatchNormalization + SiLU, and its parameters."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(3)
    npdt = np.dtype(dtype)
    w = (rng.standard_normal((c, 1, 7, 7)) / 7).astype(npdt)
    sc, bi, mu = (rng.standard_normal(c).astype(npdt) for _ in range(3))
    var = (rng.random(c) + 0.5).astype(npdt)
    onnx_t = TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], group=c, kernel_shape=[7, 7], pads=[3] * 4),
             helper.make_node("BatchNormalization", ["c", "sc", "bi", "mu", "var"], ["b"], epsilon=1e-5),
             helper.make_node("Sigmoid", ["b"], ["s"]), helper.make_node("Mul", ["b", "s"], ["y"])]
    params = {"w": w, "sc": sc, "bi": bi, "mu": mu, "var": var}
    inits = [numpy_helper.from_array(a, n) for n, a in params.items()]
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", onnx_t, [1, c, hw, hw])],
                              [helper.make_tensor_value_info("y", onnx_t, [1, c, hw, hw])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model, params


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dwconv_bn_silu_plan_is_one_stencil_kernel(dtype):
    """The plan the GPU test below runs: the flat stencil with the BatchNorm and SiLU in its kernel."""
    from powerfusion.compiler import compile_model
    steps = compile_model(dwconv_bn_silu_model(dtype)[0], "cuda").kernel_steps
    assert len(steps) == 1 and len(steps[0].gir.kernels()) == 1
    assert [t for _, t in steps[0].gir.templates][0] == "conv.depthwise.stencil(layout=flat, vec=1)"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dwconv_bn_silu_session_on_gpu(dtype):
    """Depthwise 7x7 + BatchNormalization + SiLU at ConvNeXt-T's 384x14x14 through
    InferenceSession(target="cuda") (the plan of the test above): numbers of numpy's float64
    reference."""
    from powerfusion import InferenceSession
    from tests.unit.templates.test_stencil import numpy_depthwise
    model, p = dwconv_bn_silu_model(dtype)
    x = np.random.default_rng(4).standard_normal((1, 384, 14, 14)).astype(np.dtype(dtype))
    got = InferenceSession(model.SerializeToString(), target="cuda").run(None, {"x": x})[0].astype(np.float64)
    conv = numpy_depthwise(x, p["w"], None, (1, 1), ((3, 3), (3, 3)), (1, 1))
    f64 = {k: p[k].astype(np.float64)[None, :, None, None] for k in ("sc", "bi", "mu", "var")}
    bn = (conv - f64["mu"]) / np.sqrt(f64["var"] + 1e-5) * f64["sc"] + f64["bi"]
    tol = 1e-4 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(got, bn / (1 + np.exp(-bn)), rtol=tol, atol=tol)
