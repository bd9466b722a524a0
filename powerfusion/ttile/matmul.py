"""`Matmul`: one typed GEMM C[M, N] = A[M, K] . dequant(W)[N, K]^T (+ bias), with
packing, a numpy reference and a generated CUDA kernel (CuPy imported lazily)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from powerfusion.targets.specs import get_target

from . import codegen, prefill
from .quant import (QuantizedWeight, dequantize, normalize_group, pack_mma, pack_words, quantize,
                    unpack_mma, unpack_words)
from .device import schedule_typed_gemm
from .ttype import get_ttype

_NP_OUT = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32}


@dataclass(frozen=True)
class PackedWeight:
    """Device-ready layout: words [N, K_pad*bits/32] uint32 plus padded scales/zeros."""
    words: np.ndarray
    scale: np.ndarray | None
    zeros: np.ndarray | None
    bias: np.ndarray | None
    layout: str
    K: int

    def arrays(self):
        return [x for x in (self.words, self.scale, self.zeros, self.bias)]


def _np_dtype(name: str):
    if name == "bf16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return {"fp16": np.float16, "fp32": np.float32, "int8": np.int8, "int32": np.int32}[name]


class Matmul:
    def __init__(self, M: int, N: int, K: int, A_dtype: str = "fp16", W_dtype: str = "int4",
                 accum_dtype: str | None = None, out_dtype: str | None = None,
                 group_size: int | None = 128, zeros_mode: str | None = None,
                 with_bias: bool = False, rows_per_warp: int | None = None, ksplit: int | None = None,
                 arch: str = "sm_90", target: str = "h200", kernel: str | None = None,
                 warps: int | None = None, stages: int | None = None, batch: int | None = None,
                 stage_a: bool | None = None, tile=None):
        from powerfusion.ttile.dtype_names import canonical   # BitBLAS spellings: "float16", "bfloat16", ...
        A_dtype, W_dtype = canonical(A_dtype), canonical(W_dtype)
        accum_dtype, out_dtype = canonical(accum_dtype), canonical(out_dtype)
        if A_dtype not in codegen.KERNEL_WTYPES:
            raise ValueError(f"A_dtype must be one of {sorted(codegen.KERNEL_WTYPES)} (or BitBLAS's float16 / "
                             f"bfloat16 / int8), got {A_dtype!r}")
        if W_dtype not in codegen.KERNEL_WTYPES[A_dtype]:
            raise ValueError(f"no {W_dtype} x {A_dtype} kernel; supported W types for {A_dtype}: "
                             f"{codegen.KERNEL_WTYPES[A_dtype]}")
        a8 = A_dtype == "int8"
        want_acc = "int32" if a8 else "fp32"
        if accum_dtype not in (None, want_acc):
            raise ValueError(f"{A_dtype} activations accumulate in {want_acc}, not {accum_dtype}")
        out_dtype = out_dtype or (A_dtype if not a8 else "fp32")
        allowed = ("fp16", "fp32", "int32") if a8 else (A_dtype, "fp32")
        if out_dtype not in allowed:
            raise ValueError(f"out_dtype for A={A_dtype} must be one of {allowed}, got {out_dtype!r}")
        if min(M, N, K) < 1:
            raise ValueError(f"M, N, K must be positive, got {(M, N, K)}")
        tt = get_ttype(W_dtype)
        if a8 and zeros_mode is not None:
            raise ValueError("int8-activation kernels take symmetric signed weights (zeros_mode=None)")
        self.wtype = tt
        G = normalize_group(None if (a8 and out_dtype == "int32") else group_size, K, tt)
        self.schedule = schedule_typed_gemm(M, N, K, A_dtype, W_dtype, G, arch, target, kernel, zeros_mode)
        K_pad = self.schedule.k_pad
        G = K_pad if G >= K else G
        if warps not in (None, 2, 4, 8, 16):
            raise ValueError(f"warps per block must be 2, 4, 8 or 16, got {warps}")
        kind = self.schedule.kernel
        if kind == "mma" or (warps is None and kind != "gemv"):
            warps = 4        # the mma kernel is written for 4
        elif warps is None:   # a given split-K over the block's warps fixes their number
            warps = ksplit if ksplit and ksplit > 1 else codegen.default_warps(M)
        R, MT, ks = codegen.choose_tiling(M, tt.bits, A_dtype, rows_per_warp, ksplit, warps)
        if stages not in (None, 2, 3):
            raise ValueError(f"stages must be 2 or 3, got {stages}")
        stages = stages or 2   # 3 (more loads in flight per row) is an option the benchmark sweeps
        if batch not in (None, 1, 2, 4, 8):
            raise ValueError(f"batch (chunks per row loaded together) must be 1, 2, 4 or 8, got {batch}")
        self.spec = codegen.KernelSpec(M, N, K, K_pad, A_dtype, W_dtype, out_dtype, G,
                                       zeros_mode, with_bias, R, MT, warps=warps, ksplit=ks, stages=stages,
                                       batch=batch or 1, stage_a=stage_a)
        if batch is None and kind == "gemv":
            self.spec = dataclasses.replace(
                self.spec, batch=codegen.default_batch(self.spec, get_target(target).groups_concurrent))
        self.group_size = None if G == K_pad else G
        self.M, self.N, self.K = M, N, K
        self.kind = self.schedule.kernel
        self.fused = self.kind != "dequant"
        if self.kind == "mma":
            self.spec = dataclasses.replace(self.spec, N_pad=-(-N // 8) * 8)
        if self.kind == "tc":   # the M bucket's tile unless one is given (the benchmark sweeps them)
            self.spec = dataclasses.replace(self.spec, tile=tile or prefill.tile_for(M))
        elif tile is not None:
            raise ValueError(f"tile= applies to the tensor-core prefill kernel, not {self.kind!r}")
        self.name, self.source = codegen.render(self.spec, self.kind)
        self._fn = None
        self._scratch = {}   # device buffers reused across calls (one stream at a time)

    # ---- host side ----
    def quantize(self, weight: np.ndarray) -> QuantizedWeight:
        return quantize(weight, self.spec.W_dtype, self.group_size if self.group_size else -1,
                        self.spec.zeros_mode)

    def pack(self, weight, scale=None, zeros=None, bias=None) -> PackedWeight:
        """Float weight [N, K] (quantised here), or a QuantizedWeight, or integer codes
        [N, K] with their scale / zeros -> the layout this kernel reads."""
        if isinstance(weight, QuantizedWeight):
            qw = weight
        elif np.issubdtype(np.asarray(weight).dtype, np.floating) and scale is None:
            qw = self.quantize(weight)
        else:
            qw = self._from_codes(np.asarray(weight), scale, zeros)
        N, K = qw.codes.shape
        if (N, K) != (self.N, self.K):
            raise ValueError(f"weight shape {(N, K)} does not match Matmul N, K = {(self.N, self.K)}")
        if self.spec.with_bias != (bias is not None):
            raise ValueError(f"with_bias={self.spec.with_bias} but bias {'missing' if bias is None else 'given'}")
        s = self.spec
        rows = s.N_pad if self.kind == "mma" else N
        codes = np.zeros((rows, s.K_pad), np.uint8)
        codes[:N, :K] = qw.codes
        ng = s.K_pad // s.group_size
        int_out = s.A_dtype == "int8" and s.out_dtype == "int32"
        # int32 output is the raw integer accumulator: scales (if any) are the caller's to apply
        scale_p = _pad_groups(qw.scale, ng, rows) if qw.scale is not None and not int_out else None
        zeros_p = _pad_groups(qw.zeros, ng, rows) if qw.zeros is not None else None
        if scale_p is None and not int_out:
            raise ValueError("this kernel needs scales")
        bdt = np.float32 if s.A_dtype == "int8" and s.out_dtype != "int32" else \
            np.int32 if s.out_dtype == "int32" else _np_dtype(s.A_dtype)
        b = None if bias is None else np.asarray(bias).astype(bdt).reshape(N)
        words = pack_mma(codes, s.bits, s.layout) if self.kind == "mma" else pack_words(codes, s.bits, s.layout)
        return PackedWeight(words, scale_p, zeros_p, b, s.layout, K)

    def _from_codes(self, w, scale, zeros) -> QuantizedWeight:
        tt = self.wtype
        if tt.kind in ("int", "uint"):
            lo, hi = tt.qrange()
            if w.min() < lo or w.max() > hi:
                raise ValueError(f"{tt.name} values must lie in [{lo}, {hi}]")
            codes = (w.astype(np.int64) - lo).astype(np.uint8)
        else:
            codes = w.astype(np.uint8)
        G = self.group_size or self.K
        sdt = np.uint8 if tt.kind == "block" else np.float16
        sc = None if scale is None else np.asarray(scale).astype(sdt).reshape(self.N, -1)
        zdt = np.uint8 if self.spec.zeros_mode == "quantized" else np.float16
        zr = None if zeros is None else np.asarray(zeros).astype(zdt).reshape(self.N, -1)
        if (zr is None) != (self.spec.zeros_mode is None):
            raise ValueError(f"zeros_mode={self.spec.zeros_mode} needs zeros given exactly when set")
        return QuantizedWeight(tt.name, codes, sc, zr, G, self.spec.zeros_mode)

    def unpack(self, packed: PackedWeight) -> QuantizedWeight:
        """Packed layout -> QuantizedWeight (bit-exact inverse of pack)."""
        s = self.spec
        if self.kind == "mma":
            codes = unpack_mma(packed.words, s.bits, packed.layout, s.N_pad, s.K_pad)[:self.N, :self.K]
        else:
            codes = unpack_words(packed.words, s.bits, packed.layout)[:, :self.K]
        ng = -(-self.K // s.group_size)
        G = s.group_size if self.group_size else self.K
        cut = (lambda x: None if x is None else x[:self.N, :ng])
        return QuantizedWeight(s.W_dtype, codes, cut(packed.scale), cut(packed.zeros), G, s.zeros_mode)

    def reference(self, A: np.ndarray, packed: PackedWeight) -> np.ndarray:
        """numpy: unpack, dequantise (float32), matmul in float64, add bias, cast."""
        qw = self.unpack(packed)
        if qw.scale is None:     # int8 activations, int32 output: pure integer GEMM
            w = qw.codes.astype(np.int64) - (1 << (self.wtype.bits - 1))
            out = np.asarray(A).astype(np.int64) @ w.T
            if packed.bias is not None:
                out = out + packed.bias.astype(np.int64)
            return out.astype(np.int32)
        w = dequantize(qw).astype(np.float64)
        out = np.asarray(A).astype(np.float64) @ w.T
        if packed.bias is not None:
            out = out + packed.bias.astype(np.float64)
        return out.astype(_np_dtype(self.spec.out_dtype))

    # ---- device side ----
    def launch_config(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        s = self.spec
        if self.kind == "tc":
            return self._tc_launch(self.M)[:2]
        if self.kind == "mma":
            mt16 = max(1, min(-(-s.M // 16), 2 if s.bits == 1 else 4))
            return (-(-s.N_pad // (8 * s.warps)), -(-s.M // (16 * mt16)), 1), (32 * s.warps, 1, 1)
        if self.fused:
            rows = s.R * (s.warps if s.ksplit == 1 else 1)
            return (-(-s.N // rows), -(-s.M // s.MT), 1), (32 * s.warps, 1, 1)
        words = s.K_pad * s.bits // 32
        return (-(-(s.N * words) // 256), 1, 1), (256, 1, 1)

    def _tc_launch(self, M: int, splits: int | None = None):
        """(grid, block, splits) of the prefill kernel for M activation rows."""
        t = self.spec.tile
        if splits is None:
            splits = prefill.choose_splits(M, self.N, self.spec.K_pad, t, _sm_count(), self.spec.dq == "lut",
                                           self.spec.zmode == "quantized")
        return (-(-M // t.bm), -(-self.N // t.bn), splits), (t.threads, 1, 1), splits

    def _kernel(self):
        if self._fn is None:
            from .runtime import compile_kernel
            self._fn = compile_kernel(self.source, self.name)
            if self.kind == "tc":   # above 48 KiB of dynamic shared memory needs the opt-in
                self._fn.max_dynamic_shared_size_bytes = self._tc_smem()
        return self._fn

    def _tc_smem(self) -> int:
        return self.spec.tile.smem_bytes(self.spec.dq == "lut")

    def to_device(self, packed: PackedWeight):
        import cupy as cp
        return [None if x is None else cp.asarray(_bits(x)) for x in packed.arrays()]

    def __call__(self, A, packed, out=None):
        """A: CuPy array [M, K]; packed: PackedWeight or its to_device() list; out: an
        optional [M, N] array of the output type. The fused kernels allocate nothing per call
        (after the first), so they can be captured in a CUDA graph; the dequantise path
        calls cuBLAS, which CuPy refuses to run while a stream is being captured."""
        import cupy as cp
        dev = self.to_device(packed) if isinstance(packed, PackedWeight) else packed
        words, scale, zeros, bias = dev
        s = self.spec
        adt = {"fp16": cp.float16, "bf16": cp.uint16, "int8": cp.int8}[s.A_dtype]
        # the prefill kernel takes M at run time: any row count of its bucket's kernel
        rows_ok = A.ndim == 2 and (A.shape[0] >= 1 if self.kind == "tc" else A.shape[0] == self.M)
        if not rows_ok or A.shape[-1] != self.K or A.dtype != adt:
            raise ValueError(f"A has shape {A.shape} and dtype {A.dtype}, expected {(self.M, self.K)} {np.dtype(adt)}")
        M = A.shape[0]
        # bf16 travels as raw uint16 bits (CuPy has no bfloat16 dtype)
        odt = {"fp16": cp.float16, "fp32": cp.float32, "int32": cp.int32, "bf16": cp.uint16}[s.out_dtype]
        if out is not None and (out.shape != (M, self.N) or out.dtype != odt):
            raise ValueError(f"out has shape {out.shape} and dtype {out.dtype}, expected {(M, self.N)} {np.dtype(odt)}")
        null = self._buffer("null", (1,), cp.uint8)
        if self.kind == "tc":
            return self._call_tc(A, dev, out if out is not None else cp.empty((M, self.N), odt), null)
        grid, block = self.launch_config()
        if self.fused:
            out = out if out is not None else cp.empty((self.M, self.N), odt)
            self._kernel()(grid, block, (A, words, _or(scale, null), _or(zeros, null), _or(bias, null), out), stream=cp.cuda.get_current_stream())
            return out
        bf16 = s.A_dtype == "bf16"
        wdeq = self._buffer("wdeq", (self.N, self.K), cp.uint16 if bf16 else cp.float16)
        self._kernel()(grid, block, (words, _or(scale, null), _or(zeros, null), wdeq), stream=cp.cuda.get_current_stream())
        from .runtime import bf16_bits_to_f32, f32_to_bf16_bits, gemm_nt_f32
        res = gemm_nt_f32(A.view(cp.uint16) if bf16 else A, wdeq, s.A_dtype,
                          out=self._buffer("res", (self.M, self.N), cp.float32))   # tensor cores, fp32 out
        if bias is not None:
            res += bf16_bits_to_f32(bias.view(cp.uint16)) if bf16 else bias.astype(cp.float32)
        res = f32_to_bf16_bits(res) if s.out_dtype == "bf16" else res
        if out is None:
            return res.astype(odt)     # a copy: the scratch buffer is overwritten by the next call
        out[...] = res
        return out

    def _call_tc(self, A, dev, out, null, splits: int | None = None):
        import cupy as cp
        words, scale, zeros, bias = dev
        M = A.shape[0]
        if A.data.ptr % 16 or not A.flags.c_contiguous:   # the kernel copies activations in 16-byte pieces
            a = self._buffer(("a_aligned", M), (M, self.K), A.dtype)
            a[...] = A
            A = a
        grid, block, splits = self._tc_launch(M, splits)
        part = self._buffer(("partial", splits * M), (splits * M * self.N,), cp.float32) if splits > 1 else null
        counters = self._buffer(("counters", grid[0] * grid[1]), (grid[0] * grid[1],), cp.int32) if splits > 1 else null
        self._kernel()(grid, block, (A, words, _or(scale, null), _or(zeros, null), _or(bias, null), out, part,
                                     counters, np.int32(M)),
                       shared_mem=self._tc_smem(), stream=cp.cuda.get_current_stream())
        return out

    def _buffer(self, key, shape, dtype):
        import cupy as cp
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = cp.zeros(shape, dtype)
        return buf


def _sm_count() -> int:
    import cupy as cp
    return cp.cuda.Device().attributes["MultiProcessorCount"]


def _bits(x: np.ndarray) -> np.ndarray:
    """bf16 host arrays go to the device as their uint16 bits."""
    return x.view(np.uint16) if x.dtype.name == "bfloat16" else x


def _or(x, y):
    return y if x is None else x


def _pad_groups(x: np.ndarray, ng: int, rows: int) -> np.ndarray:
    out = np.zeros((rows, ng), x.dtype)
    out[:x.shape[0], :x.shape[1]] = x
    return out
