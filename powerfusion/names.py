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
