"""Per-subgraph time budget: a subgraph whose lowering or rewriting does not finish in time
is shown as failed (with what the partition says about it) instead of holding up the page.

The work runs in one forked child process that handles the subgraphs in order and sends
each result back, so the rewrite memo still serves repeated layers; when a subgraph runs
out of time the child is killed and a new one carries on with the next subgraph.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Sequence


def run_all(items: Sequence, work: Callable, on_timeout: Callable, on_crash: Callable,
            seconds: float | None) -> list:
    """[work(x) for x in items], each within `seconds` (None or 0: no limit, in-process)."""
    if not seconds or not hasattr(os, "fork"):
        return [work(x) for x in items]
    ctx = multiprocessing.get_context("fork")
    out: list = []
    while len(out) < len(items):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_serve, args=(work, items[len(out):], send), daemon=True)
        child.start()
        send.close()
        try:
            while len(out) < len(items):
                if not receive.poll(seconds):
                    out.append(on_timeout(items[len(out)], seconds))
                    break
                try:
                    out.append(receive.recv())
                except EOFError:   # the child died without a result (a crash, not a Python error)
                    out.append(on_crash(items[len(out)], child.exitcode))
                    break
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            receive.close()
    return out


def _serve(work, items, send) -> None:
    for x in items:
        send.send(work(x))
    send.close()
