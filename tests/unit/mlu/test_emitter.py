"""MLURenderer on hand-built GIR graphs, run under the bang_emu.h emulation against numpy.

Tolerances: float32 results within 1e-5 relative + 1e-6 absolute of numpy (the emulator
computes each vector op in float and rounds once; fp16 layernorm within 2e-3 of its
float32-computed reference, one fp16 rounding of the output).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "mlu"))   # harness.py
sys.path.insert(0, str(ROOT / "tests" / "backends"))
from harness import run_bang  # noqa: E402
import gir_cases  # noqa: E402

from powerfusion.backends.source import RenderError
from powerfusion.names import sanitize  # noqa: E402
from powerfusion.backends.mlu.renderer import MLURenderer  # noqa: E402
from powerfusion.gir.expr import I, J, U  # noqa: E402
from powerfusion.gir.interpreter import run_gir  # noqa: E402
from powerfusion.gir.ir import (Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Parallel,  # noqa: E402
                                Reduce)

G, R = Level.GLOBAL, Level.REGISTER


def run_graph(graph: GIRGraph, feeds: dict, renderer: MLURenderer | None = None):
    """Render `graph` (one kernel) and run it through its host launcher; (outputs, log, source)."""
    (k,) = (renderer or MLURenderer()).render(graph)
    feeds = {**dict(graph.constants), **feeds}
    c = sanitize  # the harness names buffers by C identifiers
    ins = {c(b): np.asarray(feeds[b]).reshape(-1) for b, _, w in k.params if not w}
    outs = {c(b): ((graph.buffer(b).size,), np.dtype(dt)) for b, dt, w in k.params if w}
    res, log = run_bang(k.source, k.name, ins, outs, k.grid[0], launcher=f"launch_{k.name}",
                        args=[c(b) for b, _, _ in k.params])
    return {b: res[c(b)] for b, _, w in k.params if w}, log, k.source


def _numbered(ops):
    return tuple(replace(op, uid=n) for n, op in enumerate(ops))


def rows_graph(units: int, width: int, ops_of, outputs: dict, name="rows", dtype="float32") -> GIRGraph:
    """One unit per row of `width` elements: x (and y) loaded, `ops_of(reg)` computed, outputs stored."""
    row = lambda b: MemorySlice(b, G, U * width + J, 1, width, dtype)
    reg = lambda b: MemorySlice(b, R, J, 1, width, "float32")
    ops = [GOp(Move(), (row("x:0"),), (reg("xr"),)), GOp(Move(), (row("y.1"),), (reg("yr"),)), *ops_of(reg)]
    ops += [GOp(Move(), (reg(r),), (row(o),)) for o, r in outputs.items()]
    regs = {s.buffer for op in ops for s in op.inputs + op.outputs if s.level == R}
    bufs = [Buffer(b, G, units * width, dtype) for b in ("x:0", "y.1", *outputs)]
    bufs += [Buffer(b, R, width, "float32") for b in sorted(regs)]
    return GIRGraph(name, Parallel(units, 4, 1), tuple(bufs), _numbered(ops), ("x:0", "y.1"), tuple(outputs))


@pytest.mark.parametrize("case", [c for c in gir_cases.all_cases(lanes=1) if "bfloat16" not in c.graph.name],
                         ids=lambda c: c.graph.name)
def test_hand_built_cases_match_numpy(case):
    """Layernorm (masks, reductions, broadcasts; fp32 and fp16), a transpose through SRAM with
    __sync_cluster, a gather."""
    res, log, src = run_graph(case.graph, case.feeds)
    want = case.reference(case.feeds)
    interp = run_gir(case.graph, case.feeds)
    for name, ref in want.items():
        got = res[name].astype(np.float64)
        tol = 2e-3 if case.graph.buffer(name).dtype == "float16" else 1e-5
        np.testing.assert_allclose(got, np.asarray(ref, np.float64).reshape(-1), rtol=tol, atol=tol)
        np.testing.assert_allclose(got, interp[name].astype(np.float64), rtol=tol, atol=tol)
    if "transpose" in case.graph.name:
        assert "__mlu_shared__" in src and "__sync_cluster();" in src
        assert any(e.op == "__sync_cluster" for e in log.events)


def test_bfloat16_is_refused_by_name():
    case = next(c for c in gir_cases.all_cases(lanes=1) if "bfloat16" in c.graph.name)
    with pytest.raises(RenderError, match="bfloat16"):
        MLURenderer().render(case.graph)


def test_graph_for_gpu_lanes_is_refused():
    with pytest.raises(RenderError, match="mlu370"):
        MLURenderer().render(gir_cases.all_cases(lanes=32)[0].graph)


VECTOR_OPS = {"add": "__bang_add", "sub": "__bang_sub", "mul": "__bang_mul", "div": "__bang_active_reciphp"}
UNARY_OPS = {"exp": "__bang_active_exp", "sigmoid": "__bang_active_sigmoid",
             "reciprocal": "__bang_active_reciphp", "sqrt": "__bang_sqrt", "rsqrt": "__bang_active_rsqrthp",
             "abs": "__bang_abs", "neg": "__bang_mul_scalar"}


def test_vector_instructions_match_numpy():
    """Each mapped scalar function becomes its __bang_* instruction (64 floats: whole 128-byte
    granules) and agrees with numpy; a function without one (tanh), and max/min/relu (whose
    instructions' NaN behaviour is undocumented), are __mlu_func__ loops."""
    width, units = 64, 10
    from powerfusion.scalar import scalar_fn

    def ops_of(reg):
        ops = [GOp(Elementwise(fn), (reg("xr"), reg("yr")), (reg(f"o_{fn}"),)) for fn in VECTOR_OPS]
        ops += [GOp(Elementwise(fn), (reg("yr"),), (reg(f"o_{fn}"),)) for fn in UNARY_OPS]
        ops.append(GOp(Elementwise("tanh"), (reg("xr"),), (reg("o_tanh"),)))
        ops += [GOp(Elementwise(fn), (reg("xr"), reg("yr")), (reg(f"o_{fn}"),)) for fn in ("max", "min")]
        ops.append(GOp(Elementwise("relu"), (reg("xr"),), (reg("o_relu"),)))
        return ops

    names = [*VECTOR_OPS, *UNARY_OPS, "tanh", "max", "min", "relu"]
    graph = rows_graph(units, width, ops_of, {f"out_{fn}": f"o_{fn}" for fn in names}, "vector ops")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(units * width).astype(np.float32)
    y = rng.uniform(0.5, 2.0, units * width).astype(np.float32)
    res, _, src = run_graph(graph, {"x:0": x, "y.1": y})
    for fn, spelling in {**VECTOR_OPS, **UNARY_OPS}.items():
        assert f"{spelling}(" in src, fn
    assert "__mlu_func__ void" in src and "tanhf(" in src
    assert not any(f"{v}(" in src for v in ("__bang_maximum", "__bang_minimum", "__bang_active_relu"))
    assert "x:0" not in src and "y.1" not in src  # model names are sanitised
    for fn in names:
        f = scalar_fn(fn)
        want = f.numpy(x, y) if f.arity == 2 else f.numpy(x if fn in ("tanh", "relu") else y)
        np.testing.assert_allclose(res[f"out_{fn}"], want, rtol=1e-5, atol=1e-6, err_msg=fn)


def test_half_rows_convert_with_vector_instructions():
    """fp16 in GDRAM, fp32 in NRAM: __bang_half2float after the load, __bang_float2half_rn
    before the store (round to nearest even)."""
    width, units = 64, 9
    graph = rows_graph(units, width, lambda reg: [GOp(Elementwise("mul"), (reg("xr"), reg("yr")), (reg("p"),))],
                       {"out": "p"}, "half rows", dtype="float16")
    rng = np.random.default_rng(5)
    x, y = (rng.standard_normal(units * width).astype(np.float16) for _ in range(2))
    res, _, src = run_graph(graph, {"x:0": x, "y.1": y})
    assert "__bang_half2float(" in src and "__bang_float2half_rn(" in src
    want = (x.astype(np.float32) * y.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(res["out"], want)


@pytest.mark.parametrize("fn", ["sum", "max", "min"])
def test_reductions_use_pooling_and_group_reduce(fn):
    """Sum over num: one __bang_sumpool; over width: sumpool to one 128-byte group, then
    __bang_reduce_sum. Max/min: scalar loops through pf_fmaxf/pf_fminf (NaN-propagating)."""
    num, width, units = 3, 64, 6
    blk = lambda b: MemorySlice(b, G, U * num * width + I * width + J, num, width, "float32")
    reg = MemorySlice("t", R, I * width + J, num, width, "float32")
    cols = MemorySlice("c", R, J, 1, width, "float32")
    rows = MemorySlice("r", R, I, num, 1, "float32")
    ops = [GOp(Move(), (blk("a"),), (reg,)), GOp(Reduce(fn, "num"), (reg,), (cols,)),
           GOp(Reduce(fn, "width"), (reg,), (rows,)),
           GOp(Move(), (cols,), (MemorySlice("over_num", G, U * width + J, 1, width, "float32"),)),
           GOp(Move(), (rows,), (MemorySlice("over_width", G, U * num + I, num, 1, "float32"),))]
    bufs = (Buffer("a", G, units * num * width, "float32"), Buffer("over_num", G, units * width, "float32"),
            Buffer("over_width", G, units * num, "float32"), Buffer("t", R, num * width, "float32"),
            Buffer("c", R, width, "float32"), Buffer("r", R, num, "float32"))
    graph = GIRGraph("reduce", Parallel(units, 4, 1), bufs, _numbered(ops), ("a",), ("over_num", "over_width"))
    a = np.random.default_rng(1).standard_normal(units * num * width).astype(np.float32)
    res, _, src = run_graph(graph, {"a": a})
    if fn == "sum":
        assert src.count("__bang_sumpool(") == 2 and "__bang_reduce_sum(" in src
    else:
        assert src.count(f"acc = pf_f{fn}f(acc, ") == 2 and "pool(" not in src and "__bang_arg" not in src
    ref = getattr(np, fn)(a.reshape(units, num, width), axis=1)
    np.testing.assert_allclose(res["over_num"], ref.reshape(-1), rtol=1e-5, atol=1e-5)
    ref = getattr(np, fn)(a.reshape(units, num, width), axis=2)
    np.testing.assert_allclose(res["over_width"], ref.reshape(-1), rtol=1e-5, atol=1e-5)


def test_strided_rows_use_the_2d_memcpy():
    """A column block of a matrix (segments 20 elements apart, 8 wide) is one 2-D __memcpy
    each way; a transposed store (j stride != 1) is an element loop with per-run copies."""
    units, num, width, cols = 5, 4, 8, 20
    block = lambda b: MemorySlice(b, G, U * num * cols + I * cols + 4 + J, num, width, "float32")
    reg = lambda b: MemorySlice(b, R, I * width + J, num, width, "float32")
    tr = MemorySlice("t_out", G, U * num * width + J * num + I, num, width, "float32")
    ops = [GOp(Move(), (block("m"),), (reg("v"),)), GOp(Elementwise("relu"), (reg("v"),), (reg("w"),)),
           GOp(Move(), (reg("w"),), (block("m_out"),)), GOp(Move(), (reg("w"),), (tr,))]
    n = units * num * cols
    bufs = (Buffer("m", G, n, "float32"), Buffer("m_out", G, n, "float32"),
            Buffer("t_out", G, units * num * width, "float32"), Buffer("v", R, 32, "float32"),
            Buffer("w", R, 32, "float32"))
    graph = GIRGraph("strided", Parallel(units, 4, 1), bufs, _numbered(ops), ("m",), ("m_out", "t_out"))
    m = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    (k,) = MLURenderer().render(graph)
    assert k.source.count(f", {width * 4}, GDRAM2NRAM, {width * 4}, {cols * 4}, {num - 1});") == 2  # prologue+prefetch
    assert f", {width * 4}, NRAM2GDRAM, {cols * 4}, {width * 4}, {num - 1});" in k.source
    ins = {"m": m}
    outs = {"m_out": ((n,), np.float32), "t_out": ((units * num * width,), np.float32)}
    res, log = run_bang(k.source, k.name, ins, outs, k.grid[0], launcher=f"launch_{k.name}",
                        args=[b for b, _, _ in k.params], check_coverage=False)
    blockref = np.maximum(m.reshape(units, num, cols)[:, :, 4:12], 0)
    np.testing.assert_array_equal(res["m_out"].reshape(units, num, cols)[:, :, 4:12], blockref)
    np.testing.assert_array_equal(res["t_out"].reshape(units, width, num), blockref.transpose(0, 2, 1))
    assert log.coverage["t_out"].complete
    assert log.coverage["m_out"].written == units * num * width * 4  # only the block is written


def _pipeline_graph(units=96, width=64):
    return rows_graph(units, width, lambda reg: [GOp(Elementwise("add"), (reg("xr"), reg("yr")), (reg("s"),)),
                                                  GOp(Elementwise("exp"), (reg("s"),), (reg("e"),))],
                      {"out": "e"}, "pipe")


def _unit_phases(log, task: int, width: int, task_dim: int):
    """For each unit of `task`: (seq its x load was issued, seq it completed, seqs of its compute)."""
    ev = log.of_task(task)
    issue = {e.srcs[0].offset // (width * 4): e for e in ev if e.kind in ("memcpy_issue", "memcpy")
             and e.op == "GDRAM2NRAM" and e.srcs[0].buffer == "x_0"}
    done = {e.copy: e.seq for e in ev if e.kind in ("memcpy_complete", "memcpy")}
    waits = [e.seq for e in ev if e.kind == "wait" and e.op == "__sync_io"]
    computes = [e for e in ev if e.kind == "compute"]
    units = sorted(issue)
    out = []
    for n, u in enumerate(units):
        # unit n computes after the n-th wait (pipelined) -- or between its load and the next load (plain)
        lo = waits[n] if waits else issue[u].seq
        hi = waits[n + 1] if len(waits) > n + 1 else (issue[units[n + 1]].seq if n + 1 < len(units) and not waits
                                                      else 1 << 60)
        out.append((u, issue[u].seq, done[issue[u].copy], [c.seq for c in computes if lo < c.seq < hi]))
    return out


def test_pipelined_form_overlaps_the_next_load_with_compute():
    """Event order: the copy of unit k+1 is issued before unit k computes and completes after."""
    width, units = 64, 96
    graph = _pipeline_graph(units, width)
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal(units * width).astype(np.float32) for _ in range(2))
    res, log, src = run_graph(graph, {"x:0": x, "y.1": y})
    np.testing.assert_allclose(res["out"], np.exp(x + y), rtol=1e-5)
    assert "(pipelined)" in src and "__memcpy_async(" in src and "__sync_io();" in src
    task_dim = 32
    phases = _unit_phases(log, 0, width, task_dim)
    assert [p[0] for p in phases] == [0, 32, 64]
    for (u, _, _, comp), (u_next, issued, completed, _) in zip(phases, phases[1:]):
        assert comp, f"unit {u}: no compute events"
        assert issued < min(comp), f"load of unit {u_next} issued after unit {u} started computing"
        assert completed > max(comp), f"load of unit {u_next} completed before unit {u} finished computing"
    stores = [e for e in log.of_task(0) if e.kind == "memcpy_issue" and e.op == "NRAM2GDRAM"]
    assert len(stores) == 3  # the stores are asynchronous too
    for st in stores:  # ... and wait for the compute pipe's results first
        before = [e for e in log.of_task(0) if e.seq < st.seq and e.kind in ("compute", "wait")]
        assert before[-1].op == "__sync_compute"


def test_plain_form_does_not_overlap():
    """The same graph without pipelining: every load is synchronous and follows the previous
    unit's compute (so the overlap test above can fail)."""
    width, units = 64, 96
    graph = _pipeline_graph(units, width)
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal(units * width).astype(np.float32) for _ in range(2))
    res, log, src = run_graph(graph, {"x:0": x, "y.1": y}, MLURenderer(pipeline=False))
    np.testing.assert_allclose(res["out"], np.exp(x + y), rtol=1e-5)
    assert "(plain)" in src and "__memcpy_async" not in src
    loads = [e.seq for e in log.of_task(0) if e.op == "GDRAM2NRAM" and e.srcs[0].buffer == "x_0"]
    computes = [e.seq for e in log.of_task(0) if e.kind == "compute"]
    assert loads[1] > computes[0]


def test_nram_capacity_is_respected():
    """Two buffer sets that do not fit fall back to the synchronous form; tiles that do not fit
    once are refused with the figures."""
    big = 50_000  # floats: 200 KB per buffer, 3 buffers: one set fits 640 KB, two do not
    graph = rows_graph(4, big, lambda reg: [GOp(Elementwise("add"), (reg("xr"), reg("yr")), (reg("s"),))],
                       {"out": "s"}, "big")
    (k,) = MLURenderer().render(graph)
    assert "(plain)" in k.source
    huge = rows_graph(4, 200_000, lambda reg: [], {"out": "xr"}, "huge")
    with pytest.raises(RenderError, match="NRAM"):
        MLURenderer().render(huge)


def test_cli_compile_target_mlu_writes_sources_that_run(tmp_path):
    """`powerfusion compile MODEL --target mlu -o DIR`: .mlu sources and plan.json; each
    written kernel runs under the emulation through its launcher and matches onnxruntime."""
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 96])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 96])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Exp", ["r"], ["e"]),
             helper.make_node("Add", ["e", "x"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "tiny", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "tiny.onnx"
    onnx.save(model, path)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "powerfusion.cli", "compile", str(path), "--target", "mlu",
                           "-o", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((out / "plan.json").read_text())
    kernels = [k for s in plan["steps"] if s["kind"] == "kernels" for k in s["kernels"]]
    assert kernels and all(k["file"].endswith(".mlu") for k in kernels)
    assert len(kernels) == 1
    k = kernels[0]
    xv = np.random.default_rng(4).standard_normal((4, 96)).astype(np.float32)
    tensors = {p["buffer"]: p["tensor"] for p in k["params"]}
    ins = {p["buffer"]: xv.reshape(-1) for p in k["params"] if not p["written"]}
    outs = {p["buffer"]: ((4 * 96,), np.float32) for p in k["params"] if p["written"]}
    assert set(tensors.values()) == {"x", "y"}
    res, _ = run_bang((out / k["file"]).read_text(), k["name"], ins, outs, k["grid"][0],
                      launcher=f"launch_{k['name']}", args=[p["buffer"] for p in k["params"]])
    (got,) = res.values()
    np.testing.assert_allclose(got.reshape(4, 96), np.exp(np.maximum(xv, 0)) + xv, rtol=1e-5, atol=1e-6)


def test_index_floor_division_of_negative_offsets():
    """GIR's // and % are floor operations; offsets like (8u + j - 3) % 40 go negative at u = 0
    and must wrap like numpy's (C's % would not)."""
    units, width, n = 5, 8, 40
    wrap = MemorySlice("a", G, (U * width + J - 3) % n, 1, width, "float32")
    back = MemorySlice("b", G, (U * width + J - 11) // 4 + 3, 1, width, "float32")
    reg = lambda b: MemorySlice(b, R, J, 1, width, "float32")
    ops = [GOp(Move(), (wrap,), (reg("v"),)), GOp(Move(), (back,), (reg("w"),)),
           GOp(Elementwise("add"), (reg("v"), reg("w")), (reg("s"),)),
           GOp(Move(), (reg("s"),), (MemorySlice("out", G, U * width + J, 1, width, "float32"),))]
    bufs = (Buffer("a", G, n, "float32"), Buffer("b", G, n, "float32"), Buffer("out", G, units * width, "float32"),
            Buffer("v", R, width, "float32"), Buffer("w", R, width, "float32"), Buffer("s", R, width, "float32"))
    graph = GIRGraph("wrap", Parallel(units, 4, 1), bufs, _numbered(ops), ("a", "b"), ("out",))
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    res, _, src = run_graph(graph, {"a": a, "b": b})
    k = np.arange(units * width)
    np.testing.assert_allclose(res["out"], a[(k - 3) % n] + b[(k - 11) // 4 + 3], rtol=1e-6)
    assert "pf_ifloormod(" in src and "pf_ifloordiv(" in src


def test_registers_crossing_a_kernel_boundary_are_recomputed():
    """GIR lets a unit's registers live across a DEVICE sync; NRAM does not survive a launch,
    so the second kernel recomputes them (here: loads x and squares it again)."""
    from powerfusion.gir.ir import Scope, Sync
    units, width = 8, 32
    row = lambda b: MemorySlice(b, G, U * width + J, 1, width, "float32")
    reg = lambda b: MemorySlice(b, R, J, 1, width, "float32")
    ops = [GOp(Move(), (row("x"),), (reg("r"),)), GOp(Elementwise("mul"), (reg("r"), reg("r")), (reg("sq"),)),
           GOp(Move(), (reg("sq"),), (row("first"),)), GOp(Sync(Scope.DEVICE), (row("first"),), (row("first"),)),
           GOp(Move(), (row("first"),), (reg("f"),)), GOp(Elementwise("add"), (reg("f"), reg("sq")), (reg("o"),)),
           GOp(Move(), (reg("o"),), (row("out"),))]
    bufs = (Buffer("x", G, units * width, "float32"), Buffer("first", G, units * width, "float32"),
            Buffer("out", G, units * width, "float32"),
            *[Buffer(b, R, width, "float32") for b in ("r", "sq", "f", "o")])
    graph = GIRGraph("cross", Parallel(units, 4, 1), bufs, _numbered(ops), ("x",), ("out",))
    k0, k1 = MLURenderer().render(graph)
    assert "__bang_mul(" in k1.source  # the square is recomputed in the second kernel
    x = np.random.default_rng(7).standard_normal(units * width).astype(np.float32)
    ins = {"x": x, "first": x * x}
    res, _ = run_bang(k1.source, k1.name, {b: ins[b] for b, _, w in k1.params if not w},
                      {"out": ((units * width,), np.float32)}, k1.grid[0], launcher=f"launch_{k1.name}",
                      args=[b for b, _, _ in k1.params])
    np.testing.assert_allclose(res["out"], 2 * x * x, rtol=1e-6)
    # recomputing is wrong when the data it read was overwritten in between: refused
    clobber = GOp(Move(), (reg("sq"),), (row("x"),))
    bad = replace(graph, ops=_numbered([*ops[:3], clobber, *ops[3:]]))
    with pytest.raises(RenderError, match="overwritten"):
        MLURenderer().render(bad)


def test_max_min_relu_clip_and_reductions_propagate_nan():
    """ONNX Max/Min/Relu/Clip and ReduceMax/ReduceMin give NaN where an operand is NaN (numpy and
    onnxruntime agree); the emitted BANG C uses pf_fmaxf/pf_fminf (never fmaxf/fminf, whose
    NaN-dropping is C's, nor the __bang_* max/min forms) and, run on the emulator, matches numpy:
    NaN at the same places, every other element equal."""
    from powerfusion.scalar import scalar_fn
    num, width, units = 3, 64, 4
    blk = lambda b: MemorySlice(b, G, U * num * width + I * width + J, num, width, "float32")
    reg = lambda b: MemorySlice(b, R, I * width + J, num, width, "float32")
    rows = MemorySlice("r_max", R, I, num, 1, "float32")
    rows_min = MemorySlice("r_min", R, I, num, 1, "float32")
    elementwise = {"max": ("xr", "yr"), "min": ("xr", "yr"), "relu": ("xr",), "clip": ("xr",)}
    params = {"clip": (("lo", -0.5), ("hi", 0.5))}
    ops = [GOp(Move(), (blk("x"),), (reg("xr"),)), GOp(Move(), (blk("y"),), (reg("yr"),))]
    ops += [GOp(Elementwise(fn, params.get(fn, ())), tuple(reg(a) for a in ins), (reg(f"o_{fn}"),))
            for fn, ins in elementwise.items()]
    ops += [GOp(Reduce("max", "width"), (reg("xr"),), (rows,)), GOp(Reduce("min", "width"), (reg("xr"),), (rows_min,))]
    ops += [GOp(Move(), (reg(f"o_{fn}"),), (blk(f"out_{fn}"),)) for fn in elementwise]
    ops += [GOp(Move(), (r,), (MemorySlice(f"out_{r.buffer}", G, U * num + I, num, 1, "float32"),))
            for r in (rows, rows_min)]
    full = [f"out_{fn}" for fn in elementwise]
    bufs = tuple(Buffer(b, G, units * num * width, "float32") for b in ("x", "y", *full))
    bufs += tuple(Buffer(f"out_{b}", G, units * num, "float32") for b in ("r_max", "r_min"))
    bufs += tuple(Buffer(b, R, num * width, "float32") for b in ("xr", "yr", *(f"o_{fn}" for fn in elementwise)))
    bufs += (Buffer("r_max", R, num, "float32"), Buffer("r_min", R, num, "float32"))
    graph = GIRGraph("nan ops", Parallel(units, 4, 1), bufs, _numbered(ops), ("x", "y"),
                     (*full, "out_r_max", "out_r_min"))
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((units, num, width)).astype(np.float32) for _ in range(2))
    x[0, 0, ::7] = np.nan     # NaN in the first operand (and inside rows reduced)
    y[1, 1, ::5] = np.nan     # ... in the second
    x[2, 2, 3] = y[2, 2, 3] = np.nan
    x[3, 1, -1] = np.nan      # last element of a row: a max over it must still be NaN
    res, _, src = run_graph(graph, {"x": x.reshape(-1), "y": y.reshape(-1)})
    for fn, ins in elementwise.items():
        f = scalar_fn(fn)
        want = f.numpy(*[{"xr": x, "yr": y}[a] for a in ins], **dict(params.get(fn, ()))).reshape(-1)
        got = res[f"out_{fn}"]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=fn)
        np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)], err_msg=fn)
    for fn in ("max", "min"):
        want = getattr(np, fn)(x, axis=2).reshape(-1)
        got = res[f"out_r_{fn}"]
        assert np.isnan(want).sum() == 3
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"reduce {fn}")
        np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)], err_msg=f"reduce {fn}")
    body = src.split("#define PF_NAN_OPS", 1)[1].split("#endif", 1)[1]
    dropping = re.findall(r"(?<![\w])(fmaxf|fminf|__bang_maximum|__bang_minimum|__bang_active_relu|__bang_maxpool|"
                          r"__bang_minpool|__bang_argmax|__bang_argmin)\(", body)
    assert not dropping, dropping
    assert "pf_fmaxf(" in body and "pf_fminf(" in body
