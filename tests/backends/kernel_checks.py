"""Checks shared by the template-kernel tests: every kernel of a GIR graph compiles with nvcc,
and a graph run on the GPU matches the GIR interpreter."""
from __future__ import annotations

import subprocess

import numpy as np

from powerfusion.backends.cuda.renderer import CUDARenderer
from powerfusion.gir.interpreter import np_dtype, run_gir

# float32: the same sum in another order with the device's fused multiply-adds; float16: that,
# rounded once to fp16
TOL = {"float32": (2e-5, 2e-5), "float16": (1e-3, 1e-3)}


def assert_nvcc_compiles(graphs, arch: str, tmp_path, source_check=None) -> None:
    """`graphs`: (label, case, gir) triples; each kernel source (checked by `source_check` if
    given) compiles to a cubin for `arch`."""
    for label, _, gir in graphs:
        for ks in CUDARenderer().render(gir):
            if source_check is not None:
                assert source_check(ks.source), label
            path = tmp_path / f"{ks.name}.cu"
            path.write_text(ks.source)
            proc = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(tmp_path / "k.cubin"),
                                   str(path)], capture_output=True, text=True)
            assert proc.returncode == 0, f"{label}:\n{proc.stderr}"


def assert_gpu_matches_interpreter(label: str, gir, feeds: dict) -> None:
    """Run `gir` on the GPU with `feeds` (by GIR buffer), outputs poisoned with NaN first so
    unwritten elements show, and compare every output with the interpreter's (TOL by dtype)."""
    import cupy
    from powerfusion.backends.cuda.executor import GIRExecutor, device_dtype
    arrays = {n: cupy.asarray(np.ascontiguousarray(feeds[n]).reshape(-1).view(device_dtype(gir.buffer(n).dtype)))
              for n in gir.inputs}
    for n in gir.outputs:
        b = gir.buffer(n)
        arrays[n] = cupy.asarray(np.full(b.size, np.nan, np_dtype(b.dtype)).view(device_dtype(b.dtype)))
    GIRExecutor(gir)(arrays)
    want = run_gir(gir, feeds)
    for n in gir.outputs:
        rtol, atol = TOL[gir.buffer(n).dtype]
        got = cupy.asnumpy(arrays[n]).view(np_dtype(gir.buffer(n).dtype))
        np.testing.assert_allclose(got.astype(np.float32), want[n].astype(np.float32), rtol, atol, err_msg=label)
