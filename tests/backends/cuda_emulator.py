"""Run a rendered CUDA kernel on the CPU: the source compiled as C++ by the host compiler, every
thread of every block run one after another. That is exact only for kernels whose threads never
cooperate (no warp shuffles, no shared memory, no block syncs), which `emulatable` checks; it
lets the CUDA renderer's indexing and masking (vector paths included) be tested without a GPU.
float32 and integer buffers only (the half types need CUDA's headers)."""
from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np

_PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <algorithm>
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct pf_dim3 { unsigned x, y, z; };
static pf_dim3 blockIdx, threadIdx, blockDim, gridDim;
using std::min; using std::max;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__
#define CUDART_INF_F INFINITY
"""
_CTYPES = {"float32": "float", "int64": "long long", "int32": "int", "bool": "bool", "uint8": "unsigned char"}
_COOPERATING = ("__shfl", "__syncthreads", "__shared__", "atomic")


def emulatable(source: str, params) -> bool:
    return not any(k in source for k in _COOPERATING) and all(dt in _CTYPES for _, dt, _ in params)


def run_kernel(ks, arrays: dict[str, np.ndarray], workdir: Path) -> None:
    """Run KernelSource `ks` over numpy `arrays` (by parameter name, written in place)."""
    body = "\n".join(line for line in ks.source.splitlines()
                     if not re.match(r"\s*#\s*(include|pragma nv_diag)", line))
    args = ", ".join(f"({_CTYPES[dt]}*)a[{k}]" for k, (_, dt, _) in enumerate(ks.params))
    driver = (f'extern "C" void pf_emulate(void** a, unsigned grid, unsigned block) {{\n'
              f"  gridDim = {{grid, 1, 1}}; blockDim = {{block, 1, 1}};\n"
              f"  for (unsigned b = 0; b < grid; ++b) for (unsigned t = 0; t < block; ++t) {{\n"
              f"    blockIdx = {{b, 0, 0}}; threadIdx = {{t, 0, 0}}; {ks.name}({args}); }}\n}}\n")
    src, lib = workdir / f"{ks.name}.cpp", workdir / f"{ks.name}.so"
    src.write_text(_PRELUDE + body + "\n" + driver)
    proc = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{src}: {proc.stderr[:2000]}")
    fn = ctypes.CDLL(str(lib)).pf_emulate
    ptrs = (ctypes.c_void_p * len(ks.params))(*(arrays[n].ctypes.data for n, _, _ in ks.params))
    fn(ptrs, ctypes.c_uint(int(ks.grid[0])), ctypes.c_uint(int(ks.block[0])))
