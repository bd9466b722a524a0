"""The AMD GPUs the HIP backend is modelled on (vendor datasheet figures). Residency limits from
the CDNA ISA guides: 10 wavefronts per SIMD x 4 SIMDs, 512 VGPRs of 64 lanes per SIMD."""
from __future__ import annotations

from powerfusion.targets.target_spec import MemorySystem, Occupancy, TargetSpec, gpu_spec

_CDNA1 = Occupancy(40, 16, 4 * 512 * 64, 256, 64 << 10, 64 << 10)
_CDNA2 = Occupancy(32, 16, 4 * 512 * 64, 512, 64 << 10, 64 << 10)

DEVICES: dict[str, TargetSpec] = {
    "mi100": gpu_spec("MI100", "hip", 64, 120, 1.2e12, 32 << 30, 64 << 10, 256 * 4 * 64,
                      {"float32": 23.1e12, "float16": 184.6e12, "bfloat16": 92.3e12, "int8": 184.6e12},
                      23.1e12, 6e-6, 10e12, _CDNA1, MemorySystem(800e-9, 8 << 20, 2.0e12, 0.8, 64)),
    "mi250": gpu_spec("MI250", "hip", 64, 208, 3.2e12, 128 << 30, 64 << 10, 256 * 4 * 64,
                      {"float32": 47.9e12, "float16": 362e12, "bfloat16": 362e12, "int8": 362e12},
                      47.9e12, 6e-6, 20e12, _CDNA2, MemorySystem(800e-9, 16 << 20, 4.0e12, 0.8, 64)),
}
