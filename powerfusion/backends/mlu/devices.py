"""The Cambricon accelerator the BANG backend is modelled on (datasheet figures): MLU370-X4, 4 IPU
cores per cluster, 2 MiB SRAM per cluster."""
from __future__ import annotations

from powerfusion.targets.target_spec import LevelSpec, MemorySystem, Occupancy, TargetSpec

DEVICES: dict[str, TargetSpec] = {
    "mlu370": TargetSpec(
        "MLU370-X4", "mlu", 1, 4, 8,
        {"global": LevelSpec(307e9, 24 << 30), "shared": LevelSpec(1.2e12, 2 << 20), "register": LevelSpec(4e12, 768 << 10)},
        {"float32": 24e12, "float16": 96e12, "bfloat16": 96e12, "int8": 256e12}, 24e12, 10e-6,
        {"lane": 0.0, "warp": 0.0, "block": 1e-7, "device": 10e-6},
        Occupancy(4, 1, 1 << 20, 1 << 20, 2 << 20, 2 << 20, 0), MemorySystem(1e-6, 0, 307e9, 0.85, 64)),
}
