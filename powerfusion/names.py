"""Identifiers for emitted source: model names never reach a compiler unsanitised."""
from __future__ import annotations

import re

_IDENT_RE = re.compile(r"[^A-Za-z0-9_]")


def sanitize(name: str) -> str:
    """A C identifier from a model's tensor/node name."""
    s = _IDENT_RE.sub("_", name)
    if not s or not (s[0].isalpha() or s[0] == "_"):
        s = "t_" + s
    return s


def buffer_names(tensors, reserved: str = "", taken=()) -> dict[str, str]:
    """Tensor name -> a distinct C identifier, in one pass: sanitised, moved out of the
    `reserved` namespace (where a subgraph's own register/shared buffers live) by a `t_`
    prefix, and only then made unique, so no two tensors share a name whatever they are
    called (`sg0_a` and `t_sg0_a` stay two buffers)."""
    taken = set(taken)
    out = {}
    for t in tensors:
        base = sanitize(t)
        while reserved and base.startswith(reserved):
            base = "t" + base if reserved.startswith("t_") else "t_" + base
        name, k = base, 1
        while name in taken or (reserved and name.startswith(reserved)):
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        out[t] = name
    return out


class UniqueNames:
    """One C identifier per (prefix, buffer): sanitised, and distinct even where two model
    names sanitise alike."""

    def __init__(self):
        self._idents: dict[tuple[str, str], str] = {}
        self._taken: set[str] = set()

    def ident(self, prefix: str, buf: str) -> str:
        key = (prefix, buf)
        if key not in self._idents:
            base = name = f"{prefix}_{sanitize(buf)}"
            k = 1
            while name in self._taken:
                name, k = f"{base}_{k}", k + 1
            self._taken.add(name)
            self._idents[key] = name
        return self._idents[key]


class FileNames:
    """One file name per key in one output folder: sanitised, at most `MAX_FILE_CHARS` long (a
    long name keeps its start and a hash of the whole), and distinct even on a file system that
    ignores case -- so `W.1`, `W_1` and `W-1` are three files."""

    MAX_FILE_CHARS = 120

    def __init__(self, reserved=("plan.json",)):
        self._files: dict[object, str] = {}
        self._taken: set[str] = {r.lower() for r in reserved}

    def file(self, key, stem: str, extension: str) -> str:
        if key not in self._files:
            base = _shorten(sanitize(stem), self.MAX_FILE_CHARS - len(extension) - 8)
            name, k = base + extension, 1
            while name.lower() in self._taken:
                name, k = f"{base}_{k}{extension}", k + 1
            self._taken.add(name.lower())
            self._files[key] = name
        return self._files[key]


def _shorten(name: str, limit: int) -> str:
    if len(name) <= limit:
        return name
    import hashlib
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{name[:limit - 13]}_{digest}"


def fresh_name(base: str, taken: set[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first not in `taken`, which it joins."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name
