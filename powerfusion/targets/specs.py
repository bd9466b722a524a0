"""Hardware specs of the targets we model. Figures are vendor datasheet numbers
unless a calibration file under benchmarks/results/ says otherwise (the perf-model
issue replaces the lent GPU's figures with measured ones).

Levels are the abstract GLOBAL > SHARED > REGISTER of docs/design.md.
"""
from __future__ import annotations

from functools import lru_cache

# the spec types live apart so that calibration.py reads them without importing this table
from powerfusion.targets.target_spec import LevelSpec, MemorySystem, Occupancy, TargetSpec  # noqa: F401


def _gpu(name, backend, lanes, sms, bw, hbm, smem, regs, peaks, vec, launch, l2bw, occupancy=None, memory=None):
    return TargetSpec(
        name, backend, lanes, 32 if lanes == 32 else 16, sms,
        {"global": LevelSpec(bw, hbm), "shared": LevelSpec(l2bw, smem), "register": LevelSpec(l2bw * 4, regs)},
        peaks, vec, launch,
        {"lane": 0.0, "warp": 2e-9, "block": 2e-8, "device": launch},
        occupancy, memory,
    )


# Residency limits from the vendors' occupancy tables (CUDA C Programming Guide, compute
# capability 8.0 / 9.0; AMD CDNA ISA guides: 10 wavefronts per SIMD x 4 SIMDs; 512 VGPRs of
# 64 lanes per SIMD; MLU370: 4 IPU cores per cluster, 2 MiB SRAM per cluster).
_AMPERE = Occupancy(64, 32, 65536, 255, 164 << 10, 163 << 10)
_HOPPER = Occupancy(64, 32, 65536, 255, 228 << 10, 227 << 10)
_CDNA1 = Occupancy(40, 16, 4 * 512 * 64, 256, 64 << 10, 64 << 10)
_CDNA2 = Occupancy(32, 16, 4 * 512 * 64, 512, 64 << 10, 64 << 10)


TARGETS: dict[str, TargetSpec] = {
    "a100": _gpu("A100-40GB-PCIe", "cuda", 32, 108, 1.555e12, 40 << 30, 164 << 10, 255 * 4 * 32,
                 {"float32": 19.5e12, "tf32": 156e12, "float16": 312e12, "bfloat16": 312e12, "int8": 624e12},
                 19.5e12, 4e-6, 19e12, _AMPERE, MemorySystem(600e-9, 40 << 20, 4.0e12)),
    "h100": _gpu("H100-SXM", "cuda", 32, 132, 3.35e12, 80 << 30, 228 << 10, 255 * 4 * 32,
                 {"float32": 67e12, "tf32": 495e12, "float16": 989e12, "bfloat16": 989e12, "int8": 1979e12},
                 67e12, 3e-6, 33e12, _HOPPER, MemorySystem(650e-9, 50 << 20, 8.0e12)),
    "h200": _gpu("H200", "cuda", 32, 132, 4.8e12, 141 << 30, 228 << 10, 255 * 4 * 32,
                 {"float32": 67e12, "tf32": 495e12, "float16": 989e12, "bfloat16": 989e12, "int8": 1979e12},
                 67e12, 3e-6, 33e12, _HOPPER, MemorySystem(650e-9, 50 << 20, 8.0e12)),
    "mi100": _gpu("MI100", "hip", 64, 120, 1.2e12, 32 << 30, 64 << 10, 256 * 4 * 64,
                  {"float32": 23.1e12, "float16": 184.6e12, "bfloat16": 92.3e12, "int8": 184.6e12},
                  23.1e12, 6e-6, 10e12, _CDNA1, MemorySystem(800e-9, 8 << 20, 2.0e12, 0.8, 64)),
    "mi250": _gpu("MI250", "hip", 64, 208, 3.2e12, 128 << 30, 64 << 10, 256 * 4 * 64,
                  {"float32": 47.9e12, "float16": 362e12, "bfloat16": 362e12, "int8": 362e12},
                  47.9e12, 6e-6, 20e12, _CDNA2, MemorySystem(800e-9, 16 << 20, 4.0e12, 0.8, 64)),
    "mlu370": TargetSpec(
        "MLU370-X4", "mlu", 1, 4, 8,
        {"global": LevelSpec(307e9, 24 << 30), "shared": LevelSpec(1.2e12, 2 << 20), "register": LevelSpec(4e12, 768 << 10)},
        {"float32": 24e12, "float16": 96e12, "bfloat16": 96e12, "int8": 256e12}, 24e12, 10e-6,
        {"lane": 0.0, "warp": 0.0, "block": 1e-7, "device": 10e-6},
        Occupancy(4, 1, 1 << 20, 1 << 20, 2 << 20, 2 << 20, 0), MemorySystem(1e-6, 0, 307e9, 0.85, 64)),
    "cpu": TargetSpec(
        "generic-CPU", "cpu", 1, 1, 8,
        {"global": LevelSpec(50e9, 64 << 30), "shared": LevelSpec(200e9, 1 << 20), "register": LevelSpec(1e12, 32 << 10)},
        {"float32": 1e12, "float16": 0.5e12, "bfloat16": 0.5e12, "int8": 2e12}, 1e12, 1e-6,
        {"lane": 0.0, "warp": 0.0, "block": 0.0, "device": 1e-6}),
}
ALIASES = {"cuda": "h200", "hip": "mi250", "mlu": "mlu370", "cpu-reference": "cpu"}


def get_target(name: str) -> TargetSpec:
    """The target's spec; where a calibration of that GPU is stored (targets/calibrated/),
    its measured perf-model figures replace the datasheet ones."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in TARGETS:
        from powerfusion.errors import PowerFusionError
        raise PowerFusionError(f"unknown target '{name}'; known: {', '.join(sorted(TARGETS) + sorted(ALIASES))}")
    return _calibrated(key)


@lru_cache(maxsize=None)
def _calibrated(key: str) -> TargetSpec:
    from powerfusion.targets.calibration import apply_calibration, load_calibration
    cal = load_calibration(key)
    return apply_calibration(TARGETS[key], cal) if cal else TARGETS[key]
