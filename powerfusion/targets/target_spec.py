"""What a target spec is: `TargetSpec` with its memory levels, occupancy limits and memory
system (the figures of each device are in its backend's folder, `backends/<name>/devices.py`,
found through the registry; calibration.py replaces them with
measured ones)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LevelSpec:
    bandwidth: float       # bytes/s, whole device
    capacity: int          # bytes per group (SHARED), per unit (REGISTER) or whole device (GLOBAL)


@dataclass(frozen=True, slots=True)
class Occupancy:
    """What limits how many units are resident on one SM / CU / cluster at a time."""
    units_per_sm: int          # resident warps / wavefronts / pipelines
    groups_per_sm: int         # resident blocks / workgroups
    regs_per_sm: int           # 32-bit registers (per lane slot) on one SM / CU
    max_regs_per_lane: int     # beyond this the compiler spills to local memory
    shared_per_sm: int         # bytes of shared memory / LDS / SRAM per SM / CU / cluster
    shared_per_group_max: int  # bytes one block may use
    reg_overhead: int = 24     # registers per lane for indices, pointers, loop state


@dataclass(frozen=True, slots=True)
class MemorySystem:
    """Global memory as a latency-bound pipe (Little's law) behind a last-level cache."""
    latency_s: float           # DRAM load latency under load
    cache_bytes: int           # last-level cache (L2 / Infinity cache / none)
    cache_bandwidth: float     # bytes/s of cache hits
    achievable: float = 0.9    # fraction of the datasheet bandwidth a copy kernel reaches
    sector_bytes: int = 32     # smallest DRAM/L2 transaction
    # measured (calibration) where present, else derived from the figures above:
    bw_curve: tuple[tuple[float, float], ...] = ()  # (resident warps per SM, bytes/s per SM), float4 copy
    curve_ilp: float = 1.0       # loads in flight per lane in the copy that measured bw_curve
    scatter_read: float = 0.0    # bytes/s of extra sectors of uncoalesced reads (0: 1.5 x bandwidth)
    scatter_write: float = 0.0   # the same for uncoalesced writes (0: 0.7 x bandwidth)
    kernel_floor_s: float = 0.0  # a tiny kernel's time beyond the launch (0: two latencies)


@dataclass(frozen=True, slots=True)
class TargetSpec:
    name: str
    backend: str                      # cuda | hip | mlu | cpu
    lanes: int                        # lanes per parallel unit (warp 32, wavefront 64, 1)
    units_per_group_max: int          # warps per block, wavefronts per workgroup, pipelines per cluster
    groups_concurrent: int            # SMs / CUs / IPU clusters (x resident groups is the perf model's job)
    levels: dict[str, LevelSpec]      # "global" | "shared" | "register"
    peak_flops: dict[str, float]      # per dtype, dense, FLOP/s (library ops; tensor cores where any)
    vector_flops: float               # non-tensor fp32 FLOP/s (elementwise chains)
    launch_s: float                   # per kernel launch
    sync_s: dict[str, float] = field(default_factory=dict)  # per scope, per occurrence
    occupancy: "Occupancy | None" = None  # residency limits per SM/CU/cluster (perf model)
    memory: "MemorySystem | None" = None   # latency, cache, bandwidth-vs-parallelism (perf model)
    calibrated: str = ""                   # where measured figures came from ("" = datasheet)

    @property
    def bandwidth(self) -> float:
        return self.levels["global"].bandwidth

    def ridge_point(self, dtype: str = "float32") -> float:
        """FLOPs per byte above which an op is compute-bound."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"]) / self.bandwidth


def gpu_spec(name, backend, lanes, sms, bw, hbm, smem, regs, peaks, vec, launch, l2bw,
             occupancy=None, memory=None) -> TargetSpec:
    """A GPU's spec from its datasheet figures: DRAM bandwidth and size, shared memory and
    registers per SM, peak FLOP/s per dtype, launch latency and L2 bandwidth."""
    return TargetSpec(
        name, backend, lanes, 32 if lanes == 32 else 16, sms,
        {"global": LevelSpec(bw, hbm), "shared": LevelSpec(l2bw, smem), "register": LevelSpec(l2bw * 4, regs)},
        peaks, vec, launch,
        {"lane": 0.0, "warp": 2e-9, "block": 2e-8, "device": launch},
        occupancy, memory,
    )
