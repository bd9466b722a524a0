"""Run ONNX's node conformance cases through powerfusion.backend on the CPU and classify each.

Outcomes:
  passed         every output has the expected dtype and shape and is within the case's rtol/atol
  unsupported    the frontend raised UnsupportedOpError naming one of the case's op types
  opset          the case's opset is outside what the frontend accepts, and it said so (ModelError)
  wrong          ran, but an output differs (numbers, dtype or shape)        -> a bug
  error          any other exception                                         -> a bug

A static-shape compiler needs shape-like operands (Reshape's shape, Slice's starts, Resize's
scales, ...) at compile time. When the case as given is declined, it is tried once more with
its integer inputs and its small inputs other than the first bound as initializers (as TVM's
freeze_params does); the outcome records whether that happened.
"""
from __future__ import annotations

import functools
import traceback
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from powerfusion.backend import PowerFusionBackend
from powerfusion.errors import ModelError, PowerFusionError, UnsupportedOpError

BIND_MAX_ELEMENTS = 8
DECLINED = ("unsupported", "opset")


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str          # passed | unsupported | opset | wrong | error
    detail: str = ""
    bound: tuple[str, ...] = ()  # inputs bound as initializers for the successful attempt

    @property
    def bug(self) -> bool:
        return self.status in ("wrong", "error")


@functools.cache
def all_cases() -> dict:
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {c.name: c for c in collect_testcases(None)}


def case_opset(model: onnx.ModelProto) -> int:
    from powerfusion.frontend.onnx_graph import default_opset
    return default_opset(model)


def case_op_types(model: onnx.ModelProto) -> set[str]:
    """Op types of the graph, its subgraphs (If/Loop/Scan bodies) and its local functions."""
    ops: set[str] = set()

    def visit(nodes):
        for n in nodes:
            ops.add(n.op_type)
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    visit(g.node)

    visit(model.graph.node)
    for f in model.functions:
        visit(f.node)
    return ops


def run_case(case) -> Outcome:
    first = None
    for inputs, expected in case.data_sets:
        inputs = [_array(x) for x in inputs]
        expected = [_array(x) for x in expected]
        outcome = _attempt(case, case.model, inputs, expected, ())
        if outcome.status in DECLINED or outcome.status == "error":
            model, feeds, bound = bind_inputs(case.model, inputs)
            if bound:
                retry = _attempt(case, model, feeds, expected, bound)
                if retry.status in ("passed", "wrong") or (outcome.status == "error" and retry.status in DECLINED):
                    outcome = retry
        if outcome.status != "passed":
            return outcome
        first = first or outcome
    return first or Outcome(case.name, "error", "case has no data sets")


def bind_inputs(model: onnx.ModelProto, inputs: list):
    """Move integer inputs, and small inputs other than the first, into initializers with the case's values."""
    initialized = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in initialized]
    bound, feeds = [], []
    new = onnx.ModelProto()
    new.CopyFrom(model)
    for k, (info, value) in enumerate(zip(graph_inputs, inputs)):
        if isinstance(value, np.ndarray) and (value.dtype.kind in "iu" or k > 0 and value.size <= BIND_MAX_ELEMENTS):
            new.graph.initializer.append(numpy_helper.from_array(value, info.name))
            bound.append(info.name)
        else:
            feeds.append(value)
    if model.ir_version >= 4:  # before IR 4 every initializer must also be a graph input
        kept = [i for i in new.graph.input if i.name not in bound]
        del new.graph.input[:]
        new.graph.input.extend(kept)
    return new, feeds, tuple(bound)


def _attempt(case, model, inputs, expected, bound) -> Outcome:
    name = case.name
    try:
        got = list(PowerFusionBackend.prepare(model, "CPU").run(inputs))
    except UnsupportedOpError as e:
        from powerfusion.frontend.loader import MIN_OPSET
        ops = {op for _, op, _, _ in e.nodes}
        # below MIN_OPSET the model is upgraded first, which may rename ops (Scatter -> ScatterElements)
        if not ops & case_op_types(model) and case_opset(model) >= MIN_OPSET:
            return Outcome(name, "error", f"UnsupportedOpError names {sorted(ops)}, not an op of the case "
                                          f"{sorted(case_op_types(model))}: {e}")
        return Outcome(name, "unsupported", _one_line(e))
    except ModelError as e:
        from powerfusion.frontend.loader import MAX_OPSET, MIN_UPGRADABLE_OPSET
        opset = case_opset(model)
        if not MIN_UPGRADABLE_OPSET <= opset <= MAX_OPSET and "opset" in str(e):
            return Outcome(name, "opset", _one_line(e))
        return Outcome(name, "error", f"ModelError: {_one_line(e)}")
    except PowerFusionError as e:
        return Outcome(name, "error", f"{type(e).__name__}: {_one_line(e)}")
    except Exception as e:  # a crash inside PowerFusion: keep where it happened
        where = traceback.extract_tb(e.__traceback__)[-1]
        return Outcome(name, "error", f"{type(e).__name__}: {_one_line(e)} "
                                      f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
    problem = compare_outputs(got, expected, case.rtol, case.atol)
    return Outcome(name, "wrong" if problem else "passed", problem or "", bound)


def compare_outputs(got: list, expected: list, rtol: float, atol: float,
                    floors: dict | None = None) -> str | None:
    """None when equal within tolerance (as onnx's backend runner checks); else what differs.
    `floors` (dtype name -> (rtol, atol)): per-dtype minimum tolerances; dtypes it does not
    name are then compared exactly."""
    if len(got) != len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for k, (g, e) in enumerate(zip(got, expected)):
        g = np.asarray(g)
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"output {k}: got {g.dtype} {g.shape}, expected {e.dtype} {e.shape}"
        if e.dtype.kind in "OSU":
            if not np.array_equal(g, e):
                return f"output {k}: strings differ"
            continue
        if floors is not None:
            if e.dtype.name not in floors:
                if not np.array_equal(g, e):
                    return f"output {k} ({e.dtype}, exact): {int(np.sum(g != e))} of {e.size} elements differ"
                continue
            rtol, atol = max(floors[e.dtype.name][0], rtol), max(floors[e.dtype.name][1], atol)
        try:
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol,
                                       equal_nan=True)
        except AssertionError as err:
            lines = [s.strip() for s in str(err).splitlines() if s.strip().startswith(("Mismatched", "Max"))]
            return f"output {k} ({e.dtype}, rtol {rtol:g}, atol {atol:g}): " + "; ".join(lines)
    return None


def _array(x):
    if isinstance(x, onnx.TensorProto):
        return numpy_helper.to_array(x)
    if isinstance(x, (np.generic, np.ndarray)):
        return np.asarray(x)
    return x  # sequences, optionals: passed as they are (the frontend declines them)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:400]
