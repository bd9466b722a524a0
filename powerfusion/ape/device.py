"""Ape GEMMs on CuPy arrays: split kernels feeding our own tensor-core kernel (engine "mma",
`mma.py`, round-to-nearest accumulation) or cuBLAS tensor-core GEMMs (engine "cublas").

`ApeGemm(a, b, mode)` fixes the plan (for "auto": scan the block masks, copy them to the
host, decide) and allocates every buffer; `run()` then only launches kernels and cuBLAS calls
on the current stream, so it can be captured into a CUDA graph and replayed while the
operands' values change within the plan's ranges. `matmul` is the one-shot form.

Engine "auto" (the default) is the cuBLAS engine with `engine_choice.default_chunk`'s K
chunks, and SGEMM itself where the emulation does not pay (`engine_choice.emulation_pays`):
measured faster than "mma" at every benchmark shape and within SGEMM's error
(docs/ape.md, "Which engine auto picks").

On the cuBLAS engine, per emulated type, one GEMM per level of part products (FP32-F / FP32-T:
Hi Hi, then [Hi Lo | Lo Hi] over 2K; FP32-B: three levels over K, 2K, 3K), smallest level
first, all accumulating into C through beta = 1 with the level's scale as alpha (2^-12 for
FP32-F's cross terms). The top level runs in chunks of `k_chunk` columns of K, each chunk's sum
added to C in round-to-nearest fp32, which bounds how far the tensor cores' truncating sum runs
(`accumulation.py`); `k_chunk=0` runs it whole.
"""
from __future__ import annotations

import functools

import numpy as np

from . import cublas, kernels, mma
from .adapter import (
    MASK_ROWS,
    PANEL,
    Plan,
    Speeds,
    decide,
    f_block_fraction,
    panel_classes,
)
from .engine_choice import (  # noqa: F401  (mma_fills, mma_applies: re-exported)
    ENGINES,
    default_chunk,
    default_chunk_sum,
    emulation_pays,
    mma_applies,
    mma_fills,
    pick_engine,
)
from .reference import MASK_B, MASK_F, MASK_FP32, MODES, ApeError
from .types import TYPES

_GEMM_TYPE = {"f": cublas.FP16, "t": cublas.TF32, "b": cublas.BF16}
_PART_DTYPE = {"f": np.uint16, "t": np.float32, "b": np.uint16}
_KIND_LETTER = {MASK_F: "f", MASK_B: "b"}
_THREADS = 256


@functools.cache
def _module(device_id: int):
    import cupy
    return cupy.RawModule(code=kernels.source())


def _kernel(name: str):
    import cupy
    return _module(cupy.cuda.Device().id).get_function(name)


@functools.cache
def _mma_kernel(device_id: int, mode: str):
    import cupy
    fn = cupy.RawModule(code=mma.source()).get_function(f"ape_mma_{mode[-1]}")
    fn.max_dynamic_shared_size_bytes = mma.smem_bytes(mode)   # above 48 KiB needs the opt-in
    return fn


@functools.cache
def _smem_optin(device_id: int) -> int:
    import cupy
    return int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


def mma_fits(mode: str) -> bool:
    """Whether the kernel of `mode` gets its shared memory on the current device (sm_90: all
    three; sm_80's 163 KiB: FP32-F only)."""
    import cupy
    return mma.smem_bytes(mode) <= _smem_optin(cupy.cuda.Device().id)


def _launch(name: str, total: int, args) -> None:
    grid = max(1, min(-(-total // _THREADS), 1 << 16))
    _kernel(name)((grid,), (_THREADS,), args)


def _i64(v) -> np.int64:
    return np.int64(v)


def _check(a, b, mode: str, out):
    import cupy
    if mode not in MODES:
        raise ApeError(f"unknown Ape mode {mode!r}; expected one of {', '.join(MODES)}")
    if not isinstance(a, cupy.ndarray) or not isinstance(b, cupy.ndarray):
        raise ApeError(f"Ape matmul takes CuPy arrays, got {type(a).__name__} x {type(b).__name__}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ApeError(f"Ape matmul needs 2-D operands (M, K) x (K, N), got {a.shape} x {b.shape}")
    pair = (a.dtype.name, b.dtype.name)
    if pair not in (("float32", "float32"), ("int16", "int16")):
        raise ApeError(f"Ape matmul takes float32 x float32 or int16 x int16, got {pair[0]} x {pair[1]}")
    want = np.int32 if pair[0] == "int16" else np.float32
    shape = (a.shape[0], b.shape[1])
    if out is not None and (out.shape != shape or out.dtype != want or not out.flags.c_contiguous):
        raise ApeError(f"Ape matmul: out must be a C-contiguous {np.dtype(want).name} array of shape {shape}, "
                       f"got {out.dtype} {out.shape}")


CHUNK_SUMS = ("beta", "batched")


class _EmulatedGroup:
    """The K panels of one emulated type: their split buffers and part GEMMs (cuBLAS, one per
    level, the top level in K chunks) or our own tensor-core kernel (engine "mma", K padded to
    its k-tile)."""

    def __init__(self, letter: str, a, b, panels: np.ndarray | None, k_chunk: int | None, engine: str = "cublas",
                 chunk_sum: str | None = None):
        import cupy
        self.letter, self.t = letter, TYPES[f"fp32-{letter}"]
        if engine == "mma" and not mma_fits(self.t.name):
            engine = "cublas"   # this device has too little shared memory for the kernel's ring
        self.engine = engine
        self.m, self.k = a.shape
        self.n = b.shape[1]
        self.kp = self.k if panels is None else len(panels) * PANEL
        if engine == "mma":
            self.kp = -(-self.kp // mma.BK) * mma.BK
        self.panels = None if panels is None else cupy.asarray(panels, dtype=np.int32)
        p, dt = self.t.parts, _PART_DTYPE[letter]
        self.a_parts = cupy.empty((self.m, p * self.kp), dt)
        self.b_parts = cupy.empty((p * self.kp, self.n), dt)
        if k_chunk is None:
            k_chunk = default_chunk(self.m, self.n, self.kp, self.t.name)
        self.k_chunk = k_chunk if (engine == "cublas" and k_chunk and self.kp > k_chunk) else None
        chunk_sum = chunk_sum or default_chunk_sum(self.m, self.n, self.kp, self.t.name)
        # "batched": the chunks of the top level as one strided-batched GEMM into a buffer of
        # chunk products, added by a kernel; needs equal chunks. "beta": one GEMM per chunk
        # adding into C through beta = 1 (cuBLAS's epilogue: one fp32 FMA, round to nearest).
        self.chunk_sum = "batched" if (chunk_sum == "batched" and self.k_chunk and self.kp % self.k_chunk == 0) else "beta"
        self.chunks = (cupy.empty((self.kp // self.k_chunk, self.m, self.n), np.float32)
                       if self.k_chunk and self.chunk_sum == "batched" else None)

    def split(self, a, b) -> None:
        """The split kernels: A's and B's parts into this group's buffers."""
        panels = np.uint64(0) if self.panels is None else self.panels
        _launch(f"ape_split_{self.letter}_a", self.m * self.kp,
                (a, _i64(self.m), _i64(self.k), _i64(a.shape[1]), panels, _i64(self.kp), self.a_parts))
        _launch(f"ape_split_{self.letter}_b", self.kp * self.n,
                (b, _i64(self.k), _i64(self.n), _i64(b.shape[1]), panels, _i64(self.kp), self.b_parts))

    def run(self, a, b, c, first: bool) -> bool:
        """Split, then C = the emulated product (+ C unless `first`); returns the new `first`."""
        import cupy
        self.split(a, b)
        if self.engine == "mma":
            if self.m == 0 or self.n == 0:
                return False
            fn = _mma_kernel(c.device.id, self.t.name)
            fn((mma.grid(self.m, self.n, self.t.name),), (mma.THREADS,), (self.a_parts, self.b_parts, _i64(self.m), _i64(self.n),
                                                            _i64(self.kp), c, np.int32(not first)),
               shared_mem=mma.smem_bytes(self.t.name))
            return False
        blas = cublas.handle_for(c.device.id)
        blas.bind(cupy.cuda.get_current_stream())
        for level in reversed(range(len(self.t.levels))):   # smallest level first
            if level == 0 and self.k_chunk:
                self._top_in_chunks(blas, c, first)
            else:
                a_op, b_op = self._operands(level, 0)
                blas.gemm(_GEMM_TYPE[self.letter], self.m, self.n, (level + 1) * self.kp, a_op, b_op,
                          cublas.Operand(c.data.ptr, self.n), alpha=self.t.level_scale[level], beta=0.0 if first else 1.0)
            first = False
        return first

    def _operands(self, level: int, k0: int, batch_k: int = 0) -> tuple:
        """A's and B's operands of a level's GEMM from column / row k0 of the level's K."""
        p, item = self.t.parts, self.a_parts.itemsize
        a_op = cublas.Operand(self.a_parts.data.ptr + k0 * item, p * self.kp, batch_k)
        b_ptr = self.b_parts.data.ptr + ((p - 1 - level) * self.kp + k0) * self.n * item
        return a_op, cublas.Operand(b_ptr, self.n, batch_k * self.n)

    def _top_in_chunks(self, blas, c, first: bool) -> None:
        """The top level (Hi Hi, scale 1) as GEMMs of k_chunk columns of K, each chunk's sum
        added to C in round-to-nearest fp32: no truncating tensor-core sum runs over more than
        k_chunk products (docs/ape.md, "Why the cuBLAS engine's error exceeded SGEMM's")."""
        gt, kc = _GEMM_TYPE[self.letter], self.k_chunk
        if self.chunk_sum == "batched":
            nb = self.kp // kc
            a_op, b_op = self._operands(0, 0, kc)
            blas.gemm(gt, self.m, self.n, kc, a_op, b_op, cublas.Operand(self.chunks.data.ptr, self.n, self.m * self.n),
                      batch=nb)
            _launch("ape_reduce_chunks", self.m * self.n, (self.chunks, np.int32(nb), _i64(self.m * self.n),
                                                          np.float32(1.0), np.int32(not first), c))
            return
        for k0 in range(0, self.kp, kc):
            a_op, b_op = self._operands(0, k0)
            blas.gemm(gt, self.m, self.n, min(kc, self.kp - k0), a_op, b_op, cublas.Operand(c.data.ptr, self.n),
                      beta=0.0 if first else 1.0)
            first = False


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive runs [start, stop) of sorted panel indices."""
    runs = []
    for i in indices.tolist():
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [tuple(r) for r in runs]


class ApeGemm:
    """A planned fp32 Ape GEMM with its buffers; `run()` is graph-capturable."""

    def __init__(self, a, b, mode: str = "auto", out=None, *, k_chunk: int | None = None,
                 speeds: Speeds | None = None, engine: str = "auto", chunk_sum: str | None = None):
        import cupy
        _check(a, b, mode, out)
        if k_chunk is not None and (not isinstance(k_chunk, (int, np.integer)) or k_chunk < 0):
            raise ApeError(f"k_chunk must be a non-negative int (None: the engine's default, 0: none), got {k_chunk!r}")
        if chunk_sum is not None and chunk_sum not in CHUNK_SUMS:
            raise ApeError(f"unknown chunk_sum {chunk_sum!r}; expected one of {', '.join(CHUNK_SUMS)}")
        self.engine = pick_engine(engine, b.shape[1], k_chunk, ApeError)
        self.engine_picked = engine == "auto"   # not asked for by name: SGEMM may run instead
        self.a, self.b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
        self.m, self.k = a.shape
        self.n = b.shape[1]
        self.out = out if out is not None else cupy.empty((self.m, self.n), np.float32)
        self.plan = self._plan(mode, speeds)
        self.groups, self.fp32_runs = [], []
        npanels = -(-self.k // PANEL)
        if self.plan.kind in ("fp32-f", "fp32-t", "fp32-b") and mode != "auto":
            self.groups.append(_EmulatedGroup(self.plan.kind[-1], self.a, self.b, None, k_chunk, self.engine, chunk_sum))
            return
        for cls in (MASK_B, MASK_F):
            idx = self.plan.panels(cls)
            if idx.size:
                whole = idx.size == npanels and self.k % PANEL == 0
                self.groups.append(_EmulatedGroup(_KIND_LETTER[cls], self.a, self.b, None if whole else idx, k_chunk,
                                                  self.engine, chunk_sum))
        self.fp32_runs = _runs(self.plan.panels(MASK_FP32))

    def _plan(self, mode: str, speeds: Speeds | None) -> Plan:
        npanels = max(1, -(-self.k // PANEL))
        if mode == "fp32":
            return Plan("fp32", (MASK_FP32,) * npanels, float("nan"), float("nan"))
        if mode != "auto":
            return Plan(mode, (MASK_F if mode == "fp32-f" else MASK_B,) * npanels, float("nan"), float("nan"))
        if self.engine_picked and not emulation_pays(self.engine, self.m, self.n, self.k):   # SGEMM is faster, exact
            return Plan("fp32", (MASK_FP32,) * npanels, float("nan"), float("nan"))
        mask_a, mask_b = scan_masks(self.a, self.b)
        cls = panel_classes(mask_a.max(axis=0), mask_b.max(axis=1))
        return decide(cls, speeds or measured_speeds(), 2.0 * self.m * self.n * PANEL, f_block_fraction(mask_a, mask_b))

    def run(self):
        """Launch the plan on the current stream; returns `out`."""
        import cupy
        cublas.handle_for(self.out.device.id).bind(cupy.cuda.get_current_stream())
        first = True
        if self.k == 0:
            self.out.fill(0)
            return self.out
        blas = cublas.handle_for(self.out.device.id)
        for start, stop in self.fp32_runs:
            k0, k1 = start * PANEL, min(stop * PANEL, self.k)
            blas.gemm(cublas.FP32, self.m, self.n, k1 - k0,
                      cublas.Operand(self.a.data.ptr + 4 * k0, self.k), cublas.Operand(self.b.data.ptr + 4 * k0 * self.n, self.n),
                      cublas.Operand(self.out.data.ptr, self.n), beta=0.0 if first else 1.0)
            first = False
        for group in self.groups:
            first = group.run(self.a, self.b, self.out, first)
        return self.out


def scan_masks(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Block masks of A (MASK_ROWS x PANEL blocks) and B (PANEL x MASK_ROWS), on the host."""
    return block_mask_device(a, (MASK_ROWS, PANEL)), block_mask_device(b, (PANEL, MASK_ROWS))


def block_mask_device(x, block, copy: bool = True, mask=None):
    """Ape's getMask per block, by the device scan kernel (one thread block per mask block);
    the mask as a numpy array, or the device array (`mask` if given: no allocation, so the
    scan can be captured in a CUDA graph) with copy=False."""
    import cupy
    br, bc = (block, block) if np.isscalar(block) else tuple(block)
    rows, cols = x.shape
    gy, gx = max(1, -(-rows // br)), max(1, -(-cols // bc))
    if mask is None:
        mask = cupy.empty((gy, gx), np.int8)
    _kernel("ape_block_mask")((gx, gy), (_THREADS,), (x, _i64(rows), _i64(cols), _i64(x.shape[1]),
                                                      np.int32(br), np.int32(bc), mask))
    return cupy.asnumpy(mask) if copy else mask


@functools.cache
def _speeds(device_id: int, n: int) -> Speeds:
    import cupy
    rng = cupy.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    per_flop = {}
    for mode in ("fp32-f", "fp32-b", "fp32"):
        g = ApeGemm(a, a, mode)
        g.run()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(3):
            g.run()
        stop.record()
        stop.synchronize()
        per_flop[mode] = cupy.cuda.get_elapsed_time(start, stop) / 3e3 / (2.0 * n ** 3)
    return Speeds(f=per_flop["fp32-f"], b=per_flop["fp32-b"], fp32=per_flop["fp32"])


def measured_speeds(n: int = 2048) -> Speeds:
    """Seconds per flop of FP32-F, FP32-B and SGEMM, measured once per device at n^3."""
    import cupy
    return _speeds(cupy.cuda.Device().id, n)


class Int16Gemm:
    """int16 x int16 -> int32 from four int8 tensor-core GEMMs (three cuBLAS calls, TN
    layout) and a wrapping combine kernel; exact modulo 2^32. Graph-capturable `run()`."""

    def __init__(self, a, b, out=None):
        import cupy
        _check(a, b, "auto", out)
        self.a, self.b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
        self.m, self.k = a.shape
        self.n = b.shape[1]
        self.kp = max(16, -(-self.k // 16) * 16)   # int8 GEMMs want K (the leading dimension) in 16s
        self.out = out if out is not None else cupy.empty((self.m, self.n), np.int32)
        self.a_parts = cupy.empty((self.m, 2 * self.kp), np.int8)
        self.bt_parts = cupy.empty((self.n, 2 * self.kp), np.int8)
        self.products = cupy.empty((3, self.m, self.n), np.int32)
        self.row_sums = cupy.empty(self.m, np.uint32)
        self.col_sums = cupy.empty(self.n, np.uint32)

    def run(self):
        import cupy
        m, n, k, kp = self.m, self.n, self.k, self.kp
        blas = cublas.handle_for(self.out.device.id)
        blas.bind(cupy.cuda.get_current_stream())
        _launch("ape_split_i16_a", m * kp, (self.a, _i64(m), _i64(k), _i64(kp), self.a_parts))
        _kernel("ape_split_i16_b")((-(-n // 32), -(-kp // 32)), (32, 8), (self.b, _i64(k), _i64(n), _i64(kp), self.bt_parts))
        _kernel("ape_row_sums_i16")((max(m, 1),), (_THREADS,), (self.a, _i64(k), self.row_sums))
        _launch("ape_col_sums_i16", n, (self.b, _i64(k), _i64(n), self.col_sums))
        a0, b0, mn = self.a_parts.data.ptr, self.bt_parts.data.ptr, m * n * 4
        ld = 2 * kp
        # (A part offset, B^T part offset, K) of HH, [Ah|Al] x [Bl|Bh], LL
        for i, (ao, bo, kk) in enumerate(((0, kp, kp), (0, 0, 2 * kp), (kp, 0, kp))):
            blas.gemm(cublas.INT8, m, n, kk, cublas.Operand(a0 + ao, ld), cublas.Operand(b0 + bo, ld, transposed=True),
                      cublas.Operand(self.products.data.ptr + i * mn, n), alpha=1, beta=0)
        _launch("ape_combine_i16", m * n, (self.products[0], self.products[1], self.products[2], self.row_sums,
                                           self.col_sums, _i64(m), _i64(n), _i64(k), self.out))
        return self.out


def matmul(a, b, mode: str = "auto", out=None, **kw):
    """C = A B on CuPy arrays (see `powerfusion.ape.matmul`)."""
    _check(a, b, mode, out)
    if a.dtype == np.int16:
        return Int16Gemm(a, b, out).run()   # exact: nothing to choose
    return ApeGemm(a, b, mode, out, **kw).run()
