"""Global settings, in one place (Hidet-style).

The environment is read exactly once, when this module is imported; everything else
reads `powerfusion.options.current()`. Change settings for a block of code with

    with powerfusion.options.context(verbose=1, target="cpu"):
        ...

Known environment variables: POWERFUSION_CACHE_DIR, POWERFUSION_VERBOSE,
POWERFUSION_TARGET.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from powerfusion.errors import PowerFusionError


@dataclass(frozen=True, slots=True)
class Options:
    cache_dir: Path          # compiled kernels, cached by content hash
    verbose: int = 0         # 0 quiet, 1 progress on stderr, 2 debug
    target: str = "cpu"      # default target of InferenceSession and the CLI
    cuda_graph: bool = False  # cuda target: replay each run as a captured CUDA graph
    device_id: int = 0        # cuda target: which GPU
    search_budget_s: float | None = None  # seconds of plan search per subgraph (None: the search's default)
    intra_op_threads: int = 0  # cpu target: BLAS threads during a run (0: the library's default)
    precision: object = "fp32"  # "fp32" | "fp16" | "bf16" | powerfusion.precision.AmpConfig (AMP rewrite)

    def replace(self, **changes) -> "Options":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise PowerFusionError(f"unknown option(s) {sorted(unknown)}; known: "
                                   f"{[f.name for f in dataclasses.fields(self)]}")
        if "cache_dir" in changes:
            changes["cache_dir"] = Path(changes["cache_dir"]).expanduser()
        return dataclasses.replace(self, **changes)


def _from_environment(env=os.environ) -> Options:
    cache = env.get("POWERFUSION_CACHE_DIR") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "powerfusion"
    verbose = env.get("POWERFUSION_VERBOSE", "0")
    try:
        level = int(verbose)
    except ValueError:
        raise PowerFusionError(f"POWERFUSION_VERBOSE must be an integer, got {verbose!r}") from None
    return Options(cache_dir=Path(cache).expanduser(), verbose=level,
                   target=env.get("POWERFUSION_TARGET", "cpu"))


_STACK: list[Options] = [_from_environment()]


def current() -> Options:
    return _STACK[-1]


@contextlib.contextmanager
def context(**changes):
    """Use changed settings inside the `with` block; the previous ones return afterwards."""
    _STACK.append(current().replace(**changes))
    try:
        yield _STACK[-1]
    finally:
        _STACK.pop()


def set_defaults(**changes) -> Options:
    """Change the settings for the rest of the process (the CLI uses this for its flags)."""
    _STACK[0] = _STACK[0].replace(**changes)
    return _STACK[0]
