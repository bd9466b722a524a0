"""tTile-device specs (sm_80, sm_90) and Ladder's hint-based scheduling (Algorithm 1)
for a typed GEMM C[M, N] = A[M, K] . W[N, K]^T.

A device is a list of levels, lowest memory first; each level states the tile it
wants as (granularity in bits, shape in units of that granularity). GetDeviceHint
takes the LCM of the granularities, re-expresses every level's tile in it and takes
the LCM of the shapes: that hint is the tile each operator's tiles must be a
multiple of. ScheduleTransform then decides slice / pad / convert / map per level.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from powerfusion.targets.specs import TargetSpec, get_target

from .prefill import BK, MIN_M, supports
from .ttype import get_ttype


@dataclass(frozen=True, slots=True)
class LevelTile:
    level: str             # global | shared | register | core
    granularity_bits: int  # tType of the requirement, as bits (32 B transaction -> 8 x [32])
    shape: tuple[int, ...]
    what: str              # the hardware fact behind it


@dataclass(frozen=True, slots=True)
class ComputeUnit:
    name: str              # hfma2 | mma.m16n8k16 | dp4a | mma.m16n8k32.s8
    operand: str           # hardware tType the unit multiplies
    lanes_bits: tuple[int, ...]   # operand elements packed per 32-bit register, by bit offset
    flops_key: str         # key into TargetSpec.peak_flops, or "vector"


@dataclass(frozen=True, slots=True)
class TTileDevice:
    arch: str
    levels: tuple[LevelTile, ...]
    units: tuple[ComputeUnit, ...]


_HFMA2 = ComputeUnit("hfma2", "fp16", (0, 16), "vector")
_HFMA2_BF = ComputeUnit("hfma2.bf16", "bf16", (0, 16), "vector")
_DP4A = ComputeUnit("dp4a", "int8", (0, 8, 16, 24), "vector")
_MMA16 = ComputeUnit("mma.m16n8k16", "fp16", (0, 16), "float16")
_MMA_BF = ComputeUnit("mma.m16n8k16.bf16", "bf16", (0, 16), "bfloat16")
_MMA8 = ComputeUnit("mma.m16n8k32.s8", "int8", (0, 8, 16, 24), "int8")


def _levels():
    return (
        LevelTile("global", 8, (32,), "32-byte global memory transactions"),
        LevelTile("shared", 32, (32,), "32 four-byte shared memory banks"),
        LevelTile("register", 128, (16, 2), "ldmatrix: 16 rows x 2 of 16 bytes"),
        LevelTile("core", 16, (16, 16), "mma.m16n8k16 A operand, fp16"),
    )


DEVICES = {
    "sm_80": TTileDevice("sm_80", _levels(), (_MMA16, _MMA_BF, _MMA8, _HFMA2, _HFMA2_BF, _DP4A)),
    # Hopper keeps the sm_80 transaction sizes and mma shapes (wgmma is not used here)
    "sm_90": TTileDevice("sm_90", _levels(), (_MMA16, _MMA_BF, _MMA8, _HFMA2, _HFMA2_BF, _DP4A)),
}


def _lcm_shapes(a: tuple[int, ...] | None, b: tuple[int, ...]) -> tuple[int, ...]:
    """Elementwise LCM, right-aligned (a missing leading dim counts as 1)."""
    if a is None:
        return b
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + a
    b = (1,) * (n - len(b)) + b
    return tuple(math.lcm(x, y) for x, y in zip(a, b))


@dataclass(frozen=True, slots=True)
class Hint:
    granularity_bits: int
    shape: tuple[int, ...]     # in units of granularity_bits

    @property
    def inner_bytes(self) -> int:
        return self.shape[-1] * self.granularity_bits // 8


def device_hint(device: TTileDevice, levels: tuple[str, ...] = ("global", "shared", "register")) -> Hint:
    """GetDeviceHint (Algorithm 1, lines 1-11) over the memory levels."""
    chosen = [lv for lv in device.levels if lv.level in levels]
    gran = 1
    for lv in chosen:
        gran = math.lcm(gran, lv.granularity_bits)
    shape = None
    for lv in chosen:
        inner = lv.shape[-1] * lv.granularity_bits // gran   # convert(layer.tTile, HintGranularity)
        conv = lv.shape[:-1] + (max(1, inner),)
        shape = _lcm_shapes(shape, conv)
    return Hint(gran, shape)


@dataclass(frozen=True, slots=True)
class Transform:
    level: str
    kind: str      # slice | pad | convert | map
    detail: str


@dataclass(frozen=True, slots=True)
class Schedule:
    unit: ComputeUnit
    hint: Hint
    k_tile: int                 # elements of K one lane loads at once (16 bytes of W)
    k_pad: int
    layout: str                 # natural | pair | dp4a: word layout chosen at pack time
    convert_at: str             # register (fused kernel) | global (dequantise pass + library GEMM)
    kernel: str                 # gemv (CUDA cores) | tc (prefill, tensor cores, GEMV words) | mma | dequant (+ cuBLAS)
    transforms: tuple[Transform, ...]
    predicted_s: dict


def select_unit(device: TTileDevice, A_dtype: str, W_dtype: str, tensor_cores: bool) -> ComputeUnit:
    """SelectDeviceConfig: the unit whose operand type the weights convert to loss-free
    and whose operand has the fewest bits (fewer bits: more throughput per transistor)."""
    w = get_ttype(W_dtype)
    want = "int8" if A_dtype == "int8" else A_dtype
    ok = [u for u in device.units if u.operand == want and (u.flops_key != "vector") == tensor_cores
          and (u.operand in w.converts_to or w.kind in ("table", "block", "float") or u.operand == "fp32")]
    if not ok:
        raise ValueError(f"{device.arch} has no unit for W={W_dtype} x A={A_dtype}")
    return min(ok, key=lambda u: 32 // len(u.lanes_bits))


def word_layout(W_dtype: str, unit: ComputeUnit) -> str:
    """ScheduleMap: the bit distance between consecutive W elements must match the unit's
    operand lanes, else a `map` interleaves them at pack time. Byte-aligned fp8 is moved by
    a free byte permute and table types are looked up per byte, so they keep their order."""
    w = get_ttype(W_dtype)
    if w.kind not in ("int", "uint"):
        return "natural"
    step = unit.lanes_bits[1] - unit.lanes_bits[0]
    if w.bits == step:
        return "natural"
    return "dp4a" if unit.operand == "int8" else "pair"


# the prefill kernel (mma.sync) reached 0.11-0.23 of H200's fp16 tensor peak at M = 128 / 256
# (median 0.17; benchmarks/results/ttile-prefill.md): with this fraction the model keeps
# 16 <= M <= 64 on it and larger fp16 M on dequantise + cuBLAS, as measured
TC_PEAK_FRACTION = 0.17
# dequantise + cuBLAS with bf16 activations: fp32 GEMM output, then CuPy's conversion to bf16
# bits (several launches); measured 1.4x-4.9x the fp16 path at M = 256 (416 against 85 us on
# 4096 x 4096, 1507 against 700 us on 57344 x 8192): modelled as 2x the fp16 path + 200 us
BF16_TWO_PASS = (2.0, 200e-6)


def schedule_typed_gemm(M: int, N: int, K: int, A_dtype: str, W_dtype: str, group: int | None,
                        arch: str = "sm_90", target: TargetSpec | str = "h200",
                        kernel: str | None = None, zeros_mode: str | None = None) -> Schedule:
    """Algorithm 1 for one typed-GEMM tTile-operator. The convert placement is decided by
    a small model (the profiling step's stand-in): fuse the conversion into a CUDA-core
    kernel (weights cross HBM once, in low precision) or convert at the global level and
    run the library's tensor-core GEMM, whichever is predicted faster."""
    dev = DEVICES[arch]
    tgt = get_target(target) if isinstance(target, str) else target
    w = get_ttype(W_dtype)
    hint = device_hint(dev)
    k_tile = 128 // w.bits                                  # one 16-byte load per lane
    assert (16 * 8) % hint.granularity_bits == 0            # a 16-byte load is hint-aligned
    g = group if group and group < K else None
    step = math.lcm(k_tile, g) if g else k_tile
    k_pad = -(-K // step) * step
    a_bytes = 1 if A_dtype == "int8" else 2
    bw = tgt.bandwidth
    # half2 FMA / dp4a pack 2 / 4 MACs; dequantisation costs about as many instructions again
    vec = tgt.vector_flops * (2 if A_dtype != "int8" else 4) * 0.5
    flops = 2.0 * M * N * K
    fused = max(N * k_pad * w.bits / 8 / bw + M * K * a_bytes / bw, flops / vec)
    tc = tgt.peak_flops.get({"fp16": "float16", "bf16": "bfloat16"}.get(A_dtype, "int8"), vec)
    two_pass = N * K * (w.bits / 8 + 2 * 2) / bw + max(flops / tc, (N * K + M * K + M * N) * 2 / bw)
    # fused on tensor cores: weights once from HBM, mma at a fraction of peak (dequantisation,
    # ldmatrix and barriers share the warps); only where a 32-bit word stays in one group
    mma_ok = A_dtype != "int8" and w.kind != "block" and M >= 16 and (g or K) >= 4 * (32 // w.bits)
    fused_mma = max(N * k_pad * w.bits / 8 / bw, flops / (tc * 0.15)) if mma_ok else math.inf
    # the prefill kernel (prefill.py, mma.sync, GEMV words), at the fraction of tensor peak it reached
    zmode = zeros_mode or ("sym" if w.kind == "int" else "none")
    tc_ok = M >= MIN_M and supports(A_dtype, W_dtype, zmode, g or k_pad, K, k_pad) is None
    fused_tc = max(N * k_pad * w.bits / 8 / bw, flops / (tc * TC_PEAK_FRACTION)) if tc_ok else math.inf
    if A_dtype == "bf16" and tc_ok:   # measured against the prefill kernel only
        two_pass = two_pass * BF16_TWO_PASS[0] + BF16_TWO_PASS[1]
    costs = {"gemv": fused, "tc": fused_tc, "mma": fused_mma, "dequant": math.inf if A_dtype == "int8" else two_pass}
    if kernel is None:
        kernel = min(costs, key=costs.get)
    elif costs.get(kernel, math.inf) == math.inf:
        raise ValueError(f"kernel {kernel!r} cannot run W={W_dtype} x A={A_dtype} at M={M}, group={g}")
    if kernel == "mma":   # the mma kernel walks K in 256- or 512-element slabs
        slab = 512 if w.bits == 1 else 256
        step = math.lcm(slab, g) if g else slab
        k_pad = -(-K // step) * step
    convert_at = "global" if kernel == "dequant" else "register"
    unit = select_unit(dev, A_dtype, W_dtype, tensor_cores=kernel != "gemv")
    layout = word_layout(W_dtype, unit) if kernel != "dequant" else word_layout(
        W_dtype, select_unit(dev, A_dtype, W_dtype, tensor_cores=False))
    tr = [Transform("global", "slice", f"W[{N},{K}] -> rows x {k_tile}-element chunks (16 B per lane)")]
    if k_pad != K:
        tr.append(Transform("global", "pad", f"K {K} -> {k_pad} (chunk {k_tile}, group {g or 'per-channel'})"))
    if layout != "natural":
        tr.append(Transform("global", "map", f"{layout} interleave inside 32-bit words (pack time)"))
    if kernel == "mma":
        tr.append(Transform("global", "map", "8-row tiles: each lane's 16 bytes hold its mma B fragments"))
    if kernel == "tc":
        tr.append(Transform("shared", "slice", f"cp.async ring of {BK}-element K stages (activations, packed rows)"))
    tr.append(Transform(convert_at, "convert", f"{W_dtype} -> {unit.operand} ({unit.name})"))
    return Schedule(unit, hint, k_tile, k_pad, layout, convert_at, kernel, tuple(tr),
                    {"fused_cuda_core_s": fused, "fused_tc_s": fused_tc, "fused_mma_s": fused_mma,
                     "dequant_then_library_s": two_pass})
