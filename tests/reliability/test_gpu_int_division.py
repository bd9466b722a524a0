"""Integer division by zero on the GPU targets: ONNX leaves it undefined, onnxruntime raises, C
traps on a CPU and a GPU returns garbage. Every backend raises a DataError instead (the CPU
through the GIR executor; a GPU kernel checks the divisor, records the site and the host
raises after the run, naming the ONNX node: backends/cstyle/faults.py)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

from powerfusion.backends.cstyle.faults import FaultSite, fault_line, fault_sites
from powerfusion.errors import DataError

N = 256
ONNX_TYPE = {"int64": T.INT64, "int32": T.INT32, "uint8": T.UINT8}


def _model(dtype: str = "int64"):
    """y = ((a + b) / b) mod b, then fmod b: one fused subgraph with three checked divisions."""
    t = ONNX_TYPE[dtype]
    nodes = [h.make_node("Add", ["a", "b"], ["s"], name="add"), h.make_node("Div", ["s", "b"], ["q"], name="the/div"),
             h.make_node("Mod", ["q", "b"], ["m"], name="floor_mod"),
             h.make_node("Mod", ["m", "b"], ["y"], name="trunc_mod", fmod=1)]
    g = h.make_graph(nodes, "int_division", [h.make_tensor_value_info("a", t, [N]), h.make_tensor_value_info("b", t, [N])],
                     [h.make_tensor_value_info("y", t, [N])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _sources(model):
    from powerfusion.compiler import compile_model
    return [k.source for s in compile_model(model, "cuda").kernel_steps for k in s.kernels]


@pytest.mark.parametrize("dtype", sorted(ONNX_TYPE))
def test_emitted_cuda_checks_every_integer_divisor(dtype):
    sources = _sources(_model(dtype))
    sites = [site for src in sources for site in fault_sites(src).values()]
    assert sorted(s.fn for s in sites) == ["div", "mod", "rem"]
    assert {s.dtype for s in sites} == {dtype}
    text = "\n".join(sources)
    for fn in ("div", "rem", "mod"):
        assert f"pf_checked_{fn}<" in text
    body = text.split("extern \"C\"", 1)[1]
    assert " / r_" not in body and " % r_" not in body   # no unchecked division of loaded values


@pytest.mark.usefixtures("nvcc")
@pytest.mark.parametrize("dtype", sorted(ONNX_TYPE))
def test_emitted_cuda_with_checked_division_compiles(dtype):
    from powerfusion.backends.cuda.runtime import compile_check_nvcc
    for src in _sources(_model(dtype)):
        compile_check_nvcc(src, "sm_90")


def test_float_division_is_not_checked():
    model = _model()
    for vi in list(model.graph.input) + list(model.graph.output):
        vi.type.tensor_type.elem_type = T.FLOAT
    model.graph.node[2].attribute.append(h.make_attribute("fmod", 1))   # float Mod needs fmod=1
    assert not any(fault_sites(src) for src in _sources(model))


def test_fault_table_lines_cannot_carry_code():
    line = fault_line(3, "div", "n1 */ }\n#include <evil>\n", "int64")
    assert line == "// pf_fault 3: div int64 n1_______include__evil__"   # one comment line, nothing else
    assert fault_sites("x\n" + line + "\ny") == {3: FaultSite(3, "div", "int64", "n1_______include__evil__")}


class _Word:
    """Stands in for a module's pf_fault word (CuPy uint32[1]) in host-side tests."""

    def __init__(self, code):
        self.code = code

    def get(self):
        return np.array([self.code], np.uint32)

    def fill(self, v):
        self.code = v


def test_host_raises_the_first_recorded_fault_and_clears_every_word():
    from powerfusion.backends.cuda.executor import raise_first_fault
    sites = {1: FaultSite(1, "div", "int64", "n1"), 2: FaultSite(2, "mod", "int64", "n2")}
    words = [_Word(0), _Word(2), _Word(1)]
    with pytest.raises(DataError, match=r"integer division by zero in node 'the/div' \(Div\): Mod of int64"):
        raise_first_fault([(w, sites) for w in words], lambda op: "node 'the/div' (Div)")
    assert [w.code for w in words] == [0, 0, 0]
    raise_first_fault([(w, sites) for w in words])   # cleared: the next run starts clean


def _reference(a, b):
    """ONNX semantics in int64: Div truncates, Mod (fmod=0) takes the divisor's sign, fmod=1 the dividend's."""
    s, b = a.astype(np.int64) + b, b.astype(np.int64)
    q = np.sign(s) * np.sign(b) * (np.abs(s) // np.abs(b))
    return np.fmod(np.mod(q, b), b).astype(a.dtype)


def test_reference_agrees_with_onnxruntime():
    import onnxruntime as ort
    a, b = np.array([7, -7, 7, -7, 0, 13], np.int64), np.array([2, 2, -2, -2, 3, -5], np.int64)
    ref = ort.InferenceSession(_model().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(_reference(a, b), ref.run(None, {"a": np.resize(a, N), "b": np.resize(b, N)})[0][:6])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(ONNX_TYPE))
def test_cuda_integer_division_matches_onnx_and_refuses_zero(dtype):
    import powerfusion
    rng = np.random.default_rng(3)
    signed = dtype != "uint8"
    a = rng.integers(-50 if signed else 0, 50, N).astype(dtype)
    b = (rng.integers(1, 9, N) * (rng.choice([-1, 1], N) if signed else 1)).astype(dtype)
    sess = powerfusion.InferenceSession(_model(dtype).SerializeToString(), target="cuda")
    np.testing.assert_array_equal(sess.run(None, {"a": a, "b": b})[0], _reference(a, b))
    zero = b.copy()
    zero[N // 2] = 0
    with pytest.raises(DataError, match=r"division by zero in node 'the/div' \(Div, opset 17\)"):
        sess.run(None, {"a": a, "b": zero})
    np.testing.assert_array_equal(sess.run(None, {"a": a, "b": b})[0], _reference(a, b))   # the record was cleared
