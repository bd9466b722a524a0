"""Models written by `powerfusion quantize-weights`, every weight type, through
InferenceSession(target="cuda") against the CPU session (float64 numpy reference of the same
stored codes and scales) at M = 1 (the GEMV) and M = 5 / 6.

Tolerance (max |y - ref| / max |ref|): 5e-3 (fp16 activations and scales, fp32 accumulation;
fp32 models' activations are rounded to fp16 for the kernel); int8 activations 1e-2 (the device
rounds the fp16 activations to int8, the reference the model's own, so a code may differ by one)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

import powerfusion as pf

from .onnx_models import feed, mlp_model, rel_err
from .test_quantize_weights_cli import CASES, _quantize, _single

pytestmark = pytest.mark.gpu


def _check(model, tol):
    x = feed(model)
    ref = pf.InferenceSession(model, target="cpu").run(None, x)[0]
    sess = pf.InferenceSession(model, target="cuda")
    runner = sess._executor
    assert runner.typed, "no typed GEMM in the CUDA plan"
    for t in runner.tensors.values():     # poison every planned buffer: unwritten elements show
        t.view(np.uint8)[...] = 0xFF
    for run in ("first", "second"):
        y = sess.run(None, x)[0]
        assert y.dtype == ref.dtype and np.isfinite(y.astype(np.float32)).all(), run
        assert rel_err(y, ref) <= tol, f"{run} run: {rel_err(y, ref):.2e}"
    if all(mm.fused for mm, _, _ in runner.typed.values()):
        runner.use_cuda_graph = True
        for run in ("capturing", "replay"):
            y = runner(x)[model.graph.output[0].name]
            assert rel_err(y, ref) <= tol, f"CUDA graph {run}"


@pytest.mark.parametrize("M,dtype", [(1, TensorProto.FLOAT16), (5, TensorProto.FLOAT)])
@pytest.mark.parametrize("wtype,extra", CASES)
def test_quantized_single_matmul_cuda(tmp_path, wtype, extra, M, dtype):
    model, _ = _single(K=1000, N=200, M=M, dtype=dtype)
    q = _quantize(tmp_path, model, "--dtype", wtype, *extra)
    _check(q, 1e-2 if "--act" in extra else 5e-3)


@pytest.mark.parametrize("wtype,extra", [("mxfp4", ()), ("fp8_e4m3", ()), ("int2", ("--act", "int8"))])
def test_quantized_mlp_cuda(tmp_path, wtype, extra):
    q = _quantize(tmp_path, mlp_model(TensorProto.FLOAT16), "--dtype", wtype, *extra)
    _check(q, 1e-2 if "--act" in extra else 5e-3)
