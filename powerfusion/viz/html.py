"""The self-contained HTML page: viewer, layout library and data inlined, nothing fetched.

The layout library is dagre (MIT; static/dagre.min.js, licence in static/dagre.LICENSE.txt
and in the file's own header comment, which is kept in every page written).
"""
from __future__ import annotations

import html
import json
import re
from importlib import resources

_STATIC = "powerfusion.viz.static"


def _asset(name: str) -> str:
    return resources.files(_STATIC).joinpath(name).read_text(encoding="utf-8")


def _json_safe(payload: str) -> str:
    """JSON that cannot end the <script> element it sits in (model names are arbitrary)."""
    return payload.replace("<", "\\u003c").replace(">", "\\u003e")


def _js(name: str) -> str:
    text = _asset(name)
    if "</script" in text.lower() or "<!--" in text:
        raise ValueError(f"{name} cannot be inlined in a <script> element")
    return text


STAGE_FIELDS = ("index", "kernel", "cluster")   # what differs for one gOperator between stages


class _Table:
    """Distinct values by their JSON text -> index (gOperators repeat across a trace's stages).
    `viz_data` shares one slice list object per gOperator between stages, so the text is
    computed once per such object (`same` holds the objects, keeping their ids valid)."""

    def __init__(self):
        self.items, self.index, self.same = [], {}, {}

    def ref(self, value, shared=None) -> int:
        if shared is not None:
            hit = self.same.get(id(shared))
            if hit is not None and hit[0] is shared and hit[1] == value:
                return hit[2]
        key = json.dumps(value, sort_keys=True, separators=(",", ":"))
        if key not in self.index:
            self.index[key] = len(self.items)
            self.items.append(value)
        if shared is not None:
            self.same[id(shared)] = (shared, value, self.index[key])
        return self.index[key]


def _default_cluster(kernel) -> str | None:
    return None if kernel is None else f"kernel {kernel}"


def pack(data: dict) -> dict:
    """The same data with each subgraph's gOperators, buffers and interfaces stored once and no
    edges (they follow from the ops: gir_json.dataflow_edges); viewer.js `unpack` restores
    the documented format. Pages get about 20x smaller than the JSON."""
    out = dict(data, packed=True, subgraphs=[])
    for sg in data["subgraphs"]:
        ops, bufs, ios = _Table(), _Table(), _Table()
        stages = []
        for st in sg["stages"]:
            g = st["gir"]
            gops = [[ops.ref({k: v for k, v in op.items() if k not in STAGE_FIELDS}, op["inputs"]), op["kernel"]]
                    + ([op["cluster"]] if op.get("cluster") != _default_cluster(op["kernel"]) else [])
                    for op in g["ops"]]
            io = ios.ref([g["inputs"], g["outputs"], g["constants"], g["parallel"]])
            packed = {k: v for k, v in g.items() if k not in ("edges", "inputs", "outputs", "constants", "parallel")}
            stages.append(dict(st, gir=dict(packed, ops=gops, io=io, buffers=[bufs.ref(b) for b in g["buffers"]])))
        out["subgraphs"].append(dict(sg, stages=stages, tables={"ops": ops.items, "buffers": bufs.items,
                                                                 "io": ios.items}))
    return out


def unpack(data: dict) -> dict:
    """`pack` undone (as viewer.js does it)."""
    from powerfusion.viz.gir_json import dataflow_edges
    if not data.get("packed"):
        return data
    out = {k: v for k, v in data.items() if k != "packed"}
    out["subgraphs"] = []
    for sg in data["subgraphs"]:
        t = sg["tables"]
        stages = []
        for st in sg["stages"]:
            g = dict(st["gir"])
            inputs, outputs, constants, parallel = t["io"][g.pop("io")]
            ops = [dict(t["ops"][ref], index=k, kernel=rest[0], cluster=rest[1] if len(rest) > 1
                        else _default_cluster(rest[0])) for k, (ref, *rest) in enumerate(g["ops"])]
            g.update(ops=ops, inputs=inputs, outputs=outputs, constants=constants, parallel=parallel,
                     buffers=[t["buffers"][r] for r in g["buffers"]],
                     edges=dataflow_edges(ops, inputs, outputs, constants))
            stages.append(dict(st, gir=g))
        out["subgraphs"].append({**{k: v for k, v in sg.items() if k != "tables"}, "stages": stages})
    return out


def render_html(data: dict) -> str:
    payload = json.dumps(pack(data), separators=(",", ":"), ensure_ascii=True)
    page = _asset("viewer.html")
    parts = {  # substituted in one pass, so no inserted text is ever re-scanned for markers
        "{{TITLE}}": html.escape(str(data.get("model", "GIR"))),
        "{{CSS}}": _asset("viewer.css"),
        "{{DATA}}": _json_safe(payload),
        "{{DAGRE}}": _js("dagre.min.js"),
        "{{VIEWER}}": _js("viewer.js"),
    }
    return re.sub("|".join(re.escape(k) for k in parts), lambda m: parts[m.group(0)], page)
