"""Persistent kernel cache on disk, keyed by content.

A key is a small dict (source hash, GPU architecture, compiler version, options, ...);
its canonical JSON is hashed into a file name. Each entry holds the compiled binary
(cubin / PTX / code object) with its length and a SHA-256 checksum, so a truncated or
corrupted entry is detected on read, deleted and rebuilt.

Several processes may share one cache: entries are written to a temporary file in the
same folder and renamed into place (`os.replace` is atomic), so a reader sees either
no entry or a whole one; an advisory `fcntl` lock per key keeps two processes from
compiling the same kernel at once (where `fcntl` is missing, both build and the last
rename wins, which is still correct).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

try:  # POSIX only; without it the cache stays correct, builds may just be duplicated
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

FORMAT_VERSION = 1
_MAGIC = b"PFKC\x00\x00\x00\x01"
# magic | meta length (u32) | payload length (u64) | sha256(meta + payload)
_HEADER = struct.Struct("<8sIQ32s")
_SUFFIX = ".pfk"


def default_cache_dir() -> Path:
    """The kernel cache folder: `powerfusion.options.current().cache_dir` / kernels."""
    from powerfusion import options
    return Path(options.current().cache_dir) / "kernels"


def source_hash(source: str | bytes) -> str:
    """SHA-256 of kernel source text, the usual first part of a key."""
    data = source.encode() if isinstance(source, str) else source
    return hashlib.sha256(data).hexdigest()


def canonical_key(key_parts: dict) -> str:
    """Stable text of a key: sorted JSON (tuples become lists); rejects non-JSON values."""
    try:
        return json.dumps({"format": FORMAT_VERSION, **key_parts}, sort_keys=True,
                          separators=(",", ":"))
    except TypeError as e:
        raise TypeError(f"cache key parts must be JSON values (str, int, list, dict): {e}") from None


@dataclass(slots=True)
class CacheStats:
    """Counters of one KernelCache object in this process (tests and verbose output read them)."""
    hits: int = 0
    misses: int = 0
    corrupt: int = 0


class KernelCache:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.stats = CacheStats()

    # ---- public API -----------------------------------------------------------------
    def get_or_build(self, key_parts: dict, build: Callable[[], bytes]) -> bytes:
        """The cached binary for `key_parts`, calling `build()` (once, across processes) if absent."""
        meta = canonical_key(key_parts).encode()
        path = self._entry_path(meta)
        payload = self._read(path, meta)
        if payload is not None:
            self.stats.hits += 1
            return payload
        with self._locked(path):
            payload = self._read(path, meta)  # another process may have built it meanwhile
            if payload is not None:
                self.stats.hits += 1
                return payload
            payload = build()
            if not isinstance(payload, (bytes, bytearray)):
                raise TypeError(f"cache build function returned {type(payload).__name__}, expected bytes")
            payload = bytes(payload)
            self.stats.misses += 1
            try:
                self._write(path, meta, payload)
            except OSError as e:   # a file in the way, read-only, full disk: run uncached
                from powerfusion.errors import cache_unusable
                cache_unusable("kernel", self.root, e)
            return payload

    def lookup(self, key_parts: dict) -> bytes | None:
        """The cached binary, or None (a corrupted entry is removed and reads as None)."""
        meta = canonical_key(key_parts).encode()
        return self._read(self._entry_path(meta), meta)

    def status(self) -> dict:
        entries = list(self._entries())
        return {"path": str(self.root), "entries": len(entries),
                "bytes": sum(_size(p) for p in entries)}

    def clear(self) -> tuple[int, list[str]]:
        """Delete every entry (and lock file): (entries removed, "path: reason" for each that
        could not be, e.g. in a read-only cache)."""
        removed, failed = 0, []
        if not self.root.is_dir():
            return 0, []
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue  # only our two-hex-digit shard folders
            for f in sub.iterdir():
                if f.suffix in (_SUFFIX, ".lock") or f.name.startswith(".tmp-"):
                    try:
                        f.unlink()
                        removed += f.suffix == _SUFFIX
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        if f.suffix == _SUFFIX:
                            failed.append(f"{f}: {e.strerror or e}")
            with contextlib.suppress(OSError):
                sub.rmdir()
        return removed, failed

    # ---- storage --------------------------------------------------------------------
    def _entry_path(self, meta: bytes) -> Path:
        digest = hashlib.sha256(meta).hexdigest()
        return self.root / digest[:2] / (digest + _SUFFIX)

    def _entries(self):
        if self.root.is_dir():
            yield from self.root.glob("??/*" + _SUFFIX)

    def _read(self, path: Path, meta: bytes) -> bytes | None:
        try:
            blob = path.read_bytes()
        except OSError:   # absent, or no usable cache folder: a miss
            return None
        payload = _decode(blob, meta)
        if payload is None:
            self.stats.corrupt += 1
            with contextlib.suppress(OSError):
                path.unlink()
        return payload

    def _write(self, path: Path, meta: bytes, payload: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_encode(meta, payload))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self, path: Path):
        if fcntl is None:
            yield
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path.with_suffix(".lock"), "a+b")
        except OSError:   # no usable cache folder: build without the lock (the write will warn)
            yield
            return
        with lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _encode(meta: bytes, payload: bytes) -> bytes:
    digest = hashlib.sha256(meta + payload).digest()
    return _HEADER.pack(_MAGIC, len(meta), len(payload), digest) + meta + payload


def _decode(blob: bytes, meta: bytes) -> bytes | None:
    """The payload of a well-formed entry for `meta`, else None (truncated, corrupted, foreign)."""
    if len(blob) < _HEADER.size:
        return None
    magic, meta_len, payload_len, digest = _HEADER.unpack_from(blob)
    body = blob[_HEADER.size:]
    if magic != _MAGIC or len(body) != meta_len + payload_len:
        return None
    if hashlib.sha256(body).digest() != digest or body[:meta_len] != meta:
        return None
    return body[meta_len:]


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0
