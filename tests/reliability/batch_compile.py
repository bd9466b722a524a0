"""Compile many emitted GPU kernels with few compiler runs, for the fuzzer's compile profiles.

One nvcc or hipcc run costs about a second of start-up whatever it compiles, so compiling each
fuzzed kernel on its own bounds a run to a few hundred examples. Here identical sources are
compiled once, the rest are concatenated into translation units of up to `per_unit` kernels
(kernel `n`'s entry point renamed `pf_case<n>_<name>`, so units hold no two symbols of one
name; the dialects' shared helpers sit under include guards for exactly this), and units are
compiled `jobs` at a time. A unit that fails is split in halves until the kernels that fail on
their own are found, each reported with the compiler's message; a unit that fails while all its
kernels pass alone is reported too (a clash of the concatenation, never passed over silently).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kernel:
    name: str          # entry point in `source`
    source: str
    origin: str        # what made it (the fuzzed model as text), for the failure report


@dataclass(frozen=True)
class Failure:
    kernels: tuple[Kernel, ...]   # one kernel that fails alone, or a unit that fails only together
    message: str


@dataclass(frozen=True)
class Compiler:
    """A compile-only command line: `argv(src, out)` and the file suffix it wants."""
    name: str
    suffix: str
    arch: str

    def argv(self, src: Path, out: Path) -> list[str]:
        if self.name == "nvcc":
            return [shutil.which("nvcc"), "-cubin", f"-arch={self.arch}", "-std=c++17", "-o", str(out), str(src)]
        return [shutil.which("hipcc"), f"--offload-arch={self.arch}", "--genco", "-o", str(out), str(src)]

    def env(self) -> dict:
        return {**os.environ, "HIP_PLATFORM": "amd"} if self.name == "hipcc" else dict(os.environ)


NVCC_SM90 = Compiler("nvcc", ".cu", "sm_90")
HIPCC_GFX90A = Compiler("hipcc", ".hip", "gfx90a")


def unit_source(kernels: list[Kernel], first: int = 0) -> str:
    """One translation unit: each kernel's entry point renamed by its position."""
    parts = []
    for n, k in enumerate(kernels, first):
        parts.append(re.sub(rf"\b{re.escape(k.name)}\b", f"pf_case{n}_{k.name}", k.source))
    return "\n".join(parts)


def _compile(compiler: Compiler, kernels: list[Kernel]) -> str | None:
    """None when the unit compiles, else the compiler's message."""
    with tempfile.TemporaryDirectory(prefix="pf-batch-") as tmp:
        src = Path(tmp) / f"unit{compiler.suffix}"
        src.write_text(unit_source(kernels))
        proc = subprocess.run(compiler.argv(src, Path(tmp) / "unit.out"), capture_output=True, text=True,
                              env=compiler.env())
        return None if proc.returncode == 0 else (proc.stderr + proc.stdout).strip()[-3000:]


def _failures_in(compiler: Compiler, kernels: list[Kernel], message: str) -> list[Failure]:
    """The failing kernels of a unit that failed with `message` (halving; no clash hidden)."""
    if len(kernels) == 1:
        return [Failure(tuple(kernels), message)]
    half = len(kernels) // 2
    found = []
    for part in (kernels[:half], kernels[half:]):
        msg = _compile(compiler, part)
        if msg is not None:
            found += _failures_in(compiler, part, msg)
    return found or [Failure(tuple(kernels), "fails only when compiled together:\n" + message)]


def compile_all(kernels: list[Kernel], compiler: Compiler, per_unit: int = 200,
                jobs: int | None = None) -> tuple[list[Failure], dict]:
    """(failures, counts) for every kernel; counts: kernels, distinct sources, compiler runs of
    the first pass (halving reruns not counted)."""
    distinct = list({k.source: k for k in kernels}.values())
    units = [distinct[i:i + per_unit] for i in range(0, len(distinct), per_unit)]
    jobs = jobs or min(2, os.cpu_count() or 1)

    def check(unit):
        msg = _compile(compiler, unit)
        return [] if msg is None else _failures_in(compiler, unit, msg)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        failures = [f for found in pool.map(check, units) for f in found]
    return failures, {"kernels": len(kernels), "distinct": len(distinct), "units": len(units)}
