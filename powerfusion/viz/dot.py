"""Graphviz DOT (and SVG through Graphviz's `dot`, where installed) from the viz data dict.

One view per file: the partition, or one stage of one subgraph's GIR, with the same
styling as the HTML viewer (colours by gOperator kind, syncs by scope, kernels as
clusters, edges labelled with their slice).
"""
from __future__ import annotations

import shutil
import subprocess

from powerfusion.errors import PowerFusionError

KIND_COLOUR = {"elementwise": "#8fd19e", "reduce": "#f4a261", "broadcast": "#e9c46a", "move": "#9cc3ee",
               "library": "#f28482", "subgraph": "#cfe3ff", "io": "#e6e6e6"}
SCOPE_COLOUR = {"lane": "#eeeeee", "warp": "#d7ccff", "block": "#b38ae8", "device": "#e76f51"}


def _q(text) -> str:
    """A DOT double-quoted string (model names are arbitrary)."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def pick_view(data: dict, view: str | None, step: int | None) -> tuple[str, dict | None, int | None]:
    """(view name, subgraph dict or None for the partition, stage index)."""
    subs = {s["name"]: s for s in data["subgraphs"]}
    if view is None:
        view = "partition" if data.get("partition") else (data["subgraphs"][0]["name"] if subs else "partition")
    if view == "partition":
        if not data.get("partition"):
            raise PowerFusionError("this visualisation has no partition (it was built from GIR, not a model)")
        return view, None, None
    if view not in subs:
        raise PowerFusionError(f"no subgraph '{view}'; known: partition, {', '.join(subs) or '(none)'}")
    sg = subs[view]
    if not sg["stages"]:
        raise PowerFusionError(f"subgraph '{view}' has no GIR to show: it failed at {sg['failed_at']}: {sg['error']}")
    n = len(sg["stages"])
    k = n - 1 if step is None else step
    if not 0 <= k < n:
        raise PowerFusionError(f"subgraph '{view}' has stages 0..{n - 1}; --step {step} is out of range")
    return view, sg, k


def to_dot(data: dict, view: str | None = None, step: int | None = None) -> str:
    view, sg, k = pick_view(data, view, step)
    lines = ["digraph G {", '  rankdir=TB; node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8, color="#777777"];']
    if sg is None:
        _partition(data["partition"], lines)
    else:
        stage = sg["stages"][k]
        lines.append(f"  label={_q(sg['name'] + ' - ' + stage['label'])}; labelloc=t;")
        _gir(stage, lines)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _io(end, lines, seen):
    if isinstance(end, str) and ":" in end and end not in seen:
        seen.add(end)
        lines.append(f"  {_q(end)} [label={_q(end.split(':', 1)[1])}, shape=ellipse, fillcolor={_q(KIND_COLOUR['io'])}];")


def _partition(p: dict, lines: list[str]) -> None:
    clusters: dict[str, list[dict]] = {}
    for n in p["nodes"]:
        clusters.setdefault(n["step"] if n["kind"] == "subgraph" else "", []).append(n)
    for name, members in clusters.items():
        if name:
            lines.append(f"  subgraph {_q('cluster_' + name)} {{ label={_q(name)}; style=dashed;")
        for n in members:
            lines.append(f"    {_q(n['id'])} [label={_q(n['op_type'] + chr(10) + n['name'])}, "
                         f"fillcolor={_q(KIND_COLOUR[n['kind']])}];")
        if name:
            lines.append("  }")
    seen: set = set()
    for e in p["edges"]:
        _io(e["source"], lines, seen)
        _io(e["target"], lines, seen)
        shape = "x".join(map(str, e["shape"])) if e["shape"] else ""
        lines.append(f"  {_q(e['source'])} -> {_q(e['target'])} [label={_q(shape)}, tooltip={_q(e['tensor'])}];")


def _gir(stage: dict, lines: list[str]) -> None:
    ops = stage["gir"]["ops"]
    added = set(stage.get("added") or [])
    clusters: dict[str | None, list[dict]] = {}
    for op in ops:
        clusters.setdefault(op.get("cluster"), []).append(op)
    for name, members in clusters.items():
        if name is not None:
            lines.append(f"  subgraph {_q('cluster_' + name)} {{ label={_q(name)}; style=dashed;")
        for op in members:
            fill = SCOPE_COLOUR[op["scope"]] if op["kind"] == "sync" else KIND_COLOUR[op["kind"]]
            extra = ", penwidth=3" if op["scope"] == "device" or op["uid"] in added else ""
            extra += ', color="#dd0000"' if op["uid"] in added else ""
            label = f"{op['label']}\n{op['origin']} #{op['uid']}"
            lines.append(f"    {_q(op['index'])} [label={_q(label)}, fillcolor={_q(fill)}, tooltip={_q(op['describe'])}{extra}];")
        if name is not None:
            lines.append("  }")
    seen: set = set()
    for e in stage["gir"]["edges"]:
        _io(e["source"], lines, seen)
        _io(e["target"], lines, seen)
        lines.append(f"  {_q(e['source'])} -> {_q(e['target'])} [label={_q(e['label'])}];")


def dot_available() -> bool:
    return shutil.which("dot") is not None


def to_svg(dot_text: str) -> str:
    exe = shutil.which("dot")
    if exe is None:
        raise PowerFusionError("--format svg needs Graphviz's `dot` on PATH (e.g. apt-get install graphviz); "
                               "--format html needs nothing installed")
    done = subprocess.run([exe, "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise PowerFusionError(f"Graphviz dot failed: {done.stderr.strip()[:500]}")
    return done.stdout
