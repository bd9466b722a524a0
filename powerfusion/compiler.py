"""`compile_model`: `powerfusion compile`'s entry to the compile pipeline (pipeline/driver.py):
the cost model's search per memory-bound subgraph, kernels rendered for the target's backend.

`Plan`, `KernelStep` and `LibraryStep` (powerfusion/plan.py) are named here too, for callers of
`compile_model`.
"""
from __future__ import annotations

from powerfusion.pipeline.driver import CompileOptions, compile
from powerfusion.plan import KernelStep, LibraryStep, Plan  # noqa: F401 -- named here for callers


def compile_model(model, target: str = "cuda", shapes=None, *, tune: bool = False, codegen: bool = True,
                  progress=None, precision="fp32") -> Plan:
    return compile(model, target, CompileOptions(shapes=shapes, tune=tune, render=codegen, progress=progress,
                                                 precision=precision))
