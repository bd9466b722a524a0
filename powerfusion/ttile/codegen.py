"""Kernel choice and CUDA source generation for typed GEMMs (jinja2 templates)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np

from .ttype import get_ttype

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "kernels"),
                          undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)

A16 = ("fp16", "bf16")
# W types with a fused kernel, per activation type
KERNEL_WTYPES = {
    "fp16": ("int8", "uint8", "int4", "uint4", "int2", "uint2", "int1", "uint1",
             "nf4", "fp4_e2m1", "mxfp4", "fp8_e4m3", "mxfp8"),
    "int8": ("int8", "int4", "int2", "int1"),
}
KERNEL_WTYPES["bf16"] = KERNEL_WTYPES["fp16"]
A_SMEM_MAX = 44 << 10   # static shared memory for staged activations (48 KiB minus LUT / reduction)
_CT = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float", "int32": "int"}


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """Everything that changes the generated source of one typed-GEMM kernel."""
    M: int
    N: int
    K: int
    K_pad: int
    A_dtype: str
    W_dtype: str
    out_dtype: str
    group_size: int          # elements; == K_pad for per channel
    zeros_mode: str | None
    with_bias: bool
    R: int = 1               # output rows per warp
    MT: int = 1              # activation rows per block
    warps: int = 4
    ksplit: int = 1          # 1, or `warps`: the block's warps split K of the same R rows
    stages: int = 2          # CUDA-core kernel: steps of weight chunks per row in flight (2, or 3)
    batch: int = 1           # CUDA-core kernel: chunks per row a lane loads together (one step)
    stage_a: bool | None = None   # CUDA-core kernel: activations staged in shared memory (None: where they fit)
    N_pad: int = 0           # mma kernel: rows padded to 8-row tiles
    tile: object = None      # tc kernel: prefill.TileConfig of its M bucket (M is then a kernel argument)

    @property
    def bits(self) -> int:
        return get_ttype(self.W_dtype).bits

    @property
    def layout(self) -> str:
        """Word layout chosen at pack time (the scheduler's `map`) for the fused kernel's unit."""
        from .device import DEVICES, select_unit, word_layout
        return word_layout(self.W_dtype, select_unit(DEVICES["sm_90"], self.A_dtype, self.W_dtype, False))

    @property
    def dq(self) -> str:
        tt = get_ttype(self.W_dtype)
        if tt.kind in ("int", "uint"):
            return "dp4a" if self.A_dtype == "int8" else "magic"
        return "fp8" if self.bits == 8 else "lut"

    @property
    def zmode(self) -> str:
        tt = get_ttype(self.W_dtype)
        if tt.kind == "block":
            return "mx"
        if self.zeros_mode:
            return self.zeros_mode
        return "sym" if tt.kind == "int" else "none"


SMEM_STATIC_MAX = 47 << 10   # 48 KiB of static shared memory, less the warps' reduction


def lut_table_copies(staged_bytes: int) -> int:
    """Interleaved copies of the GEMV's 1 KiB pair table: 32 (conflict-free lookups) where the
    staged activations leave room, else the most that fit (16: at most 2-way conflicts)."""
    for copies in (32, 16, 8, 4, 2, 1):
        if staged_bytes + 1024 * copies <= SMEM_STATIC_MAX:
            return copies
    return 1


def chunk_elems(bits: int) -> int:
    """Elements in one lane's 16-byte load."""
    return 128 // bits


def padded_k(K: int, bits: int, group: int) -> int:
    step = int(np.lcm(chunk_elems(bits), group)) if group < K else chunk_elems(bits)
    return -(-K // step) * step


def choose_tiling(M: int, bits: int, A_dtype: str, R: int | None = None,
                  ksplit: int | None = None, warps: int = 4) -> tuple[int, int, int]:
    """(R, MT, ksplit): rows per warp, activation rows per block, warps splitting K.

    Activations of one word live in registers per M row (E/2 pairs), so MT is capped to
    keep that under about 32 registers. At small M every activation load is shared by
    the R rows of a warp, so R grows as the weight bits shrink; R rows per block are
    then few, and the block's warps split K to keep enough loads in flight."""
    E = 32 // bits
    mt = max(1, min(M, 64 // E, 16))
    if R is None:
        R = DEFAULT_R.get((A_dtype == "int8", bits), 2) if mt == 1 else 4
    if ksplit is None:   # measured on H200: split-K across warps lost to more rows per block
        ksplit = 1
    if ksplit not in (1, warps):
        raise ValueError(f"ksplit must be 1 or warps={warps}, got {ksplit}")
    return R, mt, ksplit


# rows per warp at M = 1, keyed by (int8 activations, weight bits), with default_warps(1) = 8
# warps per block: the best fixed choice over the eight LLaMA-7B / 70B shapes on H200
# (benchmarks/results/ttile.md; R=2 x 8 warps beat R=4 x 4 warps for W4A16, NF4, FP8, W2A8)
DEFAULT_R = {(False, 8): 2, (False, 4): 2, (False, 2): 4, (False, 1): 4,
             (True, 8): 2, (True, 4): 4, (True, 2): 2}


def default_warps(M: int) -> int:
    """Warps per block of the CUDA-core kernel: 8 at M = 1 (more loads in flight per SM), else 4."""
    return 8 if M == 1 else 4


def _staged_row(spec: KernelSpec) -> tuple[int, int]:
    """(activation bytes of one lane chunk, padded bytes of one staged activation row)."""
    ca = 4 * (32 // spec.bits) * (1 if spec.A_dtype == "int8" else 2)
    return ca, (spec.K_pad * spec.bits // 128) * (ca + 16)          # 16 B pad per chunk


def stages_activations(spec: KernelSpec) -> bool:
    """The CUDA-core kernel stages the block's activation rows in shared memory (where they fit and
    a lane's chunk covers at least 64 activation bytes, unless spec.stage_a says otherwise)."""
    ca, srow = _staged_row(spec)
    return (ca >= 64 if spec.stage_a is None else spec.stage_a) and spec.MT * srow <= A_SMEM_MAX


def default_batch(spec: KernelSpec, sms: int) -> int:
    """Chunks per row a lane loads together in the CUDA-core kernel at M = 1, as measured on the
    H200 over the benchmark's eight shapes (benchmarks/diag/gemv_variants.py): 8-bit weights 2
    (0.34-0.80 -> 0.53-0.92 of copy bandwidth); int4 with 16-bit activations 2 where the grid
    gives each SM fewer than 4 blocks (too few warps to cover the memory latency: 4096-row
    shapes 0.36 -> 0.40, 0.45 -> 0.55), else 1 (more registers per warp cost more than they
    give: 10240 x 8192 0.67 -> 0.63) and where the activations are not staged in shared memory
    (8192 x 28672: 0.74 with 1, 0.51-0.75 over two runs with 2); everything else 1 (table types
    are bound by their lookups; int2 x int8 gained on some shapes and lost on others)."""
    if spec.M != 1 or spec.dq == "lut":
        return 1
    if spec.bits == 8:
        return 2
    blocks = spec.N / (spec.R * (spec.warps if spec.ksplit == 1 else 1))
    if spec.bits == 4 and spec.A_dtype != "int8" and blocks < 4 * sms and stages_activations(spec):
        return 2
    return 1


def render(spec: KernelSpec, kind: str = "gemv") -> tuple[str, str]:
    """(kernel name, CUDA source) for the fused GEMV/GEMM or the dequantise-only kernel."""
    tt = get_ttype(spec.W_dtype)
    bits, E = spec.bits, 32 // spec.bits
    a8 = spec.A_dtype == "int8"
    T = "__half" if a8 else _CT[spec.A_dtype]
    via_half = (not a8) and T != "__half" and spec.dq == "magic" and bits > 4
    base = 0x6400 if (T == "__half" or via_half) else 0x4300
    zq = (1 << (bits - 1)) if spec.zmode == "sym" else 0
    lut = ()
    if spec.dq == "lut":
        levels = tt.table if tt.kind == "table" else get_ttype(tt.element or tt.name).decode(np.arange(16))
        lut = tuple(repr(float(v)) + "f" for v in levels)
    scaled = (not a8) or spec.out_dtype != "int32"
    abytes = 1 if a8 else 2
    ca, srow = _staged_row(spec)
    a_smem = kind == "gemv" and stages_activations(spec)
    lut_copies = lut_table_copies(spec.MT * srow if a_smem else 0) if kind == "gemv" and spec.dq == "lut" else 1
    mma = {}
    if kind == "mma":
        ks = 512 if bits == 1 else 256
        mma = dict(ks=ks, mt16=max(1, min(-(-spec.M // 16), 4 if ks == 256 else 2)), K_pad=spec.K_pad,
                   N_pad=spec.N_pad, mma_t="f16" if spec.A_dtype == "fp16" else "bf16")
    if kind == "tc":
        from .prefill import occupancy
        half = spec.A_dtype == "fp16"
        mma = dict(tc=spec.tile, mma_t="f16" if half else "bf16", magic_f="1024.0f" if half else "128.0f",
                   one2="0x3c003c00" if half else "0x3f803f80", tc_minb=occupancy(spec.tile, spec.dq == "lut", spec.zmode == "quantized"))
    if kind == "dequant":   # M-independent: one kernel serves every large M
        spec = dataclasses.replace(spec, M=0, R=1, MT=1, ksplit=1, with_bias=False, out_dtype=spec.A_dtype)
    zname = f"_z{spec.zeros_mode}" if spec.zeros_mode else ""
    name = f"ttile_{kind}_{spec.W_dtype}_{spec.A_dtype}_{spec.out_dtype}{zname}_g{spec.group_size}"
    if kind == "tc":        # M is a kernel argument: one kernel per M bucket's tile
        name += f"_n{spec.N}_k{spec.K}_{spec.tile.tag}" + ("_b" if spec.with_bias else "")
    else:
        name += (f"_m{spec.M}_n{spec.N}_k{spec.K}_r{spec.R}s{spec.ksplit}" + (f"w{spec.warps}" if spec.warps != 4 else "")
                 + (f"p{spec.stages}" if spec.stages != 2 else "") + (f"b{spec.batch}" if spec.batch != 1 else "")
                 + ("" if spec.stage_a is None else f"a{int(spec.stage_a)}"))
    if a8:
        b_c = "float" if scaled else "int"
        bias_load = "bias[n0 + r]"
    else:
        b_c = T
        bias_load = "__half2float(bias[n0 + r])" if T == "__half" else "__bfloat162float(bias[n0 + r])"
    ctx = dict(
        kind=kind, name=name, title=f"W={spec.W_dtype} A={spec.A_dtype} out={spec.out_dtype} "
        f"group={spec.group_size} zeros={spec.zeros_mode} layout={spec.layout}",
        M=spec.M, N=spec.N, K=spec.K, G=spec.group_size, ngroups=spec.K_pad // spec.group_size,
        chunks=spec.K_pad * bits // 128, bits=bits, E=E, R=spec.R, MT=spec.MT, warps=spec.warps,
        ksplit=spec.ksplit, wps=max(1, min(4, spec.group_size // E)),
        abytes=abytes, ca=ca, srow=srow, a_smem=a_smem, stages=spec.stages, batch=spec.batch,
        lut_copies=lut_copies, lut_entry_log2=2 + lut_copies.bit_length() - 1,
        T=T, T2="__half2" if T == "__half" else "__nv_bfloat162", OUT=_CT[spec.out_dtype],
        dq=spec.dq, zmode=spec.zmode, A_int8=a8, scaled=scaled, via_half=via_half,
        mask=hex(((1 << bits) - 1) * 0x00010001), mask8=hex(((1 << bits) - 1) * 0x01010101),
        magic=hex(base * 0x00010001), base=hex(base), zc2=hex((base + zq) * 0x00010001), zq=zq,
        need_asum=spec.zmode in ("original", "rescale"), lut=lut,
        a_vec=spec.K % (16 if a8 else 8) == 0,
        A_C="int8_t" if a8 else T, S_C="uint8_t" if spec.zmode == "mx" else "__half",
        Z_C="uint8_t" if spec.zmode != "original" and spec.zmode != "rescale" else "__half",
        B_C=b_c, O_C=_CT[spec.out_dtype], bias=spec.with_bias, bias_load=bias_load, **mma,
    )
    return name, _ENV.get_template("typed_gemv.cu.j2").render(**ctx)


def combinations() -> list[tuple[str, str, str | None, str]]:
    """Every (A_dtype, W_dtype, zeros_mode, out_dtype) with a generated kernel."""
    out = []
    for a in ("fp16", "bf16", "int8"):
        for w in KERNEL_WTYPES[a]:
            if a == "int8":
                out += [(a, w, None, "int32"), (a, w, None, "fp16")]
            elif w.startswith("uint"):
                out += [(a, w, zm, a) for zm in ("original", "rescale", "quantized")]
            else:
                out.append((a, w, None, a))
    return out
