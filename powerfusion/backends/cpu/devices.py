"""The generic CPU the C backend is modelled on: one lane per unit, caches as the shared level."""
from __future__ import annotations

from powerfusion.targets.target_spec import LevelSpec, TargetSpec

DEVICES: dict[str, TargetSpec] = {
    "cpu": TargetSpec(
        "generic-CPU", "cpu", 1, 1, 8,
        {"global": LevelSpec(50e9, 64 << 30), "shared": LevelSpec(200e9, 1 << 20), "register": LevelSpec(1e12, 32 << 10)},
        {"float32": 1e12, "float16": 0.5e12, "bfloat16": 0.5e12, "int8": 2e12}, 1e12, 1e-6,
        {"lane": 0.0, "warp": 0.0, "block": 0.0, "device": 1e-6}),
}
