"""Quantized ONNX models through InferenceSession(target="cuda"): com.microsoft.MatMulNBits (from
quantize_weights; also with fractional float zero points and a bias) and DequantizeLinear -> MatMul,
on every typed-GEMM path the session can pick (CUDA-core GEMV, tensor-core mma, dequantise +
cuBLAS), with leading batch dimensions and M not a multiple of any tile
(tests/ttile/onnx_models.py lists the models and the path each must take).

Reference and tolerance (max |y - ref| / max |ref|): onnxruntime CPU, 5e-3 for fp16 and fp32
models (fp16 activations and scales, fp32 accumulation; an fp32 model's activations are rounded
to fp16 for the kernel, its output is written in fp32); bf16 models (onnxruntime's CPU provider
has no bf16 MatMulNBits): the CPU session (float64 numpy), 3e-2."""
from __future__ import annotations

import numpy as np
import pytest

import powerfusion as pf

from .onnx_models import CUDA_BF16_MODELS, CUDA_SESSION_MODELS, feed, ort_run, rel_err

pytestmark = pytest.mark.gpu


def _check_cuda(model, x, ref, kinds, tol):
    sess = pf.InferenceSession(model, target="cuda")
    runner = sess._executor
    assert {mm.kind for mm, _, _ in runner.typed.values()} == kinds
    for t in runner.tensors.values():   # poison every planned buffer: unwritten elements show
        t.view(np.uint8)[...] = 0xFF
    for run in ("first", "second"):     # the second reuses the uploaded weights and scratch buffers
        y = sess.run(None, x)[0]
        assert y.dtype == ref.dtype and y.shape == ref.shape
        assert np.isfinite(y.astype(np.float32)).all(), f"{run} run: unwritten or non-finite elements"
        assert rel_err(y, ref) <= tol, f"{run} run: relative error {rel_err(y, ref):.2e}"
    if "dequant" not in kinds:          # CuPy refuses cuBLAS calls while a stream is captured
        runner.use_cuda_graph = True
        for run in ("capturing", "second"):  # the first call captures (after a warm-up run), then replays
            replay = runner(x)[model.graph.output[0].name]
            assert rel_err(replay, ref) <= tol, f"CUDA graph replay, {run} call"


@pytest.mark.parametrize("name", sorted(CUDA_SESSION_MODELS))
def test_quantized_model_cuda_matches_onnxruntime(name):
    pytest.importorskip("onnxruntime")
    build, kinds = CUDA_SESSION_MODELS[name]
    m = build()
    x = feed(m)
    _check_cuda(m, x, ort_run(m, x), kinds, 5e-3)


@pytest.mark.parametrize("name", sorted(CUDA_BF16_MODELS))
def test_bf16_quantized_model_cuda_matches_cpu_session(name):
    build, kinds = CUDA_BF16_MODELS[name]
    m = build()
    x = feed(m)
    _check_cuda(m, x, pf.InferenceSession(m, target="cpu").run(None, x)[0], kinds, 3e-2)
