"""Plan search for all of a model's subgraphs before the pipeline assembles them:
`search_all(subgraphs, graph, target, ...)`.

    keys      = the structural key of every subgraph (plancache.structural_key)
    distinct  = the first subgraph of each key whose decision is not cached yet
    search    each distinct one once (search.choose_plan, or for the CPU session
              choose.choose_default), over `workers` forked processes
              (concurrent.futures), largest subgraphs first, or in this process
              with one worker
    adopt     each worker's decision into the plan cache (memory and disk), where the
              pipeline's own choose_plan per subgraph then finds it

Identical subgraphs (same ops, arguments, shapes and dtypes, whatever their names) are
searched once. The search's budget counts evaluated plans (search.plan_budget), so a
decision does not depend on which process made it or on how many there were: the same
model gets the same plans with one worker or sixteen (tests/perfmodel/test_search_parallel.py).
Workers are forked, so they share the imported model (weights included) with this process
instead of receiving a pickled copy; each returns its decision as a plan-cache entry (JSON
text, plancache.entry_text). A subgraph whose search fails in a worker is left to the
pipeline, which searches it again here and reports the failure with its step.

The progress bar (powerfusion.progress: a terminal at verbose >= 1) counts distinct searches
and names the subgraphs being searched.

The searches run with the cyclic garbage collector's youngest generation collected every
SEARCH_GC_THRESHOLD allocations instead of Python's 700 (`search_collector`; the forked
workers inherit it): a search keeps a million objects alive in its memo tables, and at the
default every object that outlived two young collections soon forced a full collection over
all of them -- on Swin-T's one-process search 26 full collections, 4.5 of 57 CPU seconds.
Collection frees nothing a search still holds, so the plans are the same either way. The
forked workers also keep freed memory for their next arrays rather than returning it to the
system at once (`keep_freed_memory`, glibc only).
"""
from __future__ import annotations

import contextlib
import gc
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, ProcessPoolExecutor, wait

from powerfusion.basic import BasicGraph, Subgraph
from powerfusion.options import usable_cores
from powerfusion.pipeline import plancache
from powerfusion.targets.specs import TargetSpec


def pending_searches(subgraphs, graph: BasicGraph, t: TargetSpec) -> list[tuple[str, Subgraph]]:
    """(key, first subgraph) for each structural key whose decision is in no cache yet."""
    out: dict[str, Subgraph] = {}
    for sub in subgraphs:
        key = plancache.structural_key(sub, graph, t)
        if key not in out and not plancache.has(key):
            out[key] = sub
    return list(out.items())


def search_all(subgraphs, graph: BasicGraph, t: TargetSpec, *, workers: int = 0, progress: bool | None = None,
               how: str = "search", **search_kw) -> int:
    """Decide every distinct uncached subgraph once, so that the pipeline's choice per subgraph
    finds each decision cached. `how`: "search" (search.choose_plan, with `search_kw`) or
    "default" (choose.choose_default: the default plan, rewritten). Returns how many ran."""
    todo = pending_searches(subgraphs, graph, t)
    if not todo:
        return 0
    workers = min(workers or usable_cores(), len(todo))
    from powerfusion.progress import progress_bar
    bar = progress_bar(total=len(todo), desc="plan search" if how == "search" else "lowering to GIR",
                       unit="subgraph", enabled=progress)
    decide = _DECIDERS[how]
    try:
        with search_collector():   # forked workers inherit the setting
            if workers <= 1:
                _search_here(todo, graph, t, bar, decide, search_kw)
            else:
                _search_forked(largest_first(todo), graph, t, workers, bar, decide, search_kw)
    finally:
        bar.close()
    return len(todo)


SEARCH_GC_THRESHOLD = 20_000   # allocations between young-generation collections while searching (Python: 700)


@contextlib.contextmanager
def search_collector(threshold: int = SEARCH_GC_THRESHOLD):
    """The garbage collector's young generation collected every `threshold` allocations (never
    more often than it already was; a threshold of 0, collection off, is kept), restored afterwards. Fewer young collections promote fewer
    short-lived objects to the old generation, whose growth is what triggers a full collection
    over everything the search's memo tables hold."""
    old = gc.get_threshold()
    if old[0]:   # 0: automatic collection is off, and stays off
        gc.set_threshold(max(old[0], threshold), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def largest_first(todo: list[tuple[str, Subgraph]]) -> list[tuple[str, Subgraph]]:
    """The searches with the most ops first (stable): a search's time grows with its subgraph
    (Swin-T's 30-op attention blocks take 20-60x its 2-op ones), and one started last would
    leave the other workers idle while it runs. The order decides nothing: each key is searched
    once, with the same budget, in whichever process."""
    return sorted(todo, key=lambda item: -len(item[1].nodes))


def _searched(sub, graph, t, cache: bool, search_kw):
    from powerfusion.pipeline.search import choose_plan
    return choose_plan(sub, graph, t, progress=False, cache=cache, **search_kw)


def _default(sub, graph, t, cache: bool, search_kw):
    import contextlib
    from powerfusion.pipeline.choose import choose_default
    return choose_default(sub, graph, t, lambda name: contextlib.nullcontext())   # stores the decision


_DECIDERS = {"search": _searched, "default": _default}


def _search_here(todo, graph, t, bar, decide, search_kw) -> None:
    for key, sub in todo:
        bar.set_postfix_str(f"searching {sub.name}")
        try:
            decide(sub, graph, t, True, search_kw)   # stores the decision
        except Exception:   # the pipeline searches it again and reports the failure with its step
            pass
        bar.update(1)


_SHARED: tuple = ()   # (todo, graph, target, decide, search keywords), inherited by the forked workers


def _search_forked(todo, graph, t, workers: int, bar, decide, search_kw) -> None:
    import multiprocessing as mp
    global _SHARED
    if mp.current_process().daemon:   # a multiprocessing.Pool worker may not start children: one process
        _search_here(todo, graph, t, bar, decide, search_kw)
        return
    try:
        ctx = mp.get_context("fork")
    except ValueError:   # no fork on this platform: one process
        _search_here(todo, graph, t, bar, decide, search_kw)
        return
    _SHARED = (todo, graph, t, decide, search_kw)
    # The parent's objects (a user's torch, the model) out of the collector's reach while the
    # workers run: a worker's full collection would otherwise walk and write every one of them,
    # copying the parent's whole heap page by page into each worker (Python's advice for forks).
    gc.freeze()
    try:
        _run_pool(todo, workers, ctx, bar)
    except BrokenExecutor:   # a worker died (killed, out of memory): the pipeline searches what is missing here
        pass
    finally:
        gc.unfreeze()
        _SHARED = ()


def _run_pool(todo, workers: int, ctx, bar) -> None:
    """The distinct searches over `workers` processes, no more in flight than workers (so the
    bar names what is being searched); each finished decision adopted into the plan cache."""
    running: dict = {}   # future -> index in todo
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=keep_freed_memory) as pool:
        queue = list(range(len(todo)))
        while queue or running:
            while queue and len(running) < workers:
                k = queue.pop(0)
                running[pool.submit(_worker, k)] = k
            bar.set_postfix_str("searching " + ", ".join(todo[k][1].name for k in sorted(running.values())))
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                k = running.pop(future)
                text = None if future.exception() is not None else future.result()
                if text is not None:
                    plancache.adopt(todo[k][0], text)
                bar.update(1)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
WORKER_MMAP_THRESHOLD = 32 << 20   # glibc's largest on 64-bit systems
WORKER_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """In a forked search worker: glibc's allocator keeps freed memory for the next allocation
    instead of handing it back to the system at once (a block up to 32 MiB comes from the heap,
    not a fresh mapping; the heap is trimmed past 1 GiB of free memory only). A search allocates
    and frees index arrays of every size hundreds of thousands of times, and every page the
    system got back and lent again cost a page fault and its zeroing: a cold Swin-T compile took
    1.5 million page faults and 3.5-4 of its 53-57 CPU seconds in the kernel, 370,000 and
    1.3-1.9 s with this (20 MiB more resident). Plans do not depend on it. The worker's process
    ends with its searches, so the caller's own process is left as it was. False where the C
    library has no mallopt (not glibc) or refuses a value."""
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD))


def _worker(k: int) -> str | None:
    """One search in a forked worker: the decision as a plan-cache entry, or None if it failed."""
    from dataclasses import replace
    todo, graph, t, decide, search_kw = _SHARED
    key, sub = todo[k]
    try:
        choice = decide(sub, graph, t, False, search_kw)
    except Exception:   # the pipeline searches it again in the parent and reports it there
        return None
    return plancache.stored_text(key, replace(choice, key=key), plancache.names_of(sub, graph, t))
