"""conv.depthwise.strip rendered: its in-lane window moves become register assignments, every
candidate of the strip cases compiles with nvcc (sm_80, sm_90) and renders for HIP; on a GPU
each runs and matches the interpreter (tolerances as test_stencil_kernels.py), and the 3x3 +
BatchNorm + SiLU plan at 56x56 runs as one kernel that matches numpy."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import require_tool  # noqa: E402
from powerfusion.backends.cstyle.inlane import in_lane_assignments  # noqa: E402
from powerfusion.backends.hip.renderer import HIPRenderer  # noqa: E402
from powerfusion.gir.expr import I, J  # noqa: E402
from powerfusion.gir.ir import Level, MemorySlice  # noqa: E402
from tests.backends.test_stencil_kernels import test_stencil_kernel_on_gpu_matches_interpreter as _on_gpu  # noqa: E402
from tests.backends.kernel_checks import assert_nvcc_compiles  # noqa: E402
from tests.unit.templates.test_strip import CASES, case_of, strip_candidates  # noqa: E402


def _graphs(target="cuda"):
    out = []
    for cid in CASES:
        case, _ = case_of(CASES[cid])
        for c in strip_candidates(case, target):
            out.append((f"{cid}:{c.label}", case, c.build()))
    return out


def test_in_lane_move_is_a_list_of_slot_assignments():
    """Shift a 2-lane x vec-2 tile by one element inside each lane: slots 0 <- 1 in every lane;
    a shift that would take lane 1's element into lane 0 is no in-lane move."""
    src = MemorySlice(buffer="a", level=Level.REGISTER, index=J + 1, num=1, width=4, dtype="float32", vec=2,
                      valid=(J % 2).eq(0))
    dst = MemorySlice("b", Level.REGISTER, I * 4 + J, 1, 4, "float32", 2, (J % 2).eq(0))
    assert in_lane_assignments(src, dst, 4, 2, 2) == [(0, 1)]
    crossing = MemorySlice("a", Level.REGISTER, J + 1, 1, 4, "float32", 2, (J % 2).eq(1))
    assert in_lane_assignments(crossing, MemorySlice("b", Level.REGISTER, J, 1, 4, "float32", 2, (J % 2).eq(1)),
                               4, 2, 2) is None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_strip_kernels_compile_with_nvcc(arch, tmp_path):
    require_tool("nvcc")
    assert_nvcc_compiles(_graphs(), arch, tmp_path, lambda src: "r_" in src and "_win[" in src)


def test_strip_kernels_render_for_hip():
    graphs = _graphs("hip")
    assert graphs
    for label, _, gir in graphs:
        assert len(HIPRenderer().render(gir)) == 1, label


@pytest.mark.gpu
@pytest.mark.parametrize("label,case,gir", _graphs(), ids=lambda x: x if isinstance(x, str) else "")
def test_strip_kernel_on_gpu_matches_interpreter(label, case, gir):
    _on_gpu(label, case, gir)


@pytest.mark.gpu
def test_dwconv_bn_silu_flat_strip_session_on_gpu():
    """The subgraph suite's 3x3 + BatchNorm + SiLU at 32x144x56x56 through
    InferenceSession(target="cuda"): the plan test_strip.py checks (the flat strip, one kernel),
    against numpy's float64 reference (float32: rtol / atol 1e-4)."""
    from powerfusion import InferenceSession
    from tests.unit.templates.test_stencil import numpy_depthwise
    from tests.unit.templates.test_strip import dwconv_bn_silu_model
    model, p = dwconv_bn_silu_model(32, 144, 56)
    x = np.random.default_rng(4).standard_normal((32, 144, 56, 56)).astype(np.float32)
    got = InferenceSession(model.SerializeToString(), target="cuda").run(None, {"x": x})[0].astype(np.float64)
    conv = numpy_depthwise(x, p["w"], None, (1, 1), ((1, 1), (1, 1)), (1, 1))
    sc, bi, mu, var = (p[k].astype(np.float64)[None, :, None, None] for k in ("sc", "bi", "mu", "var"))
    bn = (conv - mu) / np.sqrt(var + 1e-5) * sc + bi
    np.testing.assert_allclose(got, bn / (1 + np.exp(-bn)), rtol=1e-4, atol=1e-4)
