"""Run-time faults of GPU kernels: integer division (Div, Mod, fmod) by zero and gathered
indices out of range.

ONNX leaves an integer division by zero undefined; onnxruntime raises, C traps on a CPU and a
GPU returns garbage. Every backend raises a DataError naming the node instead: the CPU runs
such subgraphs on the GIR executor, which checks the divisor (backends/cpu/renderer.py); a
GPU kernel checks it in place (`pf_checked_div`/`_rem`/`_mod` in the dialect's skeleton),
writes 0 for that element and records the first fault's site code in the module's
`pf_fault` word, which the host reads and clears after a run (backends/cuda/executor.py).
A gathered index outside [-n, n) (ONNX: an error) is recorded the same way
(`pf_checked_index`; the value used stays clamped so no read leaves the buffer), whether
the index came from an input or was computed in the fused subgraph; the CPU checks indices
before the step instead (frontend/index_check.py).

The site codes are listed in the kernel source itself, one comment line per site
(`// pf_fault <code>: <fn> <dtype> <basic op>`, or `index <axis size> <index buffer>`), so any
copy of the source (a cached plan, a compile artefact) carries its table; `fault_sites`
reads it back. Only names the renderer made (basic op and buffer names, dtypes) go into the
comment, reduced to [A-Za-z0-9_.:-].
"""
from __future__ import annotations

import re
from dataclasses import dataclass

FAULTING = ("div", "rem", "mod")
INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
FAULT_WORD = "pf_fault"
_LINE = re.compile(r"^// pf_fault (\d+): (\w+) (\w+) ([A-Za-z0-9_.:-]+)$", re.M)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
_ONNX_OP = {"div": "Div", "rem": "Mod (fmod=1)", "mod": "Mod"}


@dataclass(frozen=True)
class FaultSite:
    code: int
    fn: str          # div | rem | mod | index
    dtype: str       # the divided dtype; for an index, the gathered axis' size
    basic_op: str    # the basic op's name in the partitioned graph (GOp.origin); for an index, its GIR buffer

    def message(self, node: str = "") -> str:
        """What went wrong where; `node` describes the ONNX node where the caller knows it."""
        if self.fn == "index":
            n = self.dtype
            where = node or f"the gather reading index buffer '{self.basic_op}'"
            return (f"gather index out of range in {where}: an index is outside [-{n}, {int(n) - 1}] "
                    f"for an axis of size {n}")
        where = node or f"basic op '{self.basic_op}'"
        return f"integer division by zero in {where}: {_ONNX_OP[self.fn]} of {self.dtype} with a zero divisor"


def fault_line(code: int, fn: str, origin: str, dtype: str) -> str:
    return f"// pf_fault {code}: {fn} {dtype} {_UNSAFE.sub('_', origin) or '_'}"


def fault_sites(source: str) -> dict[int, FaultSite]:
    """The fault table of a kernel source: site code -> site (empty when it cannot fault)."""
    return {int(m[1]): FaultSite(int(m[1]), m[2], m[3], m[4]) for m in _LINE.finditer(source)}
