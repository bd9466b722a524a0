"""fp32 MatMul / Gemm / Conv of a CUDA session through Ape (option `fp32_matmul`, docs/ape.md).

`ApeRouter.for_node(name, blas)` stands in for the session's cuBLAS handle (blas.Blas) in its
direct library path (MatMul, and Conv as im2col + GEMM): `gemm_into` takes the same operands
and runs float32 ones through `powerfusion.ape.ApeGemm` objects, built once per library call
at its first run (before a CUDA graph is captured) on the operands' own memory; anything else
(fp16, bf16, fp64, a batch of more than MAX_SLICES GEMMs) goes on to cuBLAS as before. The
session's operands live at fixed addresses (its arena and its constants), so a built ApeGemm
stays valid for every later run. A transposed operand is copied into a buffer of its own
before each run (constants too: the copy costs far less than the GEMM).

The fixed modes ("fp32-f", "fp32-t", "fp32-b") only launch kernels and cuBLAS calls: they are
captured into the session's CUDA graph. "auto" chooses the type per K panel from the data
(Ape's block masks): its plan is made at the first run, and every later run scans the masks
again, copies them to the host and plans again where the data needs a wider type than planned
(say an FP32-F panel whose values left [2^-14, 2^15)). That host round trip keeps "auto"
steps out of the captured graph: they run eagerly between the captured pieces.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from powerfusion.errors import PowerFusionError

MAX_SLICES = 64   # batched GEMMs (grouped convs, batched attention) with more slices stay on cuBLAS


@dataclass
class _Call:
    """One library call's Ape GEMMs: staging copies for transposed operands, then one ApeGemm
    per 2-D slice of the batch."""
    mode: str
    stages: list = field(default_factory=list)   # (buffer, source view): buffer[...] = source
    gemms: list = field(default_factory=list)
    runs: int = 0
    replans: int = 0

    def run(self) -> None:
        for buf, src in self.stages:
            buf[...] = src
        if self.mode == "auto" and self.runs:
            self._replan_where_needed()
        for g in self.gemms:
            g.run()
        self.runs += 1

    def _replan_where_needed(self) -> None:
        from powerfusion.ape.adapter import panel_classes
        from powerfusion.ape.device import ApeGemm, scan_masks
        for i, g in enumerate(self.gemms):
            mask_a, mask_b = scan_masks(g.a, g.b)
            need = panel_classes(mask_a.max(axis=0), mask_b.max(axis=1))
            if (need > np.asarray(g.plan.panel_kind, np.int8)).any():
                self.gemms[i] = ApeGemm(g.a, g.b, "auto", out=g.out)
                self.replans += 1

    def describe(self) -> str:
        m, n, k = self.gemms[0].m, self.gemms[0].n, self.gemms[0].k
        plans = sorted({g.plan.kind for g in self.gemms})
        mode = self.mode if self.mode != "auto" else f"auto (plan {', '.join(plans)})"
        return f"ape {mode}: {len(self.gemms)} GEMM(s) {m}x{n}x{k}"


class ApeRouter:
    """The session's Ape GEMMs, per library call; `routes` says where each call went."""

    def __init__(self, mode: str):
        from powerfusion.ape import MODES
        if mode not in MODES or mode == "fp32":
            raise PowerFusionError(f"fp32_matmul={mode!r}: an Ape router takes one of "
                                   f"{', '.join(m for m in MODES if m != 'fp32')}")
        self.mode = mode
        self.calls: dict[tuple, _Call] = {}
        self.declined: dict[str, str] = {}   # node -> why it stayed on cuBLAS

    def for_node(self, name: str, blas) -> "_NodeBlas":
        return _NodeBlas(self, name, blas)

    def bind(self, stream) -> None:
        """Bind Ape's cuBLAS handle to `stream` (before a capture begins, as blas.Blas.bind)."""
        import cupy
        from powerfusion.ape import cublas
        cublas.handle_for(cupy.cuda.Device().id).bind(stream)

    def capturable(self, name: str) -> bool:
        return self.mode != "auto" or name in self.declined

    @property
    def routes(self) -> dict[str, str]:
        """Library call (node name) -> "ape <mode>: ..." or "cublas: <why>"."""
        out = {key[0]: call.describe() for key, call in self.calls.items()}
        out.update({name: f"cublas: {why}" for name, why in self.declined.items() if name not in out})
        return out


@dataclass
class _NodeBlas:
    """blas.Blas's `gemm_into` for one library call: Ape for float32, else `blas`."""
    router: ApeRouter
    name: str
    blas: object

    def bind(self, stream) -> None:
        self.blas.bind(stream)
        self.router.bind(stream)

    def gemm_into(self, a, b, out, *, trans_a: bool = False, trans_b: bool = False,
                  logical_dtype: str | None = None) -> bool:
        key = (self.name, a.data.ptr, b.data.ptr, out.data.ptr, a.shape, b.shape, out.shape, trans_a, trans_b)
        call = self.router.calls.get(key)
        if call is None and self.name not in self.router.declined:
            built = _build(a, b, out, trans_a, trans_b, logical_dtype, self.router.mode)
            if isinstance(built, str):
                self.router.declined[self.name] = built
            else:
                call = self.router.calls[key] = built
        if call is None:
            return self.blas.gemm_into(a, b, out, trans_a=trans_a, trans_b=trans_b, logical_dtype=logical_dtype)
        call.run()
        return True


def _build(a, b, out, trans_a, trans_b, logical_dtype, mode) -> _Call | str:
    """The call's Ape GEMMs, or why it stays on cuBLAS."""
    import cupy
    f32 = np.dtype(np.float32)
    if logical_dtype or not (a.dtype == b.dtype == out.dtype == f32):
        return f"{np.dtype(a.dtype).name} operands (Ape emulates float32 only)"
    if a.ndim < 2 or b.ndim < 2 or not out.flags.c_contiguous:
        return "operands Ape's GEMM does not take (rank < 2 or a strided output)"
    call = _Call(mode)
    a = _staged(call, cupy.swapaxes(a, -1, -2) if trans_a else a)
    b = _staged(call, cupy.swapaxes(b, -1, -2) if trans_b else b)
    (m, k), n = a.shape[-2:], b.shape[-1]
    if 0 in (m, n, k):
        return "an empty GEMM"
    if int(np.prod(b.shape[:-2], dtype=np.int64)) == 1:   # one B for the whole batch: one GEMM
        pairs = [(a.reshape(-1, k), b.reshape(k, n), out.reshape(-1, n))]
    else:
        batch = out.shape[:-2]
        if int(np.prod(batch, dtype=np.int64)) > MAX_SLICES:
            return f"a batch of {int(np.prod(batch))} GEMMs (Ape routes at most {MAX_SLICES})"
        ab, bb = cupy.broadcast_to(a, batch + (m, k)), cupy.broadcast_to(b, batch + (k, n))
        pairs = [(ab[i], bb[i], out[i]) for i in np.ndindex(*batch)]
    for x, y, z in pairs:
        call.gemms.append(_gemm(x, y, z, mode))
    return call


def _staged(call: _Call, x):
    """`x` itself when C-contiguous, else a buffer that receives x before each run."""
    if x.flags.c_contiguous:
        return x
    import cupy
    buf = cupy.empty(x.shape, x.dtype)
    buf[...] = x
    call.stages.append((buf, x))
    return buf


def _gemm(a, b, out, mode: str):
    from powerfusion.ape.device import ApeGemm
    g = ApeGemm(a, b, mode, out=out)
    if (g.a.data.ptr, g.b.data.ptr, g.out.data.ptr) != (a.data.ptr, b.data.ptr, out.data.ptr):
        # ApeGemm copied an operand: it would read that copy, not the session's tensor
        raise PowerFusionError(f"Ape GEMM {a.shape} x {b.shape}: an operand is not C-contiguous in place")
    return g


def router(mode: str) -> ApeRouter | None:
    """The session's Ape router for option fp32_matmul=`mode`; None for exact "fp32"."""
    return None if mode == "fp32" else ApeRouter(mode)
