"""Whole-compile results cached on disk: a repeated `powerfusion compile` skips import,
search and codegen.

Key: SHA-256 over the model file's bytes, the compile options (target, shapes, the search
budget), the PowerFusion source (every file of the package) and the versions of Python,
numpy and onnx. An entry is a folder under `cache_dir / "compiled"` holding what
`write_plan` wrote (plan.json, kernel sources, constant .npy files) plus `entry.json`,
which lists each file with its size and SHA-256, the external-data files the model read
(with theirs; a hit re-hashes them), the one-line summary the CLI prints, the key it was
stored under and a SHA-256 of all of that: an entry renamed or copied under another key,
or edited, is deleted instead of being served.

On a hit the output folder is checked against `.powerfusion-compile.json`, a stamp the
compile leaves there (key, and each file's size and modification time): when it matches,
nothing is written; otherwise the entry's files are checked against their SHA-256 (a
corrupted entry is deleted and the model compiled again) and copied into the output folder.
Entries and output folders never share files (no hard links): editing a kernel in one output
folder changes nothing else.

A cache folder that cannot be used (a file, read-only, a full disk) costs the speed-up only:
the compile goes on and one `CacheWarning` says why.

Entries are built in a temporary folder and renamed into place, so a reader sees a whole
entry or none, and two processes storing the same key leave one. The oldest entries are
deleted when the folder grows beyond `MAX_BYTES`. `--tune` compiles neither read nor
write entries (their choices depend on the device's timings).

This module imports nothing heavy: a hit costs the model's hash (about 0.35 s for BERT-base's
435 MB on a 2-core machine), plus checking the entry's files when the output folder changed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

FORMAT = 2    # 2: entry.json carries its key and a SHA-256 of its content; files are copies
ENTRY = "entry.json"
STAMP = ".powerfusion-compile.json"
MAX_BYTES = 8 << 30          # keep at most this many bytes of entries (oldest deleted first)
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Hit:
    summary: dict
    copied: int          # files restored into the output folder (0: it was up to date)
    seconds: dict        # "check data" (external data re-hashed), "output" -> seconds
    digests: dict = field(default_factory=dict)   # output file -> SHA-256, as the entry verified them


def root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is None:
        from powerfusion import options
        cache_dir = options.current().cache_dir
    return Path(cache_dir).expanduser() / "compiled"


_DIGESTS: dict[tuple[str, int, int], str] = {}   # (path, size, mtime_ns) -> SHA-256, this process


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes; a file hashed before in this process with the same size and
    modification time is not read again (a compile hashes the model for its key and again for
    the output's manifest: 0.3 s each for BERT-base)."""
    st = os.stat(path)
    memo = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if memo not in _DIGESTS:
        _DIGESTS[memo] = _read_digest(path)
    return _DIGESTS[memo]


def _read_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:   # hashlib.file_digest is 3.11+; this reads the same way
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@lru_cache(maxsize=1)
def code_version() -> str:
    """SHA-256 over every file of the installed package (sources, templates, calibrations)."""
    pkg = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            h.update(str(p.relative_to(pkg)).encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()


def compile_key(model_path: str, target: str, shapes: dict | None, extension: str) -> tuple[str, float]:
    """(key, seconds spent hashing the model)."""
    import numpy
    from importlib import metadata
    from powerfusion import options
    t0 = time.perf_counter()
    model_digest = file_digest(model_path)
    seconds = time.perf_counter() - t0
    parts = {"format": FORMAT, "model": model_digest, "target": target, "extension": extension,
             "shapes": sorted((k, list(v)) for k, v in (shapes or {}).items()),
             "search": [options.current().search_plans, options.current().search_budget_s],
             "code": code_version(), "python": list(sys.version_info[:2]), "numpy": numpy.__version__,
             "onnx": metadata.version("onnx")}
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:40], seconds


# ---- lookup -------------------------------------------------------------------------

def lookup(key: str, out_dir: str | os.PathLike, cache_dir=None) -> Hit | None:
    """Bring `out_dir` up to date from the entry for `key`; None when there is no usable entry."""
    entry = root(cache_dir) / key
    info = _read_json(entry / ENTRY)
    if info is None:
        return None
    if not _well_formed(info) or info.get("key") != key or info.get("sha256") != _entry_digest(info):
        _remove(entry)
        return None
    t0 = time.perf_counter()
    for dep in info["external_data"]:   # the model's external tensor data must be unchanged
        if not os.path.isfile(dep["path"]) or file_digest(dep["path"]) != dep["sha256"]:
            _remove(entry)   # stale: the compile that follows stores the new result under this key
            return None
    t1 = time.perf_counter()
    out = Path(out_dir)
    files = info["files"]
    if _up_to_date(out, key, files):
        copied = 0
    else:
        try:
            copied = _copy_out(entry, out, files)
        except _Corrupt:
            _remove(entry)
            return None
        write_stamp(out, key, files)
    with contextlib.suppress(OSError):
        os.utime(entry / ENTRY)          # most recently used: evicted last
    return Hit(info["summary"], copied, {"check data": t1 - t0, "output": time.perf_counter() - t1},
               {name: meta["sha256"] for name, meta in files.items()})


def _entry_digest(info: dict) -> str:
    """SHA-256 over the canonical JSON of an entry without its own digest."""
    body = {k: v for k, v in info.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _well_formed(info) -> bool:
    try:
        return (info["format"] == FORMAT and isinstance(info["summary"], dict)
                and all(_safe_name(n) and isinstance(m["size"], int) and isinstance(m["sha256"], str)
                        for n, m in info["files"].items())
                and all(isinstance(d["path"], str) and isinstance(d["sha256"], str) for d in info["external_data"]))
    except (KeyError, TypeError, AttributeError):
        return False


def _safe_name(name) -> bool:
    """A plain file name inside the folder (entries never name paths elsewhere)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name


def _up_to_date(out: Path, key: str, files: dict) -> bool:
    stamp = _read_json(out / STAMP)
    if stamp is None or stamp.get("key") != key or set(stamp.get("files", {})) != set(files):
        return False
    for name, (size, mtime_ns) in stamp["files"].items():
        try:
            st = (out / name).stat()
        except OSError:
            return False
        if st.st_size != size or st.st_mtime_ns != mtime_ns or st.st_size != files[name]["size"]:
            return False
    return True


class _Corrupt(Exception):
    pass


def _copy_out(entry: Path, out: Path, files: dict) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name, meta in files.items():
        src, dst = entry / name, out / name
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        try:
            if file_digest(src) != meta["sha256"]:
                raise _Corrupt(name)
            _copy(src, tmp)
        except FileNotFoundError:
            raise _Corrupt(name) from None
        os.replace(tmp, dst)
    return len(files)


def _copy(src: Path, dst: Path) -> None:
    """A copy, never a hard link: an output folder and the cache entry must not share a file."""
    dst.unlink(missing_ok=True)
    shutil.copyfile(src, dst)


# ---- store --------------------------------------------------------------------------

def _copy_hashing(src: Path, dst: Path) -> str:
    """Copy `src` to `dst` (a new file) and return the SHA-256 of the bytes copied: one read of
    the output folder's constants instead of a copy and a second read for the digest."""
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        for block in iter(lambda: fin.read(1 << 20), b""):
            h.update(block)
            fout.write(block)
    digest = h.hexdigest()
    for path in (src, dst):   # both hold these bytes: file_digest need not read them again
        st = os.stat(path)
        _DIGESTS[(os.path.abspath(path), st.st_size, st.st_mtime_ns)] = digest
    return digest


def store(key: str, out_dir: str | os.PathLike, files: list[str], summary: dict, external_data: list[str],
          cache_dir=None) -> dict:
    """Copy the just-written output files into a new entry and stamp the output folder; where the
    cache folder cannot be written, warn once and leave the output folder as it is. Returns
    {file: SHA-256} of the files copied ({} where nothing was stored), for the manifest."""
    try:
        metas = _store(key, Path(out_dir), files, summary, external_data, cache_dir)
    except OSError as e:
        from powerfusion.errors import cache_unusable
        cache_unusable("compile", root(cache_dir), e)
        return {}
    write_stamp(Path(out_dir), key, metas)
    with contextlib.suppress(OSError):
        evict(cache_dir)
    return {name: meta["sha256"] for name, meta in metas.items()}


def _store(key: str, out: Path, files: list[str], summary: dict, external_data: list[str], cache_dir) -> dict:
    base = root(cache_dir)
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
    try:
        metas = {}
        for name in files:
            metas[name] = {"size": (out / name).stat().st_size, "sha256": _copy_hashing(out / name, tmp / name)}
        deps = [{"path": os.path.abspath(p), "sha256": file_digest(p)} for p in external_data]
        info = {"format": FORMAT, "key": key, "files": metas, "summary": summary, "external_data": deps}
        info["sha256"] = _entry_digest(info)
        (tmp / ENTRY).write_text(json.dumps(info, indent=1))
        try:
            os.rename(tmp, base / key)
        except OSError:      # another process stored this key first: keep theirs
            _remove(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return metas


def write_stamp(out: Path, key: str, files: dict) -> None:
    stamp = {"key": key, "files": {}}
    for name in files:
        st = (out / name).stat()
        stamp["files"][name] = [st.st_size, st.st_mtime_ns]
    tmp = out / f"{STAMP}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(stamp, indent=1))
    os.replace(tmp, out / STAMP)


def remove_stamp(out_dir: str | os.PathLike) -> None:
    (Path(out_dir) / STAMP).unlink(missing_ok=True)


def output_files(plan_json: Path) -> list[str]:
    """plan.json and every file it names (kernel sources, constant files), relative to its folder."""
    doc = json.loads(plan_json.read_text())
    names = [plan_json.name]
    for t in doc["tensors"].values():
        if t.get("file"):
            names.append(t["file"])
    for s in doc["steps"]:
        if s["kind"] == "kernels":
            names += [k["file"] for k in s["kernels"]]
            names += [b["constant_file"] for b in s["scratch"] if b.get("constant_file")]
    return list(dict.fromkeys(names))


# ---- housekeeping -------------------------------------------------------------------

def entries(cache_dir=None) -> list[Path]:
    base = root(cache_dir)
    if not base.is_dir():
        return []
    return [p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".tmp-") and (p / ENTRY).is_file()]


def status(cache_dir=None) -> dict:
    found = entries(cache_dir)
    return {"path": str(root(cache_dir)), "entries": len(found), "bytes": sum(_tree_bytes(p) for p in found)}


def clear(cache_dir=None) -> tuple[int, list[str]]:
    """Delete every entry: (entries removed, "path: reason" for those that could not be)."""
    base = root(cache_dir)
    removed, failed = 0, []
    if base.is_dir():
        for p in base.iterdir():
            if not p.is_dir():
                continue
            was_entry = (p / ENTRY).is_file()
            errors = _rmtree(p)
            if p.exists():
                failed.append(errors[0] if errors else f"{p}: not removed")
            else:
                removed += was_entry
    return removed, failed


def evict(cache_dir=None, max_bytes: int = MAX_BYTES) -> int:
    """Delete the least recently used entries until the rest fit in `max_bytes`."""
    found = sorted(entries(cache_dir), key=lambda p: _mtime(p / ENTRY), reverse=True)
    total, removed = 0, 0
    for p in found:
        total += _tree_bytes(p)
        if total > max_bytes and p is not found[0]:
            _remove(p)
            removed += 1
    return removed


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _tree_bytes(p: Path) -> int:
    total = 0
    for f in p.iterdir():
        with contextlib.suppress(OSError):
            total += f.stat().st_size
    return total


def _read_json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _rmtree(p: Path) -> list[str]:
    """Remove a folder tree as far as possible; "path: reason" for what could not be removed."""
    errors: list[str] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(p, onexc=lambda fn, path, exc: errors.append(f"{path}: {exc}"))
    else:
        shutil.rmtree(p, onerror=lambda fn, path, exc: errors.append(f"{path}: {exc[1]}"))
    return errors


def _remove(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
