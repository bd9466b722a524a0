"""The shared C renderer: every hand-built GIR case renders, compiles with nvcc (sm_80,
sm_90) and hipcc (gfx908, gfx90a), and on a GPU matches the numpy interpreter.

Tolerances: fp32 2e-5 relative/absolute (reduction order differs from numpy's);
fp16 and bf16 outputs compared in fp32 within one unit in the last place of the storage
type (1e-3 and 8e-3 relative) plus 1e-5 absolute."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gir_cases import all_cases  # noqa: E402
from conftest import require_tool  # noqa: E402
from cuda_emulator import emulatable, run_kernel  # noqa: E402

from powerfusion.backends.cuda.renderer import CUDARenderer  # noqa: E402
from powerfusion.backends.hip.renderer import HIPRenderer  # noqa: E402
from powerfusion.names import sanitize  # noqa: E402
from powerfusion.gir.interpreter import np_dtype, run_gir  # noqa: E402

TOL = {"float32": (2e-5, 2e-5), "float16": (1e-3, 1e-5), "bfloat16": (8e-3, 1e-5)}
CASES = all_cases(32)
HIP_CASES = all_cases(64)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.graph.name)
def test_interpreter_matches_reference(case):
    out = run_gir(case.graph, case.feeds)
    for name, ref in case.reference(case.feeds).items():
        rtol, atol = TOL.get(str(ref.dtype), (0, 0))
        np.testing.assert_allclose(out[name].astype(np.float32), ref.astype(np.float32).reshape(-1), rtol, atol)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sources_compile(arch, tmp_path):
    require_tool("nvcc")
    for case in CASES:
        for ks in CUDARenderer().render(case.graph):
            path = tmp_path / f"{ks.name}.cu"
            path.write_text(ks.source)
            proc = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(tmp_path / "k.cubin"),
                                   str(path)], capture_output=True, text=True)
            assert proc.returncode == 0, f"{path}:\n{proc.stderr}"


@pytest.mark.parametrize("arch", ["gfx908", "gfx90a"])
def test_hip_sources_compile(arch, tmp_path):
    require_tool("hipcc")
    env = {**os.environ, "HIP_PLATFORM": "amd"}
    for case in HIP_CASES:
        for ks in HIPRenderer().render(case.graph):
            path = tmp_path / f"{ks.name}.hip"
            path.write_text(ks.source)
            proc = subprocess.run(["hipcc", f"--offload-arch={arch}", "--genco", "-o", str(tmp_path / "k.co"),
                                   str(path)], capture_output=True, text=True, env=env)
            assert proc.returncode == 0, f"{path}:\n{proc.stderr}"


@pytest.mark.parametrize("case", [c for c in CASES if all(emulatable(k.source, k.params)
                                                           for k in CUDARenderer().render(c.graph))],
                         ids=lambda c: c.graph.name)
def test_cuda_source_emulated_on_cpu_matches_interpreter(case, tmp_path):
    """The CUDA source itself, threads run one after another by the host compiler's build (the
    cases whose threads never cooperate): its indexing and masks, vector paths included."""
    require_tool("g++")
    g = case.graph
    arrays = {n: np.ascontiguousarray(case.feeds[n]).reshape(-1).copy() for n in g.inputs}
    arrays |= {n: np.full(g.buffer(n).size, np.nan, np_dtype(g.buffer(n).dtype)) for n in g.outputs}
    arrays |= {n: np.asarray(v).reshape(-1).copy() for n, v in g.constants}
    for ks in CUDARenderer().render(g):
        run_kernel(ks, arrays, tmp_path)
    want = run_gir(g, case.feeds)
    for n in g.outputs:
        rtol, atol = TOL.get(g.buffer(n).dtype, (0, 0))
        np.testing.assert_allclose(arrays[n], want[n], rtol, atol)


def test_emulated_cases_include_the_masked_register_moves():
    """The emulator test above must cover the two-masked-moves-into-one-tile case (Swin-T's roll)."""
    names = [c.graph.name for c in CASES if all(emulatable(k.source, k.params) for k in CUDARenderer().render(c.graph))]
    assert any(n.startswith("roll_rows_add") for n in names), names


def test_model_names_are_sanitised():
    assert sanitize("a/b:0") == "a_b_0"
    assert sanitize("0bad") == "t_0bad"
    assert sanitize('x"; system("rm") //') .isidentifier()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.graph.name)
def test_gpu_matches_interpreter(case):
    import cupy
    from powerfusion.backends.cuda.executor import GIRExecutor
    g = case.graph
    ex = GIRExecutor(g)
    from powerfusion.backends.cuda.executor import device_dtype
    arrays = {n: cupy.asarray(np.ascontiguousarray(case.feeds[n]).reshape(-1).view(device_dtype(g.buffer(n).dtype)))
              for n in g.inputs}
    for n in g.outputs:  # poisoned so unwritten elements show
        b = g.buffer(n)
        poison = np.full(b.size, np.nan if np_dtype(b.dtype).kind == "f" or b.dtype == "bfloat16" else -7,
                         dtype=np_dtype(b.dtype))
        arrays[n] = cupy.asarray(poison.view(device_dtype(b.dtype)))
    ex(arrays)
    want = run_gir(g, case.feeds)
    for n in g.outputs:
        rtol, atol = TOL.get(g.buffer(n).dtype, (0, 0))
        got = cupy.asnumpy(arrays[n]).view(np_dtype(g.buffer(n).dtype))
        np.testing.assert_allclose(got.astype(np.float32), want[n].astype(np.float32), rtol, atol)
