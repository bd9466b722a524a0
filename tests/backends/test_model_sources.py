"""Every kernel emitted for the committed small models compiles: CUDA with nvcc for sm_80 and
sm_90, HIP with hipcc for gfx908 and gfx90a. All kernels of one model go into one translation
unit, so each model costs one compiler run per architecture."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted((ROOT / "models" / "small").glob("*.onnx"))

def _one_unit(plan) -> str:
    sources = [k.source for s in plan.kernel_steps for k in s.kernels]
    assert sources, "no kernels emitted"
    return "\n".join(sources)


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_cuda_kernels_compile(model, tmp_path, compiled):
    nvcc = require_tool("nvcc")
    src = tmp_path / f"{model.stem}.cu"
    src.write_text(_one_unit(compiled(model.stem, "cuda")))
    for arch in ("sm_80", "sm_90"):
        proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(tmp_path / "k.cubin"), str(src)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{src} ({arch}):\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_hip_kernels_compile(model, tmp_path, compiled):
    hipcc = require_tool("hipcc")
    src = tmp_path / f"{model.stem}.hip"
    src.write_text(_one_unit(compiled(model.stem, "hip")))
    env = {**os.environ, "HIP_PLATFORM": "amd"}
    for arch in ("gfx908", "gfx90a"):
        proc = subprocess.run([hipcc, f"--offload-arch={arch}", "--genco", "-o", str(tmp_path / "k.co"), str(src)],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, f"{src} ({arch}):\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_kernels_compile(dtype, tmp_path):
    """16-bit models' kernels (masked moves select between a half value and a fill) compile."""
    import onnx
    from test_cuda_dtypes import to_low_precision
    from powerfusion.compiler import compile_model
    nvcc = require_tool("nvcc")
    model = to_low_precision(onnx.load(ROOT / "models" / "small" / "bert_small.onnx"), dtype)
    src = tmp_path / f"bert_small_{dtype}.cu"
    src.write_text(_one_unit(compile_model(model, "cuda")))
    proc = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-std=c++17", "-o", str(tmp_path / "k.cubin"), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{src}:\n{proc.stderr[-4000:]}"
