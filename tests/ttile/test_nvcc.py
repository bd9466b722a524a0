"""Generated kernels compile with nvcc for sm_80 and sm_90 (skipped without nvcc).

The full set, 173 kernels: every combination as CUDA-core GEMV at M = 1 (output in the
combination's type) and at M = 4 (several activation rows per block, fp32 output), as the
tensor-core kernel (M = 32, group 128) and as the dequantise kernel. By default a subset of
83 runs: every W type x A type x kernel family, the zero modes of the unsigned types rotated
so that each family meets all three; the other 90 are marked slow. Both go through nvcc in
two translation units (one per core), each kernel in its own namespace with its macros
undefined after it, so the header parse and process start that dominate a one-kernel call
are paid once (one call per kernel took 312 s for the 128 kernels of an older, smaller set).
A failing unit is recompiled kernel by kernel to name the culprits.
`test_representative_kernels_compile` compiles four sources exactly as NVRTC receives them."""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from powerfusion.ttile.codegen import combinations
from powerfusion.ttile.matmul import Matmul

pytestmark = pytest.mark.usefixtures("nvcc")   # conftest.require_tool: skips, or fails where required
# one per kernel family (gemv, gemv with dp4a, mma, dequantise), as NVRTC receives them
REPRESENTATIVE = [("fp16", "int4", None, "fp16", 1), ("bf16", "int4", None, "bf16", 32),
                  ("int8", "int4", None, "int32", 4), ("fp16", "uint8", "quantized", "fp16", 512)]
HEADERS = {"cuda_fp16.h", "cuda_bf16.h"}
_INCLUDE = re.compile(r"^#include <([^>]+)>\s*$", re.M)
_DEFINE = re.compile(r"^#define (\w+)", re.M)


def _matmul(a, w, zm, out, M, **kw):
    return Matmul(M, 200, 1000, a, w, out_dtype=out, group_size=None if w.startswith("mx") else 64,
                  zeros_mode=zm, with_bias=True, **kw)


def _nvcc(path, out):
    cmd = ["nvcc", "-std=c++17", "-fatbin", "-gencode", "arch=compute_80,code=sm_80",
           "-gencode", "arch=compute_90,code=sm_90", "-Werror", "all-warnings", "-o", str(out), str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr[-2000:]


def _compile_each(tmp_path, kernels):
    def one(mm):
        src = tmp_path / f"{mm.name}.cu"
        src.write_text(mm.source)
        return (mm.name, *_nvcc(src, src.with_suffix(".fatbin")))
    with ThreadPoolExecutor(2) as pool:
        return [(n, err) for n, rc, err in pool.map(one, kernels) if rc]


def translation_unit(kernels) -> str:
    """Several kernel sources in one file: headers once, each body in a namespace of its own."""
    parts = ["".join(f"#include <{h}>\n" for h in sorted(HEADERS))]
    for i, mm in enumerate(kernels):
        assert set(_INCLUDE.findall(mm.source)) <= HEADERS, mm.name
        body = _INCLUDE.sub("", mm.source)
        undef = "".join(f"#undef {m}\n" for m in sorted(set(_DEFINE.findall(body))))
        parts.append(f"namespace tu{i} {{\n{body}\n}}  // namespace tu{i}\n{undef}")
    return "".join(parts)


def _compile_batched(tmp_path, kernels, units=2):
    assert len({mm.name for mm in kernels}) == len(kernels)
    batches = [kernels[i::units] for i in range(units)]

    def unit(i):
        src = tmp_path / f"unit{i}.cu"
        src.write_text(translation_unit(batches[i]))
        return _nvcc(src, src.with_suffix(".fatbin"))[0]
    with ThreadPoolExecutor(units) as pool:
        failed_units = [i for i, rc in enumerate(pool.map(unit, range(units))) if rc]
    failed = [f for i in failed_units for f in _compile_each(tmp_path, batches[i])]
    assert not failed_units and not failed, failed[:3] or f"units {failed_units} failed, each kernel alone compiles"


def test_representative_kernels_compile(tmp_path):
    kernels = [_matmul(*c) for c in REPRESENTATIVE] + [_matmul("fp16", "int2", None, "fp16", 1, rows_per_warp=8, ksplit=4)]
    assert len({mm.name for mm in kernels}) == len(kernels)
    failed = _compile_each(tmp_path, kernels)
    assert not failed, failed[:3]


def every_kernel() -> list[Matmul]:
    kernels = {}
    for a, w, zm, out in combinations():
        variants = [_matmul(a, w, zm, out, 1), _matmul(a, w, zm, "fp32", 4)]
        if a != "int8":
            variants.append(_matmul(a, w, zm, out, 1024))   # the dequantise kernel
            if not w.startswith("mx"):
                variants.append(Matmul(32, 200, 1000, a, w, out_dtype=out, zeros_mode=zm, with_bias=True,
                                       group_size=128, kernel="mma"))
        kernels.update((mm.name, mm) for mm in variants)
    return list(kernels.values())


# the default subset: one zero mode per unsigned type, rotated so each family meets all three
ZERO_MODE_SHOWN = {"uint8": "quantized", "uint4": "original", "uint2": "rescale", "uint1": "quantized"}
GEMV_M4_SHOWN = {("fp16", "int4"), ("bf16", "uint4"), ("int8", "int2")}


def in_default_subset(mm: Matmul) -> bool:
    s = mm.spec
    if s.zeros_mode != ZERO_MODE_SHOWN.get(s.W_dtype):
        return False
    return not (mm.kind == "gemv" and mm.M == 4) or (s.A_dtype, s.W_dtype) in GEMV_M4_SHOWN


def test_every_kernel_is_in_the_full_set():
    kinds, default = {}, {}
    for mm in every_kernel():
        key = (mm.spec.A_dtype, mm.spec.W_dtype)
        kinds.setdefault(key + (mm.spec.zeros_mode,), set()).add((mm.kind, mm.M))
        if in_default_subset(mm):
            default.setdefault(key, set()).add(mm.kind)
    for a, w, zm, _ in combinations():
        want = {("gemv", 1), ("gemv", 4)} | ({("dequant", 1024)} if a != "int8" else set()) | \
            ({("mma", 32)} if a != "int8" and not w.startswith("mx") else set())
        assert kinds[(a, w, zm)] == want, (a, w, zm)
        assert default[(a, w)] == {k for k, _ in want}, (a, w)   # each W x A x family by default


def test_every_wtype_atype_and_family_compiles(tmp_path):
    """The default subset (~80 kernels, ~50 s on 2 cores): every W type x A type x kernel family."""
    _compile_batched(tmp_path, [mm for mm in every_kernel() if in_default_subset(mm)])


@pytest.mark.slow
def test_every_other_kernel_compiles(tmp_path):
    """The rest of the full set: the other zero modes, GEMV at M = 4 with fp32 output."""
    _compile_batched(tmp_path, [mm for mm in every_kernel() if not in_default_subset(mm)])


@pytest.mark.parametrize("a,out", [("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "fp32")])
def test_int8_activation_row_kernels_compile(tmp_path, a, out):
    """The per-row int8 rounding and rescale kernels of MatMulLowBit's act_dtype int8."""
    from powerfusion.ttile.act_int8 import rows_source
    tag, src = rows_source(a, out)
    path = tmp_path / f"rows_{tag}.cu"
    path.write_text(src)
    rc, err = _nvcc(path, path.with_suffix(".fatbin"))
    assert rc == 0, err


@pytest.mark.parametrize("a,w,out", [("fp16", "int4", "fp16"), ("int8", "int2", "fp16"), ("bf16", "nf4", "bf16")])
@pytest.mark.parametrize("stages,batch", [(3, 1), (2, 4), (3, 2)])
def test_pipelined_gemv_compiles(tmp_path, a, w, out, stages, batch):
    """The CUDA-core kernel with three steps per row in flight and several chunks per step (tilings
    the benchmark sweeps)."""
    mm = Matmul(1, 200, 1000, a, w, out_dtype=out, group_size=64, with_bias=True, stages=stages, batch=batch)
    path = tmp_path / f"{mm.name}.cu"
    path.write_text(mm.source)
    rc, err = _nvcc(path, path.with_suffix(".fatbin"))
    assert rc == 0, err
