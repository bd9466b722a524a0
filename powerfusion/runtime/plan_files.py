"""The plan cache's folder as files (`cache_dir / "plans"`): status and clear for
`powerfusion cache`, without importing the pipeline that writes the entries."""
from __future__ import annotations

from pathlib import Path


def plans_dir(cache_dir=None) -> Path:
    if cache_dir is None:
        from powerfusion import options
        cache_dir = options.current().cache_dir
    return Path(cache_dir).expanduser() / "plans"


def status(cache_dir=None) -> dict:
    d = plans_dir(cache_dir)
    found = list(d.glob("*.json")) if d.is_dir() else []
    return {"path": str(d), "entries": len(found), "bytes": sum(_size(p) for p in found)}


def clear(cache_dir=None) -> tuple[int, list[str]]:
    """Delete every plan entry (and leftovers of older formats): (removed, "path: reason" for
    each that could not be removed)."""
    d = plans_dir(cache_dir)
    removed, failed = 0, []
    if d.is_dir():
        for p in d.iterdir():
            if p.is_file() and (p.suffix in (".json", ".pkl") or ".tmp" in p.name):
                try:
                    p.unlink()
                    removed += p.suffix == ".json"
                except FileNotFoundError:
                    pass
                except OSError as e:
                    failed.append(f"{p}: {e.strerror or e}")
    return removed, failed


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0
