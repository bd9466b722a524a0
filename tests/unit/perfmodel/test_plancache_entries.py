"""Plan-cache entries are data: no entry can run code, and none is served under another key."""
from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
from onnx import TensorProto as T, helper as h

from powerfusion.frontend import import_model, partition_graph
from powerfusion.gir.interpreter import run_gir
from powerfusion.pipeline import plancache
from powerfusion.pipeline.plan_codec import CodecError, decode
from powerfusion.pipeline.search import choose_plan
from powerfusion.targets.specs import get_target

H100 = get_target("h100")


def _unary(op: str):
    g = h.make_graph([h.make_node(op, ["x"], ["y"])], op.lower(), [h.make_tensor_value_info("x", T.FLOAT, [4, 64])],
                     [h.make_tensor_value_info("y", T.FLOAT, [4, 64])])
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    return graph, partition_graph(graph, "cuda").subgraphs[0]


def _run(choice, x):
    return run_gir(choice.graph, {choice.graph.inputs[0]: x.reshape(-1)})[choice.graph.outputs[0]].reshape(x.shape)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_pickle_in_the_cache_never_runs(cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    graph, sub = _unary("Relu")
    key = plancache.structural_key(sub, graph, H100)
    path = plancache._path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps((plancache.FORMAT, _Boom())))
    path.with_suffix(".pkl").write_bytes(pickle.dumps((2, _Boom())))   # the old entry format too
    choice = choose_plan(sub, graph, H100, limit=4, beam=2)
    assert choice.source == "search"
    assert not (tmp_path / "pwned").exists()
    assert json.loads(path.read_text())["key"] == key   # the search stored a JSON entry over it


def test_the_codec_builds_only_its_own_classes():
    for hostile in ({"$": "system", "command": "true"}, {"$": "Elementwise", "fn": "__import__('os')"},
                    {"$": "BinOp", "op": "exec", "a": 1, "b": 2}, {"$": "Buffer", "name": "b", "level": 0,
                                                                   "size": 1, "dtype": "float32", "extra": 1}):
        try:
            decode(hostile)
        except CodecError:
            continue
        raise AssertionError(f"decoded {hostile}")


def test_an_entry_is_not_served_under_another_key(cache):
    relu, relu_sub = _unary("Relu")
    sig, sig_sub = _unary("Sigmoid")
    choose_plan(relu_sub, relu, H100, limit=4, beam=2)
    relu_key, sig_key = (plancache.structural_key(s, g, H100) for s, g in ((relu_sub, relu), (sig_sub, sig)))
    shutil.copy(plancache._path(relu_key), plancache._path(sig_key))   # a Relu entry under the Sigmoid key
    plancache.clear_memo()
    assert plancache.lookup(sig_key, sig_sub, sig, H100) is None
    choice = choose_plan(sig_sub, sig, H100, limit=4, beam=2)
    x = np.linspace(-3, 3, 256, dtype=np.float32).reshape(4, 64)
    # float32 sigmoid on the interpreter against numpy: rtol 1e-6
    np.testing.assert_allclose(_run(choice, x), 1 / (1 + np.exp(-x)), rtol=1e-6)


def test_an_edited_entry_fails_its_hash(cache):
    graph, sub = _unary("Relu")
    choose_plan(sub, graph, H100, limit=4, beam=2)
    key = plancache.structural_key(sub, graph, H100)
    path = plancache._path(key)
    assert plancache.read_entry(path.read_text(), key) is not None
    doc = json.loads(path.read_text())
    text = json.dumps(doc["payload"]).replace('"relu"', '"sigmoid"')
    assert '"sigmoid"' in text
    doc["payload"] = json.loads(text)
    path.write_text(json.dumps(doc))
    plancache.clear_memo()
    assert plancache.read_entry(path.read_text(), key) is None
    assert choose_plan(sub, graph, H100, limit=4, beam=2).source == "search"


def test_repeated_subexpressions_are_written_once_and_read_back_shared():
    from powerfusion.gir.expr import I, U, Load, select
    from powerfusion.pipeline.plan_codec import encode
    e = (U * 3 + I) // 4
    value = (select(e.lt(5), e + e, Load("x", e)), e)
    data = json.loads(json.dumps(encode(value), sort_keys=True))   # as the cache writes it
    assert json.dumps(data).count('"floordiv"') == 1   # written once, referred to after
    back = decode(data)
    assert back == value and repr(back) == repr(value)
    assert back[0].a.a is back[0].a.b is back[1]


def test_a_reference_resolves_only_to_a_subexpression_read_before_it():
    u = {"$": "Var", "name": "u"}
    for hostile in ({"$": "ref", "v": 0}, {"$": "ref", "v": -1}, {"$": "ref", "v": True}, {"$": "ref", "v": "0"},
                    {"$": "BinOp", "op": "add", "a": {"$": "ref", "v": 0}, "b": u},   # itself: a cycle
                    {"$": "BinOp", "op": "add", "a": {"$": "BinOp", "op": "add", "a": u, "b": u},
                     "b": {"$": "ref", "v": 1}},
                    {"$": "BinOp", "op": "add", "a": {"$": "BinOp", "op": "add", "a": u, "b": u},
                     "b": {"$": "ref", "v": 0, "w": 1}}):
        try:
            decode(hostile)
        except CodecError:
            continue
        raise AssertionError(f"decoded {hostile}")


def test_a_plan_with_a_cast_is_stored_and_reads_back(cache):
    """A cast names its target as a numpy dtype: such plans (every fp16 model's fp32 islands)
    were once kept in memory only, and a search worker's decision for them was lost."""
    g = h.make_graph([h.make_node("Cast", ["x"], ["c"], to=T.FLOAT16), h.make_node("Relu", ["c"], ["y"])], "cast",
                     [h.make_tensor_value_info("x", T.FLOAT, [4, 64])], [h.make_tensor_value_info("y", T.FLOAT16, [4, 64])])
    graph = import_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
    sub = partition_graph(graph, "cuda").subgraphs[0]
    choice = choose_plan(sub, graph, H100, limit=4, beam=2)
    assert any(op.args.params for op in choice.graph.ops if type(op.args).__name__ == "Elementwise")
    key = plancache.structural_key(sub, graph, H100)
    assert plancache._path(key).is_file()
    plancache.clear_memo()
    hit = plancache.lookup(key, sub, graph, H100)
    assert hit is not None and hit.source == "disk" and hit.graph.ops == choice.graph.ops


def test_the_codec_reads_only_known_dtypes():
    assert decode({"$": "dtype", "v": "float16"}) == np.dtype("float16")
    for hostile in ({"$": "dtype", "v": "object"}, {"$": "dtype", "v": "O"}, {"$": "dtype", "v": "float32", "x": 1},
                    {"$": "dtype", "v": ["float32"]}):
        try:
            decode(hostile)
        except CodecError:
            continue
        raise AssertionError(f"decoded {hostile}")
