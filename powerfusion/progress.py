"""Progress bars for steps that take more than a second, through tqdm.

A bar is drawn only on a terminal and only at verbose >= 1 (so never under `-q`, and never
as carriage-return redraws into a log file or a pipe); `enabled=True` forces one on. It
counts what the step iterates over (subgraphs, candidate plans), with that unit named."""
from __future__ import annotations

import sys


def progress_bar(iterable=None, *, total: int | None = None, desc: str, unit: str, enabled: bool | None = None):
    from tqdm import tqdm
    from powerfusion import options
    if enabled is None:
        enabled = options.current().verbose >= 1 and sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=f"[powerfusion] {desc}", unit=f" {unit}", file=sys.stderr,
                leave=False, disable=not enabled, mininterval=0.25, dynamic_ncols=True)
