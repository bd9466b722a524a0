"""The LLM decode benchmark's device-free parts at a tiny width: the ONNX decoder against a float64
numpy step and onnxruntime; its weight-quantised variants (quantised MatMul by MatMul, the same
model as one `quantize-weights` call) on the PowerFusion CPU session against the dequantised-weight
reference; the batch change; the row order and the table."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_decode_llm import TOLERANCE, markdown, parse_steps, plan, rel_err, summary  # noqa: E402
from decode_llm_model import (DecoderConfig, build_decoder_onnx, make_inputs, make_weights,  # noqa: E402
                              numpy_decode_step, quantize_decoder, with_batch)

TINY = DecoderConfig(hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, batch=1, past=40)


@pytest.fixture(scope="module")
def tiny():
    weights = make_weights(TINY)
    return weights, build_decoder_onnx(TINY, weights)


def _check(outputs, cfg, weights, feeds, tol_y, tol_kv):
    ref, new = numpy_decode_step(cfg, weights, feeds)
    assert rel_err(outputs[0], ref) <= tol_y
    for got, want in zip(outputs[1:], new, strict=True):
        assert got.shape == want.shape
        assert np.max(np.abs(got - want)) <= tol_kv


def test_model_matches_numpy_in_onnxruntime(tiny):
    """fp16 through two layers: 2e-3 of max |y|; the new keys / values (|.| ~ 3) within 1e-2."""
    import onnx
    import onnxruntime as ort
    weights, model = tiny
    onnx.checker.check_model(model)
    feeds = make_inputs(TINY)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    _check(out, TINY, weights, feeds, 2e-3, 1e-2)


def test_batch_change_and_powerfusion_cpu(tiny):
    """The batch-2 model (with_batch) on the PowerFusion CPU session, same tolerances."""
    import powerfusion
    weights, model = tiny
    cfg = dataclasses.replace(TINY, batch=2)
    feeds = make_inputs(cfg)
    sess = powerfusion.InferenceSession(with_batch(model, 2).SerializeToString(), target="cpu")
    _check(sess.run(None, feeds), cfg, weights, feeds, 2e-3, 1e-2)
    with_batch(model, 1)


def test_quantise_per_matmul_equals_one_call(tiny):
    from powerfusion.cli.cmd_quantize_weights import quantize_weights_model
    _, model = tiny
    whole, op = quantize_weights_model(model, "int4", None, None)
    split, op2, _ = quantize_decoder(model, "int4", None, processes=2)
    assert (op, op2) == ("MatMulNBits", "MatMulNBits")
    assert sum(n.op_type == "MatMulNBits" for n in split.graph.node) == 7 * TINY.layers
    assert whole.SerializeToString() == split.SerializeToString()


@pytest.mark.parametrize("dtype,act,variant,op", [("int4", None, "int4", "MatMulNBits"),
                                                  ("nf4", None, "nf4", "MatMulLowBit"),
                                                  ("int2", "int8", "int2a8", "MatMulLowBit")])
def test_quantised_on_powerfusion_cpu(tiny, dtype, act, variant, op):
    """Each weight type against the dequantised-weight reference at the benchmark's tolerance
    (W2A8's int8 activation rounding is not in the reference: 5e-2)."""
    import powerfusion
    weights, model = tiny
    q, got_op, dequantised = quantize_decoder(model, dtype, act)
    assert got_op == op and sorted(dequantised) == sorted(k for k in weights if "norm" not in k)
    dq = {**weights, **dequantised}
    assert all(np.any(dq[k] != weights[k]) for k in dequantised)
    feeds = make_inputs(TINY)
    out = powerfusion.InferenceSession(q.SerializeToString(), target="cpu").run(None, feeds)
    _check(out, TINY, dq, feeds, TOLERANCE[variant], 0.3 if act else 1e-2)


def test_plan_puts_the_goal_first():
    steps = plan([1, 16], ["int4", "nf4"])
    assert steps[:5] == [("torch-compile", 1, "fp16"), ("torch-eager", 1, "fp16"), ("powerfusion", 1, "int4"),
                         ("torch-compile", 16, "fp16"), ("powerfusion", 16, "int4")]
    assert steps[5:9] == [("powerfusion", 1, "fp16"), ("torch-eager", 16, "fp16"), ("powerfusion", 16, "fp16")] + \
        [("powerfusion", 1, "nf4")]
    assert sorted(steps) == sorted(set(steps)) and len(steps) == 2 * (2 + 3)
    assert steps[-2:] == [("powerfusion", 1, "nf4"), ("powerfusion", 16, "nf4")]


def test_steps_parse_and_refuse():
    assert parse_steps("1:torch-compile,16:int2a8,1:fp16") == [("torch-compile", 1, "fp16"),
                                                              ("powerfusion", 16, "int2a8"), ("powerfusion", 1, "fp16")]
    with pytest.raises(SystemExit, match="'1:int3'"):
        parse_steps("1:torch-eager,1:int3")


def test_ratios_stay_within_a_run_and_the_table():
    rows = [{"run": 0, "batch": 1, "dtype": "fp16", "impl": "torch-compile", "device_time_s": 2e-4, "latency_s": 3e-4},
            {"run": 0, "batch": 1, "dtype": "int4", "impl": "powerfusion", "device_time_s": 1e-4, "latency_s": 2e-4,
             "kernels": 9, "max_rel_err": 1e-3, "tolerance": 2e-2},
            {"run": 1, "batch": 1, "dtype": "fp16", "impl": "torch-compile", "device_time_s": 4e-4, "latency_s": 5e-4},
            {"run": 1, "batch": 1, "dtype": "nf4", "impl": "powerfusion", "device_time_s": 1e-4, "latency_s": 2e-4},
            {"run": 1, "batch": 16, "dtype": "nf4", "impl": "powerfusion", "error": "not run: the 270 s budget was spent"}]
    summary(rows)
    assert [r.get("vs_compile") for r in rows] == [1.0, 0.5, 1.0, 0.25, None]
    meta = {"date": "d", "git_commit": "c", "config": dataclasses.asdict(TINY), "weight_bytes": {"fp16": 2e6},
            "runs": [{"date": "d0", "git_commit": "c0"}, {"date": "d1", "git_commit": "c1"}]}
    text = markdown(rows, meta)
    assert "| 0 | 1 | W4A16 g128 | powerfusion | 100.0 | 200.0 | 0.500 | 9 | 1.0e-03 (2e-02) |" in text
    assert "| 1 | 16 | NF4 g128 | powerfusion | - | - | - | - | not run: the 270 s budget was spent |" in text
    assert "0: d0, commit c0; 1: d1, commit c1" in text
