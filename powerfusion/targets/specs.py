"""The targets we model, by name: each backend's devices (`backends/<name>/devices.py`, named by
its registration in targets/registry.py) with vendor datasheet figures, unless a calibration
file under targets/calibrated/ says otherwise (measured figures of the lent GPU replace them).
A backend's own name (`cuda`, `hip`, ...) and its registered aliases select its default device.

Levels are the abstract GLOBAL > SHARED > REGISTER of docs/design.md.
"""
from __future__ import annotations

from functools import lru_cache

from powerfusion.errors import PowerFusionError
# the spec types live apart so that calibration.py reads them without importing this table
from powerfusion.targets.target_spec import LevelSpec, MemorySystem, Occupancy, TargetSpec  # noqa: F401


@lru_cache(maxsize=None)
def targets() -> dict[str, TargetSpec]:
    """Every registered backend's devices, by name."""
    from powerfusion.targets.registry import BACKENDS
    table: dict[str, TargetSpec] = {}
    for b in BACKENDS.values():
        for name, spec in b.load_devices().items():
            if name in table or spec.backend != b.name:
                raise PowerFusionError(f"backend '{b.name}' registers device '{name}' "
                                       + ("twice" if name in table else f"of backend '{spec.backend}'"))
            table[name] = spec
    return table


@lru_cache(maxsize=None)
def aliases() -> dict[str, str]:
    """Other names of a device: each backend's name and its registered aliases -> its default device."""
    from powerfusion.targets.registry import BACKENDS
    return {alias: b.default_device for b in BACKENDS.values() if b.default_device
            for alias in (b.name, *b.aliases) if alias != b.default_device}


def get_target(name: str) -> TargetSpec:
    """The target's spec; where a calibration of that GPU is stored (targets/calibrated/),
    its measured perf-model figures replace the datasheet ones."""
    key = aliases().get(name.lower(), name.lower())
    if key not in targets():
        raise PowerFusionError(f"unknown target '{name}'; known: {', '.join(sorted(targets()) + sorted(aliases()))}")
    return _calibrated(key)


@lru_cache(maxsize=None)
def _calibrated(key: str) -> TargetSpec:
    from powerfusion.targets.calibration import apply_calibration, load_calibration
    cal = load_calibration(key)
    return apply_calibration(targets()[key], cal) if cal else targets()[key]
