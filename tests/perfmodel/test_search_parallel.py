"""Searching a model's subgraphs across processes (pipeline/parallel.py): identical subgraphs
are searched once, and the plans chosen do not depend on how many processes searched."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

from powerfusion.frontend import import_model
from powerfusion.pipeline import parallel, plancache, search
from powerfusion.pipeline.driver import CompileOptions, compile

B, N = 64, 256


@pytest.fixture(scope="module")
def model():
    """x -> (Add, Relu) -> MatMul -> (Add, Relu) -> MatMul -> Softmax: the two (Add, Relu)
    subgraphs have one structure (other tensors, same shapes), Softmax another."""
    rng = np.random.default_rng(0)
    init = [h.make_tensor(n, T.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel())
            for n, shape in (("b1", [N]), ("w1", [N, N]), ("b2", [N]), ("w2", [N, N]))]
    nodes = [h.make_node("Add", ["x", "b1"], ["a1"]), h.make_node("Relu", ["a1"], ["r1"]),
             h.make_node("MatMul", ["r1", "w1"], ["m1"]),
             h.make_node("Add", ["m1", "b2"], ["a2"]), h.make_node("Relu", ["a2"], ["r2"]),
             h.make_node("MatMul", ["r2", "w2"], ["m2"]), h.make_node("Softmax", ["m2"], ["y"], axis=-1)]
    g = h.make_graph(nodes, "twins", [h.make_tensor_value_info("x", T.FLOAT, [B, N])],
                     [h.make_tensor_value_info("y", T.FLOAT, [B, N])], init)
    return import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))


def _plans(graph, workers: int, choose: str = "search"):
    plan = compile(graph, "cuda", CompileOptions(workers=workers, render=False, choose=choose))
    return [(s.subgraph.name, tuple(label for _, label in s.gir.templates), s.gir.ops) for s in plan.kernel_steps]


def _fresh(cache_dir, name: str):
    from powerfusion import options
    plancache.clear_memo()
    return options.context(cache_dir=cache_dir / name)


def test_identical_subgraphs_are_searched_once(model, tmp_path, monkeypatch):
    searched = []
    real = search._search
    monkeypatch.setattr(search, "_search", lambda sub, *a, **k: searched.append(sub.name) or real(sub, *a, **k))
    with _fresh(tmp_path, "one"):
        steps = _plans(model, workers=1)
    assert len(steps) == 3 and len(searched) == 2, (steps, searched)
    (_, twin_a, ops_a), (_, twin_b, ops_b) = steps[:2]
    assert twin_a == twin_b and len(ops_a) == len(ops_b)
    # the second twin's plan is the first's, renamed onto its own tensors
    assert {s.buffer for op in ops_a for s in op.inputs} != {s.buffer for op in ops_b for s in op.inputs}


@pytest.mark.parametrize("choose", ["search", "default"])
def test_parallel_search_chooses_what_one_process_chooses(model, tmp_path, choose):
    with _fresh(tmp_path, "serial"):
        serial = _plans(model, workers=1, choose=choose)
    with _fresh(tmp_path, "forked"):
        todo = parallel.pending_searches([s for s in _partition(model).subgraphs], model, _cuda())
        assert len(todo) == 2
        forked = _plans(model, workers=2, choose=choose)
        assert all(plancache.has(k) for k, _ in todo)   # the workers' decisions were adopted
    assert [(n, labels) for n, labels, _ in serial] == [(n, labels) for n, labels, _ in forked]
    assert [ops for *_, ops in serial] == [ops for *_, ops in forked]
    plancache.clear_memo()


def test_a_warm_compile_searches_nothing(model, tmp_path):
    with _fresh(tmp_path, "warm"):
        _plans(model, workers=2)
        plancache.clear_memo()   # a new process: decisions come from disk
        part = _partition(model)
        assert parallel.search_all(part.subgraphs, model, _cuda(), workers=2) == 0
    plancache.clear_memo()


def _partition(graph):
    from powerfusion.frontend.partition import partition_graph
    return partition_graph(graph, "cuda")


def _cuda():
    from powerfusion.targets.specs import get_target
    return get_target("cuda")


def test_search_settings_from_the_environment():
    from powerfusion.errors import PowerFusionError
    from powerfusion.options import _from_environment
    opts = _from_environment({"POWERFUSION_SEARCH_WORKERS": "3", "POWERFUSION_SEARCH_PLANS": "5",
                              "POWERFUSION_SEARCH_BUDGET_S": "2.5"})
    assert (opts.search_workers, opts.search_plans, opts.search_budget_s) == (3, 5, 2.5)
    assert _from_environment({}).search_workers == 0 and _from_environment({}).search_plans is None
    with pytest.raises(PowerFusionError, match="POWERFUSION_SEARCH_WORKERS"):
        _from_environment({"POWERFUSION_SEARCH_WORKERS": "many"})


def _compile_in_worker(args):
    graph, cache_dir = args
    from powerfusion import options
    with options.context(cache_dir=cache_dir):
        return len(compile(graph, "cuda", CompileOptions(workers=2, render=False)).kernel_steps)


def test_compile_inside_a_pool_worker_searches_in_its_own_process(model, tmp_path):
    """A multiprocessing.Pool worker is daemonic and may not start processes: compiling there
    (a user's pool, or benchmarks/precompile_conformance.py) searches in that worker instead of
    failing with "daemonic processes are not allowed to have children"."""
    import multiprocessing as mp
    plancache.clear_memo()
    with mp.get_context("fork").Pool(1) as pool:
        assert pool.map(_compile_in_worker, [(model, tmp_path / "pool")])[0] == 3


def test_searches_run_with_fewer_young_collections(model, tmp_path, monkeypatch):
    """search_all raises the collector's young threshold while it searches (the forked workers
    inherit it) and restores it afterwards; collection switched off (0) stays off."""
    import gc
    seen = []
    real = search._search
    monkeypatch.setattr(search, "_search", lambda *a, **k: seen.append(gc.get_threshold()) or real(*a, **k))
    old = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with _fresh(tmp_path, "gc"):
            _plans(model, workers=1)
        assert seen and all(t == (parallel.SEARCH_GC_THRESHOLD, 10, 10) for t in seen), seen
        assert gc.get_threshold() == (700, 10, 10)
        with parallel.search_collector():
            assert gc.get_threshold()[0] == parallel.SEARCH_GC_THRESHOLD
        gc.set_threshold(0, 10, 10)
        with parallel.search_collector():
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold() == (0, 10, 10)
    finally:
        gc.set_threshold(*old)
        plancache.clear_memo()


def _allocator_settings_in_worker(_):
    return parallel.keep_freed_memory()


def test_forked_workers_keep_freed_memory():
    """The pool's workers set glibc's allocator to keep freed memory (pipeline/parallel.py,
    keep_freed_memory), in the worker only; a C library without mallopt is left as it is."""
    import multiprocessing as mp
    import platform
    with mp.get_context("fork").Pool(1) as pool:
        kept = pool.map(_allocator_settings_in_worker, [0])[0]
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert kept is True
    else:
        assert kept in (True, False)
