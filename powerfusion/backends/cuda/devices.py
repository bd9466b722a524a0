"""The NVIDIA GPUs the CUDA backend is modelled on (vendor datasheet figures; a calibration under
targets/calibrated/ replaces them with measured ones). Residency limits from the CUDA C
Programming Guide, compute capability 8.0 / 9.0."""
from __future__ import annotations

from powerfusion.targets.target_spec import MemorySystem, Occupancy, TargetSpec, gpu_spec

_AMPERE = Occupancy(64, 32, 65536, 255, 164 << 10, 163 << 10)
_HOPPER = Occupancy(64, 32, 65536, 255, 228 << 10, 227 << 10)
_HOPPER_PEAKS = {"float32": 67e12, "tf32": 495e12, "float16": 989e12, "bfloat16": 989e12, "int8": 1979e12}

DEVICES: dict[str, TargetSpec] = {
    "a100": gpu_spec("A100-40GB-PCIe", "cuda", 32, 108, 1.555e12, 40 << 30, 164 << 10, 255 * 4 * 32,
                     {"float32": 19.5e12, "tf32": 156e12, "float16": 312e12, "bfloat16": 312e12, "int8": 624e12},
                     19.5e12, 4e-6, 19e12, _AMPERE, MemorySystem(600e-9, 40 << 20, 4.0e12)),
    "h100": gpu_spec("H100-SXM", "cuda", 32, 132, 3.35e12, 80 << 30, 228 << 10, 255 * 4 * 32, _HOPPER_PEAKS,
                     67e12, 3e-6, 33e12, _HOPPER, MemorySystem(650e-9, 50 << 20, 8.0e12)),
    "h200": gpu_spec("H200", "cuda", 32, 132, 4.8e12, 141 << 30, 228 << 10, 255 * 4 * 32, _HOPPER_PEAKS,
                     67e12, 3e-6, 33e12, _HOPPER, MemorySystem(650e-9, 50 << 20, 8.0e12)),
}
