"""Contiguous loads off the vector grid (backends/cstyle/realign.py): rendered as two aligned
vector loads and a selection; the offset split; nvcc compiles the kernel; on a GPU it matches the
interpreter, padding masks included."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import require_tool  # noqa: E402
from powerfusion.backends.cstyle.kernel import _aligned  # noqa: E402
from powerfusion.backends.cstyle.realign import realigned, split_offset  # noqa: E402
from powerfusion.backends.cuda.renderer import CUDARenderer  # noqa: E402
from powerfusion.gir.expr import I, J, U  # noqa: E402
from powerfusion.gir.interpreter import run_gir  # noqa: E402
from powerfusion.gir.ir import Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move, Parallel  # noqa: E402

ROW = 56


def test_split_offset_and_realigned():
    assert split_offset(U * 56 + J - 57) == (U * 56 + J, -57)
    base, shift = realigned(U * 56 + J - 57, 4, 56 * 10, _aligned)
    assert shift == 3 and split_offset(base)[1] == -60
    assert realigned(U * 56 + J - 56, 4, 560, _aligned) is None     # on the grid already
    assert realigned(U * 56 + J - 57, 4, 562, _aligned) is None     # the buffer is not whole vectors
    assert realigned(U * 54 + J - 57, 4, 540, _aligned) is None     # rows off the grid


def shifted_windows(rows: int = 6) -> GIRGraph:
    """y[r, c] = x[r, c - 1] + x[r, c] + x[r, c + 1] over rows of 56 (zero padded): one unit
    per row, vec 4 (14 lanes busy), the three taps each a contiguous load, two of them off the
    grid."""
    W = 128
    col = J
    tail = col.lt(ROW)
    ops, bufs = [], [Buffer("x", Level.GLOBAL, rows * ROW, "float32"), Buffer("y", Level.GLOBAL, rows * ROW, "float32")]
    regs = []
    for k, d in enumerate((-1, 0, 1)):
        valid = tail & (col + d).ge(0) & (col + d).lt(ROW)
        src = MemorySlice("x", Level.GLOBAL, U * ROW + J + d, 1, W, "float32", 4, valid)
        r = MemorySlice(f"t{k}", Level.REGISTER, I * W + J, 1, W, "float32", 4)
        bufs.append(Buffer(f"t{k}", Level.REGISTER, W, "float32"))
        ops.append(GOp(Move(), (src,), (r,)))
        regs.append(r)
    s01 = MemorySlice("s01", Level.REGISTER, I * W + J, 1, W, "float32", 4)
    s = MemorySlice("s", Level.REGISTER, I * W + J, 1, W, "float32", 4)
    bufs += [Buffer("s01", Level.REGISTER, W, "float32"), Buffer("s", Level.REGISTER, W, "float32")]
    ops += [GOp(Elementwise("add"), (regs[0], regs[1]), (s01,)), GOp(Elementwise("add"), (s01, regs[2]), (s,)),
            GOp(Move(), (s,), (MemorySlice("y", Level.GLOBAL, U * ROW + J, 1, W, "float32", 4, tail),))]
    return GIRGraph("shift", Parallel(rows, 2, 32), tuple(bufs), tuple(ops), ("x",), ("y",))


def test_shifted_taps_render_as_aligned_vector_pairs(tmp_path):
    (ks,) = CUDARenderer().render(shifted_windows())
    assert ks.source.count("t + 4") == 2 and ks.source.count("a0 + 4]") == 2
    require_tool("nvcc")
    path = tmp_path / "k.cu"
    path.write_text(ks.source)
    for arch in ("sm_80", "sm_90"):
        proc = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(tmp_path / "k.cubin"),
                               str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_interpreter_reference_of_the_shifted_taps():
    x = np.random.default_rng(0).standard_normal((6, ROW)).astype(np.float32)
    xp = np.pad(x, ((0, 0), (1, 1)))
    got = run_gir(shifted_windows(), {"x": x.reshape(-1)})["y"].reshape(6, ROW)
    np.testing.assert_allclose(got, xp[:, :-2] + xp[:, 1:-1] + xp[:, 2:], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_shifted_taps_on_gpu_match_the_interpreter():
    import cupy
    from powerfusion.backends.cuda.executor import GIRExecutor
    g = shifted_windows()
    x = np.random.default_rng(1).standard_normal(6 * ROW).astype(np.float32)
    arrays = {"x": cupy.asarray(x), "y": cupy.full(6 * ROW, np.nan, np.float32)}
    GIRExecutor(g)(arrays)
    np.testing.assert_allclose(cupy.asnumpy(arrays["y"]), run_gir(g, {"x": x})["y"], rtol=1e-6, atol=1e-6)
