"""`powerfusion cache status|clear`: inspect or empty the compiled-kernel cache.

`powerfusion.cli` calls `register(subparsers)`; each sub-command sets `func(args) -> int`.
"""
from __future__ import annotations

import argparse

from powerfusion.runtime.cache import KernelCache


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("cache", help="show or clear the compiled-kernel cache",
                                   description="Show or clear the compiled-kernel cache.")
    parser.add_argument("--dir", default=None,
                        help="kernel cache folder (default: the cache_dir option, under kernels/)")
    actions = parser.add_subparsers(dest="cache_command", metavar="{status,clear}")
    actions.required = True
    status = actions.add_parser("status", help="path, number of entries and bytes")
    status.set_defaults(func=_status)
    clear = actions.add_parser("clear", help="delete every cached kernel")
    clear.set_defaults(func=_clear)
    return parser


def _status(args) -> int:
    info = KernelCache(args.dir).status()
    print(f"path:    {info['path']}")
    print(f"entries: {info['entries']}")
    print(f"bytes:   {info['bytes']} ({_human(info['bytes'])})")
    return 0


def _clear(args) -> int:
    cache = KernelCache(args.dir)
    removed = cache.clear()
    print(f"removed {removed} cached kernel(s) from {cache.root}")
    return 0


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
