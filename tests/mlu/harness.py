"""Run BANG C source on the CPU through the bang_emu.h emulator.

`run_bang` wraps the kernel in a small C++ main (GDRAM buffers from numpy
arrays, one launch, outputs back to numpy), compiles it with g++ and returns the
outputs together with the emulator's event log and output coverage. Emulator
errors (wrong memory space, capacity, alignment, a pending async copy touched,
deadlocked barriers) and incomplete output coverage raise, with the message the
emulator printed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
HEADERS = ("bang_emu.h", "bang_emu_runtime.h", "bang_emu_ops.h")
CXX_FLAGS = ("-std=c++17", "-O1", "-pthread")
C_TYPES = {
    np.dtype(np.float32): "float", np.dtype(np.float16): "half", np.dtype(np.int32): "int32_t",
    np.dtype(np.int16): "int16_t", np.dtype(np.int8): "int8_t", np.dtype(np.uint8): "uint8_t",
    np.dtype(np.int64): "int64_t",
}
FUNC_TYPES = ("BLOCK", "UNION1", "UNION2", "UNION4", "UNION8")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True, slots=True)
class Loc:
    """Bytes an event touched: `count` segments of `seg` bytes, `stride` apart."""
    space: str    # GDRAM | NRAM | SRAM
    buffer: str   # GDRAM buffer name ("" on chip)
    offset: int   # bytes from the buffer (or NRAM / SRAM arena) start
    bytes: int    # span from the first to the last byte touched
    seg: int
    stride: int
    count: int


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    task: int          # -1 for launch-level events
    kind: str          # launch, task_begin, memcpy, memcpy_issue, memcpy_complete, wait, compute, barrier_*, ...
    op: str            # direction, __bang_* name, __sync_* name or kernel name
    copy: int | None   # copy id linking memcpy_issue to memcpy_complete
    dst: Loc | None
    srcs: tuple[Loc, ...]


@dataclass(frozen=True, slots=True)
class Coverage:
    bytes: int
    written: int
    multi_task_bytes: int                    # bytes written by more than one task
    unwritten: tuple[tuple[int, int], ...]   # [start, end) byte ranges never written

    @property
    def complete(self) -> bool:
        return self.written == self.bytes


@dataclass(frozen=True, slots=True)
class EventLog:
    events: tuple[Event, ...]
    coverage: Mapping[str, Coverage]

    def of_task(self, task: int, kind: str | None = None) -> list[Event]:
        return [e for e in self.events if e.task == task and (kind is None or e.kind == kind)]

    def uncovered(self) -> dict[str, tuple[tuple[int, int], ...]]:
        return {name: c.unwritten for name, c in self.coverage.items() if not c.complete}


class BangEmulationError(RuntimeError):
    """The emulator rejected the kernel; `log` holds the events up to the error."""

    def __init__(self, message: str, log: EventLog | None = None):
        super().__init__(message)
        self.log = log


class CoverageError(BangEmulationError):
    """The tasks together left bytes of an output unwritten."""


def run_bang(source: str, kernel_name: str, inputs: Mapping[str, np.ndarray],
             outputs: Mapping[str, tuple[tuple[int, ...], np.dtype]], task_dim: int | tuple[int, int, int],
             func_type: str = "UNION1", *, args: Sequence[str] | None = None,
             scalars: Mapping[str, int | float] | None = None, launcher: str | None = None,
             check_coverage: bool = True, timeout_s: float = 120.0) -> tuple[dict[str, np.ndarray], EventLog]:
    """Compile `source` with the emulator, launch `kernel_name` once and return (outputs, log).

    The kernel (or `launcher(queue, ...)`, an emitted host function) is called with
    `args`: buffer names from `inputs` / `outputs` (passed as device pointers) or
    names from `scalars` (passed by value); by default inputs then outputs. Outputs
    start as 0xFF bytes (NaN for floats), so unwritten elements are visible.
    """
    scalars = dict(scalars or {})
    outs = {name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in outputs.items()}
    ins = {name: np.ascontiguousarray(a) for name, a in inputs.items()}
    args = list(args) if args is not None else [*ins, *outs]
    if func_type not in FUNC_TYPES:
        raise ValueError(f"func_type must be one of {FUNC_TYPES}, got {func_type!r}")
    for name in [kernel_name, *([launcher] if launcher else []), *ins, *outs, *scalars]:
        if not _IDENT.match(name):
            raise ValueError(f"{name!r} is not a C identifier")
    for a in args:
        if a not in ins and a not in outs and a not in scalars:
            raise ValueError(f"argument {a!r} is neither an input, an output nor a scalar")
    dims = (task_dim, 1, 1) if isinstance(task_dim, int) else tuple(task_dim)
    main = _main_source(kernel_name, ins, outs, args, scalars, dims, func_type, launcher)
    exe = _build(source, main)
    with tempfile.TemporaryDirectory(prefix="pf_bang_run_") as work:
        for i, a in enumerate(ins.values()):
            a.tofile(os.path.join(work, f"in{i}.bin"))
        proc = subprocess.run([str(exe), work], capture_output=True, text=True, timeout=timeout_s)
        log = _read_log(Path(work))
        if proc.returncode != 0:
            raise BangEmulationError((proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}", log)
        results = {name: np.fromfile(os.path.join(work, f"out{i}.bin"), dtype=dt).reshape(shape)
                   for i, (name, (shape, dt)) in enumerate(outs.items())}
    if check_coverage and log.uncovered():
        gaps = "; ".join(f"{name}: bytes {list(r)[:8]}" for name, r in log.uncovered().items())
        raise CoverageError(f"{kernel_name}: tasks left output bytes unwritten: {gaps}", log)
    return results, log


def _main_source(kernel, ins, outs, args, scalars, dims, func_type, launcher) -> str:
    lines = ['#include "bang_emu.h"', "#include <string>", "#include <cstdio>", "", "#include \"kernel.mlu\"", "",
             "int main(int argc, char** argv) {",
             "  std::string dir = argv[1];",
             "  pf_bang::set_output_dir(dir);",
             "  cnrtQueue_t queue; cnrtQueueCreate(&queue);"]
    ptr = {}
    for kind, table in (("in", ins), ("out", outs)):
        for i, (name, value) in enumerate(table.items()):
            dtype, shape = (value.dtype, value.shape) if kind == "in" else (value[1], value[0])
            if dtype not in C_TYPES:
                raise ValueError(f"buffer {name!r}: dtype {dtype} is not supported by the emulator harness")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            var = f"{kind}{i}"
            ptr[name] = var
            lines += [f"  {C_TYPES[dtype]}* {var}; cnrtMalloc((void**)&{var}, {max(nbytes, 1)});",
                      f'  pf_bang::name_gdram({var}, "{name}", {"true" if kind == "out" else "false"});']
            if kind == "in":
                lines += [f'  {{ FILE* f = std::fopen((dir + "/{var}.bin").c_str(), "rb");',
                          f"    if (!f || std::fread({var}, 1, {nbytes}, f) != {nbytes}) return 2; std::fclose(f); }}"]
            else:
                lines.append(f"  std::memset({var}, 0xFF, {nbytes});")
    call_args = [ptr[a] if a in ptr else _scalar_literal(scalars[a]) for a in args]
    lines.append(f"  cnrtDim3_t dim = {{{dims[0]}, {dims[1]}, {dims[2]}}};")
    if launcher:
        lines.append(f"  {launcher}({', '.join(['queue', *call_args])});")
    else:
        lines.append(f"  PF_LAUNCH({', '.join([kernel, 'dim', 'CNRT_FUNC_TYPE_' + func_type, 'queue', *call_args])});")
    lines.append("  cnrtQueueSync(queue);")
    for i, (name, (shape, dtype)) in enumerate(outs.items()):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        lines += [f'  {{ FILE* f = std::fopen((dir + "/out{i}.bin").c_str(), "wb");',
                  f"    std::fwrite(out{i}, 1, {nbytes}, f); std::fclose(f); }}"]
    lines += ["  pf_bang::finish();", "  return 0;", "}", ""]
    return "\n".join(lines)


def _scalar_literal(v: int | float) -> str:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not math.isfinite(v):
        raise ValueError(f"scalar {v!r} must be a finite int or float")
    return f"(int){int(v)}" if isinstance(v, (int, np.integer)) else f"(float){float(v)!r}"


def _build(source: str, main: str) -> Path:
    """Compile once per distinct (source, main, headers); cached under the temp dir."""
    h = hashlib.sha256()
    for part in (source, main, *CXX_FLAGS, *((HERE / n).read_text() for n in HEADERS)):
        h.update(part.encode())
    cache = Path(tempfile.gettempdir()) / "pf_bang_emu" / h.hexdigest()[:24]
    exe = cache / "prog"
    if exe.exists():
        return exe
    build = Path(tempfile.mkdtemp(prefix="pf_bang_build_"))
    try:
        (build / "kernel.mlu").write_text(source)
        (build / "main.cpp").write_text(main)
        for shim in ("bang.h", "cnrt.h", "mlu.h"):  # emitted code may include the real headers
            (build / shim).write_text('#pragma once\n#include "bang_emu.h"\n')
        cmd = ["g++", *CXX_FLAGS, "-I", str(build), "-I", str(HERE), "-o", str(build / "prog"), str(build / "main.cpp")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BangEmulationError("g++ rejected the kernel:\n" + proc.stderr[-4000:])
        cache.mkdir(parents=True, exist_ok=True)
        os.replace(build / "prog", exe)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return exe


def _loc(d: dict | None) -> Loc | None:
    return None if d is None else Loc(d["space"], d["buffer"], d["offset"], d["bytes"], d["seg"], d["stride"], d["count"])


def _read_log(work: Path) -> EventLog:
    events = []
    path = work / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            events.append(Event(d["seq"], d["task"], d["kind"], d["op"], d.get("copy"), _loc(d.get("dst")),
                                tuple(_loc(s) for s in d["srcs"])))
    cov = {}
    cpath = work / "coverage.json"
    if cpath.exists():
        for name, c in json.loads(cpath.read_text()).items():
            cov[name] = Coverage(c["bytes"], c["written"], c["multi_task_bytes"], tuple(tuple(r) for r in c["unwritten"]))
    return EventLog(tuple(events), cov)
