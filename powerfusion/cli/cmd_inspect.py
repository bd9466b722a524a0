"""`powerfusion inspect MODEL`: ops, unsupported nodes, and the partition with its cost figures."""
from __future__ import annotations

import collections
import json
import sys

from powerfusion.cli.common import add_model_arguments, check_model_path, parse_shapes, progress
from powerfusion.errors import UnsupportedOpError

HELP = "show a model's ops, unsupported nodes and partition (library calls, memory-bound subgraphs)"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--gir", action="store_true",
                   help="lower, rewrite and report every memory-bound subgraph's GIR (templates, gOperators, "
                        "syncs, bytes per level before/after, kernels, rule trace); JSON contract in docs/gir-json.md")


def main(args) -> int:
    if args.gir:
        return _main_gir(args)
    report = build_report(args.model, parse_shapes(args.shapes), args.target or "cpu")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if report["unsupported"]:
        print(f"powerfusion inspect: error: {len(report['unsupported'])} unsupported node(s), listed above; "
              "the model cannot be compiled", file=sys.stderr)
        return 2
    return 0


def build_report(model_path: str, shapes, target: str) -> dict:
    import onnx

    from powerfusion.frontend import import_model
    from powerfusion.frontend.loader import symbol_uses
    from powerfusion.frontend.partition import partition_graph as partition
    from powerfusion.targets.specs import get_target
    from powerfusion.session import onnx_type_string

    spec = get_target(target)
    model_path = check_model_path(model_path)
    try:
        proto = onnx.load(model_path, load_external_data=False)
    except Exception as e:   # random bytes, a truncated file, text: DecodeError and friends
        from powerfusion.errors import ModelError
        raise ModelError(f"model file '{model_path}' could not be parsed as ONNX: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    ops = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                              for n in proto.graph.node)
    report = {"model": model_path, "target": target, "device": spec.name,
              "ridge_point": spec.ridge_point(), "nodes": len(proto.graph.node),
              "ops": dict(ops.most_common()), "unsupported": [], "inputs": [], "outputs": [], "steps": [],
              "symbols": {sym: [f"{name}[{k}]" for name, k in uses] for sym, uses in symbol_uses(proto).items()}}
    progress(f"importing {model_path}")
    try:
        graph = import_model(model_path, shapes=shapes)
    except UnsupportedOpError as e:
        report["unsupported"] = [{"node": n, "op_type": op, "opset": opset, "reason": why}
                                 for n, op, opset, why in e.nodes]
        return report
    report["inputs"] = [_tensor(t, onnx_type_string) for t in graph.inputs]
    report["outputs"] = [_tensor(t, onnx_type_string) for t in graph.outputs]
    report["basic_ops"] = dict(collections.Counter(n.kind for n in graph.nodes).most_common())
    progress(f"partitioning for {target}")
    for step in partition(graph, target=target).steps:
        report["steps"].append(_step(step))
    return report


def _tensor(t, type_string) -> dict:
    return {"name": t.name, "shape": list(t.shape), "type": type_string(t.dtype)}


def _step(step) -> dict:
    from powerfusion.basic import LibraryCall
    common = {"flops": int(step.flops), "bytes": int(step.bytes), "intensity": round(step.intensity, 4)}
    if isinstance(step, LibraryCall):
        node = step.node
        return {"kind": "library", "name": node.name, "op": type(node.op).__name__,
                "origin": f"{node.origin.op_type} '{node.origin.node}'",
                "inputs": list(node.inputs), "outputs": list(node.outputs), **common}
    origins = list(dict.fromkeys(n.origin.op_type for n in step.nodes))
    return {"kind": "subgraph", "name": step.name, "basic_ops": len(step.nodes), "onnx_ops": origins,
            "inputs": list(step.inputs), "outputs": list(step.outputs), **common}


def format_report(r: dict) -> str:
    lines = [f"model {r['model']}: {r['nodes']} nodes; target {r['target']} ({r['device']}), "
             f"ridge point {r['ridge_point']:.1f} FLOP/byte"]
    lines.append("ops: " + ", ".join(f"{op} x{n}" for op, n in r["ops"].items()))
    if r.get("symbols"):   # one --shapes entry binds a symbol for every input that uses it
        lines.append("symbolic dims: " + "; ".join(f"{s} in {', '.join(u)}" for s, u in r["symbols"].items()))
    if r["unsupported"]:
        counts = collections.Counter(u["op_type"] for u in r["unsupported"])
        lines.append(f"UNSUPPORTED ({len(r['unsupported'])} node(s): "
                     + ", ".join(f"{op} x{n}" for op, n in counts.most_common()) + "); the model cannot be compiled:")
        lines += [f"  - node '{u['node']}' ({u['op_type']}, opset {u['opset']}): {u['reason']}"
                  for u in r["unsupported"]]
        return "\n".join(lines)
    lines.append("inputs: " + ", ".join(f"{t['name']} {t['shape']} {t['type']}" for t in r["inputs"]))
    lines.append("outputs: " + ", ".join(f"{t['name']} {t['shape']} {t['type']}" for t in r["outputs"]))
    lines.append("basic ops: " + ", ".join(f"{k} x{n}" for k, n in r["basic_ops"].items()))
    lib = [s for s in r["steps"] if s["kind"] == "library"]
    sgs = [s for s in r["steps"] if s["kind"] == "subgraph"]
    lines.append(f"partition: {len(lib)} library call(s), {len(sgs)} memory-bound subgraph(s)")
    lines.append(f"  {'step':<14}{'kind':<10}{'FLOPs':>14}{'bytes':>14}{'FLOP/B':>9}  what")
    for s in r["steps"]:
        what = (f"{s['op']} from {s['origin']}" if s["kind"] == "library"
                else f"{s['basic_ops']} basic ops from {', '.join(s['onnx_ops'])}")
        lines.append(f"  {_clip(s['name'], 13):<14}{s['kind']:<10}{s['flops']:>14,}{s['bytes']:>14,}"
                     f"{s['intensity']:>9.2f}  {what}")
    total_bytes = sum(s["bytes"] for s in r["steps"])
    total_flops = sum(s["flops"] for s in r["steps"])
    lines.append(f"  {'total':<24}{total_flops:>14,}{total_bytes:>14,}")
    return "\n".join(lines)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "~"


def _main_gir(args) -> int:
    from powerfusion.pipeline.inspect import inspect_gir
    target = args.target or "cuda"
    progress(f"lowering and rewriting memory-bound subgraphs for {target}")
    report = inspect_gir(check_model_path(args.model), target, parse_shapes(args.shapes))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model}: {len(report['subgraphs'])} memory-bound subgraph(s), {report['kernels']} kernel(s), "
          f"{report['library_calls']} library call(s) on {target}")
    for e in report["subgraphs"]:
        b, a = e["bytes"]["before"], e["bytes"]["after"]
        ops = _counts(e.get("gops", {}))
        syncs = _counts(e.get("syncs", {}))
        print(f"  {e['name']}: {e['kernels']} kernel(s); global {b['global']:,} -> {a['global']:,} B, "
              f"shared {b['shared']:,} -> {a['shared']:,} B; {e.get('trace_length', 0)} rule application(s)")
        if ops:
            print(f"      gOperators: {ops}")
        if syncs:
            print(f"      syncs: {syncs}")
        for t in e.get("templates", [])[:12]:
            print(f"      {t['node']}: {t['template']}")
    return 0


def _counts(before_after: dict) -> str:
    """'move 12 -> 8, sync 4 -> 0' from {'before': {...}, 'after': {...}}."""
    b, a = before_after.get("before", {}), before_after.get("after", {})
    return ", ".join(f"{k} {b.get(k, 0)} -> {a.get(k, 0)}" for k in sorted(set(b) | set(a)))
