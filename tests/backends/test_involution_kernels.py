"""Involution templates rendered: every candidate of the involution cases compiles with nvcc
(sm_80, sm_90); on a GPU each runs and matches the interpreter (float32 rtol 2e-5 / atol 2e-5;
float16 1e-3 / 1e-3: the same float32 sum rounded once, with the device's fused multiply-adds);
the form RedNet exports (stacked taps x per-position kernel, summed) reaches them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import require_tool  # noqa: E402
from powerfusion.templates import buffer_names, candidates  # noqa: E402
from tests.backends.kernel_checks import assert_gpu_matches_interpreter, assert_nvcc_compiles  # noqa: E402
from tests.unit.templates.test_involution import CASES, involution_case  # noqa: E402

def _graphs():
    out = []
    for cid, (shape, k, groups, stride, dil, dtype) in CASES.items():
        case = involution_case(shape, k, groups, stride, dil, dtype=dtype)
        g = case[0]
        node = g.graph.nodes[-1]
        for c in candidates(node, g.graph.tensors, "cuda", buffer_names(list(g.graph.tensors))):
            out.append((f"{cid}:{c.label}", case, c.build()))
    return out


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_involution_kernels_compile_with_nvcc(arch, tmp_path):
    require_tool("nvcc")
    assert_nvcc_compiles(_graphs(), arch, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("label,case,gir", _graphs(), ids=lambda x: x if isinstance(x, str) else "")
def test_involution_kernel_on_gpu_matches_interpreter(label, case, gir):
    g, values, _ = case
    names = buffer_names(list(g.graph.tensors))
    node = g.graph.nodes[-1]
    assert_gpu_matches_interpreter(label, gir, {names[t]: values[t] for t in node.inputs})


def test_rednet_involutions_reach_the_involution_templates():
    """rednet_small's five involutions (3x3 and 7x7, strides 1 and 2): the frontend makes each
    one Involution, and the CUDA plan lowers each through one of its templates (which one is the
    search's choice)."""
    from powerfusion.compiler import compile_model
    path = Path(__file__).resolve().parents[2] / "models" / "small" / "rednet_small.onnx"
    plan = compile_model(str(path), "cuda")
    used = [t for s in plan.kernel_steps for _, t in s.gir.templates if t.startswith("involution")]
    assert len(used) == 5, used
