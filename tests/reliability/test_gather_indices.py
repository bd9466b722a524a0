"""Gather / GatherElements indices out of range are refused with a DataError naming the node
(ONNX: an error; onnxruntime raises) wherever the indices come from -- an input, or computed
inside the fused subgraph that gathers with them. The templates clamp an index so no read
leaves a buffer; the CPU checks the indices before the step (computing fused ones on the
basic-op executor), a GPU kernel checks each gathered index in place and the host raises after
the run (backends/cstyle/faults.py)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

import powerfusion
from powerfusion.backends.cstyle.faults import fault_sites
from powerfusion.errors import DataError

ROWS, COLS = 10, 37


def _gather_model(computed: bool, elements: bool = False):
    """y = Relu(Gather(x, i + 1)) (computed) or Relu(Gather(x, i)); GatherElements on axis 1."""
    ishape = [ROWS, 3] if elements else [5]
    nodes = [h.make_node("Add", ["i", "one"], ["j"], name="shift")] if computed else []
    idx = "j" if computed else "i"
    if elements:
        nodes.append(h.make_node("GatherElements", ["x", idx], ["g"], name="the_gather", axis=1))
        oshape = ishape
    else:
        nodes.append(h.make_node("Gather", ["x", idx], ["g"], name="the_gather", axis=0))
        oshape = [5, COLS]
    nodes.append(h.make_node("Relu", ["g"], ["y"], name="relu"))
    g = h.make_graph(nodes, "gather", [h.make_tensor_value_info("x", T.FLOAT, [ROWS, COLS]),
                                       h.make_tensor_value_info("i", T.INT64, ishape)],
                     [h.make_tensor_value_info("y", T.FLOAT, oshape)], [nh.from_array(np.array(1, np.int64), "one")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)]).SerializeToString()


def _reference(x, i, computed, elements):
    j = i + 1 if computed else i
    n = COLS if elements else ROWS
    j = np.where(j < 0, j + n, j)
    return np.maximum(np.take_along_axis(x, j, axis=1) if elements else x[j], 0)


CASES = [(c, e) for c in (False, True) for e in (False, True)]
X = np.random.default_rng(5).standard_normal((ROWS, COLS)).astype(np.float32)


def _indices(elements, bad=None):
    i = np.array([[0, 5, -3]] * ROWS, np.int64) if elements else np.array([0, 3, -2, 7, -9], np.int64)
    if bad is not None:
        i.flat[1] = bad
    return i


def _bad_values(computed, elements):
    n = COLS if elements else ROWS
    shift = 1 if computed else 0
    return (n - shift, -n - 1 - shift)   # one past the end, one before the start (after the shift)


@pytest.mark.parametrize("computed,elements", CASES)
def test_cpu_refuses_out_of_range_indices_wherever_they_come_from(computed, elements):
    sess = powerfusion.InferenceSession(_gather_model(computed, elements))
    i = _indices(elements)
    np.testing.assert_array_equal(sess.run(None, {"x": X, "i": i})[0], _reference(X, i, computed, elements))
    for bad in _bad_values(computed, elements):
        with pytest.raises(DataError, match=r"node 'the_gather' \(Gather(Elements)?, opset 17\): index -?\d+ .* out of range"):
            sess.run(None, {"x": X, "i": _indices(elements, bad)})


def test_indices_computed_by_too_much_work_are_clamped_with_a_warning(monkeypatch):
    """The documented limit: beyond COMPUTED_INDEX_ELEMENTS the computed indices are not
    evaluated twice; the gather clamps them and a warning (once per node) says so."""
    from powerfusion.frontend import index_check
    monkeypatch.setattr(index_check, "COMPUTED_INDEX_ELEMENTS", 0)
    monkeypatch.setattr(index_check, "_WARNED", set())
    sess = powerfusion.InferenceSession(_gather_model(True))
    bad = _indices(False, ROWS - 1)   # + 1 = ROWS: one past the end, clamped to the last row
    with pytest.warns(index_check.UncheckedIndexWarning, match="the_gather"):
        got = sess.run(None, {"x": X, "i": bad})[0]
    np.testing.assert_array_equal(got, np.maximum(X[np.clip(np.where(bad + 1 < 0, bad + 1 + ROWS, bad + 1), 0, ROWS - 1)], 0))


@pytest.mark.parametrize("computed,elements", CASES)
def test_emitted_cuda_checks_every_gathered_index(computed, elements):
    from powerfusion.compiler import compile_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile_model(_gather_model(computed, elements), "cuda")
    sites = [s for st in plan.kernel_steps for k in st.kernels for s in fault_sites(k.source).values()]
    n = COLS if elements else ROWS
    assert sites and all(s.fn == "index" and s.dtype == str(n) for s in sites)
    for st in plan.kernel_steps:
        for k in st.kernels:
            body = k.source.split('extern "C"', 1)[1]
            assert "min(max(" not in body, "a gathered index clamped without a check"


@pytest.mark.usefixtures("nvcc")
@pytest.mark.parametrize("computed,elements", CASES)
def test_emitted_cuda_with_checked_indices_compiles(computed, elements):
    from powerfusion.backends.cuda.runtime import compile_check_nvcc
    from powerfusion.compiler import compile_model
    for st in compile_model(_gather_model(computed, elements), "cuda").kernel_steps:
        for k in st.kernels:
            compile_check_nvcc(k.source, "sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("computed,elements", CASES)
def test_cuda_refuses_out_of_range_indices_wherever_they_come_from(computed, elements):
    sess = powerfusion.InferenceSession(_gather_model(computed, elements), target="cuda")
    i = _indices(elements)
    np.testing.assert_array_equal(sess.run(None, {"x": X, "i": i})[0], _reference(X, i, computed, elements))
    for bad in _bad_values(computed, elements):
        with pytest.raises(DataError, match=r"gather index out of range in node 'the_gather' \(Gather(Elements)?, opset 17\)"):
            sess.run(None, {"x": X, "i": _indices(elements, bad)})
    np.testing.assert_array_equal(sess.run(None, {"x": X, "i": i})[0], _reference(X, i, computed, elements))
