"""Global settings, in one place (Hidet-style).

The environment is read exactly once, when this module is imported; everything else
reads `powerfusion.options.current()`. Change settings for a block of code with

    with powerfusion.options.context(verbose=1, target="cpu"):
        ...

Known environment variables: POWERFUSION_CACHE_DIR, POWERFUSION_VERBOSE,
POWERFUSION_TARGET, POWERFUSION_MEMORY_LIMIT (bytes, or with a K/M/G/T suffix),
POWERFUSION_SEARCH_PLANS, POWERFUSION_SEARCH_BUDGET_S, POWERFUSION_SEARCH_WORKERS.

`fp32_matmul` picks how a CUDA session runs fp32 MatMul / Gemm / Conv (docs/ape.md): "fp32"
(default, cuBLAS SGEMM) or one of Ape's emulations on tensor cores, "auto", "fp32-f",
"fp32-t", "fp32-b". The CPU target accepts and ignores it (with a one-time note).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from powerfusion.errors import PowerFusionError

# the values of `fp32_matmul`: powerfusion.ape.MODES (not imported here: options load first)
FP32_MATMUL_MODES = ("fp32", "auto", "fp32-f", "fp32-t", "fp32-b")


@dataclass(frozen=True, slots=True)
class Options:
    cache_dir: Path          # compiled kernels, cached by content hash
    verbose: int = 0         # 0 quiet, 1 progress on stderr, 2 debug
    target: str = "cpu"      # default target of InferenceSession and the CLI
    cuda_graph: bool = False  # cuda target: replay each run as a captured CUDA graph
    device_id: int = 0        # cuda target: which GPU
    # plan search per subgraph (pipeline/search.py): how many plans are rewritten and predicted
    # (None: the search's default), and a wall-clock safety cap in seconds (None: the default)
    search_plans: int | None = None
    search_budget_s: float | None = None
    search_workers: int = 0  # processes searching a model's subgraphs at once (0: the usable cores)
    intra_op_threads: int = 0  # cpu target: BLAS threads during a run (0: the library's default)
    # most bytes a model may declare (its tensors together, the CPU session keeps them all):
    # a larger one is refused at import, before anything is allocated; default 3/4 of RAM
    memory_limit: int = 0
    precision: object = "fp32"  # "fp32" | "fp16" | "bf16" | powerfusion.precision.AmpConfig (AMP rewrite)
    fallback: str | None = None  # "onnxruntime": unsupported nodes run through it (cpu target)
    fp32_matmul: str = "fp32"  # cuda target: fp32 GEMMs as SGEMM or through Ape (FP32_MATMUL_MODES)

    def __post_init__(self):
        if self.fp32_matmul not in FP32_MATMUL_MODES:
            raise PowerFusionError(f"option fp32_matmul={self.fp32_matmul!r} is not one of "
                                   f"{', '.join(repr(m) for m in FP32_MATMUL_MODES)}")

    def replace(self, **changes) -> "Options":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise PowerFusionError(f"unknown option(s) {sorted(unknown)}; known: "
                                   f"{[f.name for f in dataclasses.fields(self)]}")
        if "memory_limit" in changes:
            changes["memory_limit"] = parse_bytes(changes["memory_limit"])
        if "cache_dir" in changes:
            changes["cache_dir"] = Path(changes["cache_dir"]).expanduser()
        return dataclasses.replace(self, **changes)


def parse_bytes(value) -> int:
    """A byte count from an int or text such as "512M", "16G", "2T"."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    text = str(value).strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    try:
        n = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        n = 0
    if not n > 0:
        raise PowerFusionError(f"memory limit must be a positive byte count such as 8G, got {value!r}")
    return int(n)


def usable_cores() -> int:
    """The cores this process may run on (the default number of search workers and NVRTC threads)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def default_memory_limit() -> int:
    """Three quarters of the machine's physical memory (16 GiB where that cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def _from_environment(env=os.environ) -> Options:
    cache = env.get("POWERFUSION_CACHE_DIR") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "powerfusion"
    verbose = env.get("POWERFUSION_VERBOSE", "0")
    try:
        level = int(verbose)
    except ValueError:
        raise PowerFusionError(f"POWERFUSION_VERBOSE must be an integer, got {verbose!r}") from None
    limit = env.get("POWERFUSION_MEMORY_LIMIT")
    return Options(cache_dir=Path(cache).expanduser(), verbose=level,
                   target=env.get("POWERFUSION_TARGET", "cpu"),
                   memory_limit=parse_bytes(limit) if limit else default_memory_limit(),
                   search_plans=_number(env, "POWERFUSION_SEARCH_PLANS", int),
                   search_budget_s=_number(env, "POWERFUSION_SEARCH_BUDGET_S", float),
                   search_workers=_number(env, "POWERFUSION_SEARCH_WORKERS", int) or 0)


def _number(env, name: str, kind):
    """A non-negative number from the environment, or None when the variable is unset."""
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if not value >= 0:
        raise PowerFusionError(f"{name} must be a non-negative {kind.__name__}, got {text!r}")
    return value


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
