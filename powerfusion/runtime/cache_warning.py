"""One warning, not a crash, when a cache folder cannot be used.

A cache folder that is a file, is read-only, or sits on a full disk costs speed only: every
cache (plans, kernels, compile results) carries on without it and says so once per process.
"""
from __future__ import annotations

import warnings


class CacheWarning(UserWarning):
    """A cache folder could not be read or written; the run goes on without it."""


_WARNED: set[str] = set()


def cache_unusable(what: str, path, error: BaseException) -> None:
    """Warn once per process that the cache under `path` is skipped, with the reason."""
    if "all" in _WARNED:
        return
    _WARNED.add("all")
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    warnings.warn(f"the {what} cache at {path} cannot be used ({reason}); carrying on without caching",
                  CacheWarning, stacklevel=3)


def reset() -> None:
    """Forget earlier warnings (tests)."""
    _WARNED.clear()
