"""The CPU target's C compiler: found at run time, shared objects cached by content.

The compiler is `$CC`, else `cc`, `gcc` or `clang` on PATH, run with `-O3 -march=native
-fopenmp` (and, where gcc takes it, a switch that keeps it from emitting gathers); where the
compiler refuses those flags (no OpenMP runtime, a cross compiler that does not know
-march=native) the portable set `-O2 -fPIC -shared` is used instead, and
kernels then run on one thread. A shared object is kept in the kernel cache
(runtime/cache.py) under the source's hash, the compiler's version line and the flags, and
written once to `<cache>/cpu-so/` for loading (ctypes loads files, not bytes).
A model's modules are compiled in parallel (one compiler process per core).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from powerfusion.errors import PowerFusionError

FAST_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")
# gcc (12) tuned for AMD Zen vectorises strided register loads (a pooling window, a broadcast)
# into AVX2/AVX-512 gathers, which were slower there than the scalar loads they replace: a 3x3
# max pool of 24 x 112 x 112 0.75 -> 0.50 ms, one thread. Compilers that do not know gcc's
# tuning switches (clang, non-x86 gcc) refuse the flag and get FAST_FLAGS alone.
NO_GATHER_FLAGS = (*FAST_FLAGS, "-mtune-ctrl=^use_gather_2parts,^use_gather_4parts,^use_gather")
PORTABLE_FLAGS = ("-O2", "-fPIC", "-shared")
_PROBE = "#include <math.h>\nint pf_probe(float x) { return (int)expf(x); }\n"


class CompilerError(PowerFusionError):
    """No usable C compiler for the cpu target, or it rejected a generated module."""


@dataclass(frozen=True)
class Toolchain:
    compiler: str           # path
    version: str            # first line of `--version`
    flags: tuple[str, ...]

    @property
    def openmp(self) -> bool:
        return "-fopenmp" in self.flags


MISSING_HELP = ("the 'cpu' target compiles its kernels with a C compiler. Install one (Debian/Ubuntu: "
                "`apt-get install gcc`; macOS: `xcode-select --install`), point $CC at it, or use the "
                "numpy reference executor instead: InferenceSession(model, target='cpu-reference').")


@functools.cache
def find_toolchain() -> Toolchain:
    """The compiler and the best flag set it accepts (probed once per process)."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    path = next((p for p in map(shutil.which, names) if p), None)
    if path is None:
        raise CompilerError(f"no C compiler found (looked for {', '.join(names)} on PATH): {MISSING_HELP}")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        version = (out.stdout or out.stderr).splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise CompilerError(f"C compiler {path} does not run ({type(e).__name__}: {e}): {MISSING_HELP}") from None
    errors = []
    for flags in (NO_GATHER_FLAGS, FAST_FLAGS, PORTABLE_FLAGS):
        try:
            _compile(path, flags, _PROBE)
            return Toolchain(path, version, flags)
        except CompilerError as e:
            errors.append(str(e)[:300])
    raise CompilerError(f"C compiler {path} ({version}) cannot build a shared object with "
                        f"{' '.join(FAST_FLAGS)} nor {' '.join(PORTABLE_FLAGS)}: {' | '.join(errors)}; {MISSING_HELP}")


def _compile(compiler: str, flags: tuple[str, ...], source: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="pf-cc-") as tmp:
        src, lib = Path(tmp) / "module.c", Path(tmp) / "module.so"
        src.write_text(source)
        cmd = [compiler, *flags, "-o", str(lib), str(src), "-lm"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise CompilerError(f"{' '.join(cmd)} failed to run: {e}") from None
        if res.returncode != 0:
            raise CompilerError(f"{' '.join(cmd)} exited with {res.returncode}: {res.stderr.strip()[-2000:]}")
        return lib.read_bytes()


def shared_object(source: str, cache_dir: Path | None = None) -> Path:
    """The path of `source` compiled to a shared object (built at most once per cache).
    The bytes come from the kernel cache, whose entries carry their key and hash; the loadable
    copy under `cpu-so/` is used only when its bytes equal them. A cache folder that cannot be
    written (a file, read-only, a full disk) costs one warning: the object goes to a private
    temporary folder instead."""
    from powerfusion import options
    from powerfusion.errors import cache_unusable
    from powerfusion.runtime.cache import KernelCache, source_hash
    tc = find_toolchain()
    root = Path(cache_dir or options.current().cache_dir)
    key = {"kind": "cpu-shared-object", "source": source_hash(source), "compiler": tc.version, "flags": list(tc.flags)}
    digest = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:32]
    blob = KernelCache(root / "kernels").get_or_build(key, lambda: _compile(tc.compiler, tc.flags, source))
    path = root / "cpu-so" / f"{digest}.so"
    try:
        if path.is_file() and path.read_bytes() == blob:
            return path
        return _write_atomic(path, blob)
    except OSError as e:
        cache_unusable("cpu shared-object", path.parent, e)
        return _write_atomic(Path(_private_dir()) / f"{digest}.so", blob)


def _write_atomic(path: Path, blob: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)   # atomic: a concurrent loader sees the whole file or none
    return path


@functools.cache
def _private_dir() -> str:
    return tempfile.mkdtemp(prefix="powerfusion-so-")


def shared_objects(sources: list[str]) -> list[Path]:
    """Compile many modules, one compiler process per core."""
    find_toolchain()   # a missing compiler is reported once, not per module
    workers = max(1, min(len(sources), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(shared_object, sources))
