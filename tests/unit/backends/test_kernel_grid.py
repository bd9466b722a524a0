"""Each kernel of a multi-kernel GIR graph launches only the groups its gOperators' guards
allow (a softmax over 48 rows after a GEMV over thousands of units gets 12 blocks, not the
GEMV's grid)."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from powerfusion.backends.cstyle.kernel import FEW_UNITS, unit_bound
from powerfusion.gir.expr import I, J, U

B, H, T, D = 2, 3, 256, 64


def test_unit_bound_reads_conjunctions_of_u_comparisons():
    assert unit_bound(U.lt(48)) == 48
    assert unit_bound(U.le(47)) == 48
    assert unit_bound(U.lt(48) & J.lt(56)) == 48
    assert unit_bound(J.lt(56) & (U.lt(100) & U.lt(30))) == 30
    assert unit_bound(J.lt(56)) is None
    assert unit_bound((U % 4).lt(1)) is None
    assert unit_bound(U.lt(48) | I.lt(2)) is None     # a disjunction bounds nothing


def _attention() -> onnx.ModelProto:
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    g = helper.make_graph(nodes, "decode", [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, H, 1, D]),
                                            helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, H, T, D]),
                                            helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, H, T, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, H, 1, D])],
                          [numpy_helper.from_array(np.array(1 / math.sqrt(D), np.float32), "scale")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_kernel_grids_cover_exactly_the_guarded_units():
    from powerfusion.compiler import compile_model
    plan = compile_model(_attention(), "cuda")
    for step in plan.kernel_steps:
        P = step.gir.parallel
        for ops, k in zip(step.gir.kernels(), step.kernels):
            bounds = [unit_bound(o.guard) if o.guard is not None else None for o in ops
                      if type(o.args).__name__ != "Sync"]
            need = P.units if None in bounds else max(min(b, P.units) for b in bounds)
            upg = k.block[0] // P.lanes
            # few units and nothing shared within a group: one unit per group spreads them over SMs
            assert upg == (1 if need <= FEW_UNITS and not k.shared_bytes else P.units_per_group), (k.name, need)
            assert k.grid[0] == -(-need // upg), (k.name, k.grid, need)
            assert f"const bool unit_live = u < {need};" in k.source


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_decode_attention_with_per_kernel_grids_matches_numpy(fused, monkeypatch):
    """The GIR plan (attention fusion switched off), and the split-KV kernel it is fused into
    on CUDA (backends/cuda/decode_attention.py)."""
    from powerfusion import InferenceSession
    if not fused:
        monkeypatch.setattr("powerfusion.frontend.attention.fuse_attention", lambda graph: 0)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, H, 1, D), (B, H, T, D), (B, H, T, D)))
    sess = InferenceSession(_attention(), target="cuda")
    for t in sess._executor.tensors.values():   # poison: unwritten elements show
        t.view(np.uint8)[...] = 0xFF
    y = sess.run(None, {"q": q, "k": k, "v": v})[0]
    s = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) / math.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)   # fp32, sums of 256 terms


def test_transpose_of_k_folds_into_the_matmul_and_the_scale_stays_in_registers():
    """In the GIR plan (CUDA with attention fusion off, as other targets get it), k^T is read
    through MatMul(trans_b) (no Transpose node), and the scalar scale's broadcast is placed
    after the q.K^T kernel's sync, next to its Mul, so no kernel writes it to global memory."""
    from powerfusion import basic as B
    from powerfusion.gir.ir import Level
    from powerfusion.pipeline.driver import CompileOptions, compile
    plan = compile(_attention(), "cuda", CompileOptions(attention=False))
    nodes = plan.graph.nodes
    assert not any(isinstance(n.op, B.Transpose) for n in nodes)
    assert [n.op.trans_b for n in nodes if isinstance(n.op, B.MatMul)] == [True, False]
    scale = {n.name for n in nodes if isinstance(n.op, B.Broadcast) and n.inputs[0] in plan.graph.constants}
    assert scale
    for step in plan.kernel_steps:
        for op in step.gir.ops:
            if op.origin in scale:
                assert all(s.level != Level.GLOBAL for s in op.outputs), op.describe()
