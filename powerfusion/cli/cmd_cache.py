"""`powerfusion cache status|clear`: inspect or empty every cache under the cache folder:
compiled kernels (runtime.cache), plan decisions (pipeline.plancache, folder handled by runtime.plan_files) and whole compile
results (powerfusion.compile_cache). `clear` counts only what it removed and names what it
could not remove (exit status 1 then).

`powerfusion.cli` calls `register(subparsers)`; each sub-command sets `func(args) -> int`.
"""
from __future__ import annotations

import argparse

from powerfusion.runtime.cache import KernelCache


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("cache", help="show or clear the compiled-kernel cache and cached compiles",
                                   description="Show or clear the compiled-kernel cache and the cached "
                                               "`powerfusion compile` results.")
    parser.add_argument("--dir", default=None,
                        help="kernel cache folder (default: the cache_dir option, under kernels/)")
    actions = parser.add_subparsers(dest="cache_command", metavar="{status,clear}")
    actions.required = True
    status = actions.add_parser("status", help="path, number of entries and bytes")
    status.set_defaults(func=_status)
    clear = actions.add_parser("clear", help="delete every cached kernel and compile result")
    clear.set_defaults(func=_clear)
    return parser


def _status(args) -> int:
    from powerfusion import compile_cache
    from powerfusion.runtime import plan_files
    info = KernelCache(args.dir).status()
    print(f"path:    {info['path']}")
    print(f"entries: {info['entries']}")
    print(f"bytes:   {info['bytes']} ({_human(info['bytes'])})")
    base = _results_dir(args)
    if base is False:
        return 0
    plans = plan_files.status(base)
    print(f"plan decisions: {plans['entries']} in {plans['path']}, {_human(plans['bytes'])}")
    results = compile_cache.status(base)
    print(f"compile results: {results['entries']} in {results['path']}, {_human(results['bytes'])}")
    return 0


def _clear(args) -> int:
    import sys
    from powerfusion import compile_cache
    from powerfusion.runtime import plan_files
    cache = KernelCache(args.dir)
    removed, failed = cache.clear()
    print(f"removed {removed} cached kernel(s) from {cache.root}")
    base = _results_dir(args)
    if base is not False:
        n, bad = plan_files.clear(base)
        print(f"removed {n} cached plan decision(s) from {plan_files.plans_dir(base)}")
        failed += bad
        n, bad = compile_cache.clear(base)
        print(f"removed {n} cached compile result(s) from {compile_cache.root(base)}")
        failed += bad
    if failed:
        print(f"could not remove {len(failed)} entr{'y' if len(failed) == 1 else 'ies'}:", file=sys.stderr)
        for line in failed[:10]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def _results_dir(args):
    """The cache folder whose compiled/ holds compile results: None for the cache_dir option,
    --dir's parent when --dir names a kernels/ folder, False (leave them alone) for another --dir."""
    from pathlib import Path
    if args.dir is None:
        return None
    d = Path(args.dir).expanduser()
    return d.parent if d.name == "kernels" else False


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
