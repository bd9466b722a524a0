"""Writing a compiled Plan to a folder: one source file per kernel plus plan.json, so that
another build system can compile and launch the kernels without PowerFusion.

plan.json (version 1):
  {"version": 1, "model", "target", "backend",
   "tensors": {name: {"shape", "dtype", "offset" | null, "kind": input|output|constant|intermediate}},
   "arena_bytes": int,
   "steps": [ {"kind": "kernels", "subgraph", "kernels": [{"name", "file", "grid", "block",
                "shared_bytes", "params": [{"buffer", "tensor" | null, "dtype", "written"}]}],
               "scratch": [{"buffer", "elements", "dtype", "constant_file" | null}]}
            | {"kind": "library", "op": "matmul"|"conv", "node", "inputs", "outputs", "attributes"} ]}
Constants that kernels read are written as .npy files next to the sources.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, is_dataclass
from pathlib import Path

import numpy as np

from powerfusion.plan import KernelStep, LibraryStep, Plan
from powerfusion.gir.ir import Level


def write_plan(plan: Plan, out_dir: str | Path, extension: str) -> Path:
    """Write the plan into `out_dir`; files an earlier plan.json there named and this one does
    not are removed, so the folder holds one model's files."""
    from powerfusion.names import FileNames
    from powerfusion.runtime.buffers import TensorLife, plan_buffers
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    earlier = _named_files(out / "plan.json")
    files = FileNames()
    g = plan.graph
    kinds = {t.name: "input" for t in g.inputs} | {t.name: "output" for t in g.outputs}
    first, last = {t.name: -1 for t in g.inputs}, {}
    steps_json = []
    for k, s in enumerate(plan.steps):
        ins, outs = (s.call.node.inputs, s.call.node.outputs) if isinstance(s, LibraryStep) else \
            (s.subgraph.inputs, s.subgraph.outputs)
        for t in outs:
            first.setdefault(t, k)
        for t in ins:
            if t not in g.constants:
                last[t] = k
        steps_json.append(_library_json(s) if isinstance(s, LibraryStep) else _kernels_json(s, out, extension, files))
    for t in g.outputs:
        last[t.name] = len(plan.steps)
    lives = [TensorLife(t, max(g.tensors[t].nbytes, 1), first[t], last.get(t, first[t])) for t in first]
    bplan = plan_buffers(lives)
    tensors = {}
    for name, info in g.tensors.items():
        kind = kinds.get(name, "constant" if name in g.constants else "intermediate")
        if kind == "intermediate" and name not in bplan.offsets:
            continue  # lives inside one kernel step only
        tensors[name] = {"shape": list(info.shape), "dtype": np.dtype(info.dtype).name,
                         "offset": bplan.offsets.get(name), "kind": kind}
    for s in plan.library_steps:
        for t in s.call.node.inputs:
            if t in g.constants:
                name = files.file(("constant", t), f"const_{t}", ".npy")
                _save(out / name, np.asarray(g.constants[t]))
                tensors[t]["file"] = name
    doc = {"version": 1, "model": plan.model, "target": plan.target, "tensors": tensors,
           "arena_bytes": bplan.arena_bytes, "steps": steps_json,
           "timings_s": {k: round(v, 4) for k, v in plan.timings.items()}}
    path = out / "plan.json"
    _replace(path, lambda f: f.write(json.dumps(doc, indent=1, default=_jsonable).encode()))
    _remove_stale(out, earlier - set(_named_files(path)))
    return path


def _named_files(plan_json: Path) -> set[str]:
    """The plain file names an existing plan.json lists (none when there is no readable one)."""
    from powerfusion.compile_cache import output_files
    try:
        names = output_files(plan_json)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str) and n and "/" not in n and n not in (".", "..")
            and os.sep not in n and n != plan_json.name}


def _remove_stale(out: Path, names: set[str]) -> None:
    for n in names:
        try:
            (out / n).unlink()
        except OSError:
            pass   # already gone, or not ours to remove


def _kernels_json(s: KernelStep, out: Path, extension: str, files) -> dict:
    kernels = []
    for ks in s.kernels:
        f = files.file(("kernel", s.name, ks.name), ks.name, extension)
        _replace(out / f, lambda fo, text=ks.source: fo.write(text.encode()))
        kernels.append({"name": ks.name, "file": f, "grid": list(ks.grid), "block": list(ks.block),
                        "shared_bytes": ks.shared_bytes,
                        "params": [{"buffer": b, "tensor": s.buffers.get(b), "dtype": dt, "written": w}
                                   for b, dt, w in ks.params]})
    interface = set(s.gir.inputs) | set(s.gir.outputs)
    consts = dict(s.gir.constants)
    scratch = []
    for b in s.gir.buffers:
        if b.level == Level.GLOBAL and b.name not in interface:
            entry = {"buffer": b.name, "elements": b.size, "dtype": b.dtype, "constant_file": None}
            if b.name in consts:
                entry["constant_file"] = files.file(("scratch", s.name, b.name), f"{s.gir.name}_{b.name}", ".npy")
                _save(out / entry["constant_file"], np.asarray(consts[b.name]))
            scratch.append(entry)
    return {"kind": "kernels", "subgraph": s.name, "kernels": kernels, "scratch": scratch}


def _save(path: Path, a: np.ndarray) -> None:
    """np.save, unless the file already holds exactly this array (a recompile into the same
    folder rewrote hundreds of MB of weights: reading them back from the page cache to compare
    is several times faster than writing them)."""
    if path.is_file():
        try:
            old = np.load(path, mmap_mode="r", allow_pickle=False)
            if old.dtype == a.dtype and old.shape == a.shape and np.array_equal(old, a):
                return
        except (ValueError, OSError):   # unreadable or another format: rewrite it
            pass
    _replace(path, lambda f: np.save(f, a))


def _replace(path: Path, write) -> None:
    """Write a new file and rename it over `path`: a reader (or a crash) never sees half a file,
    and a file linked elsewhere is never changed in place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _library_json(s: LibraryStep) -> dict:
    n = s.call.node
    return {"kind": "library", "op": type(n.op).__name__.lower(), "node": n.name, "onnx_node": n.origin.node,
            "inputs": list(n.inputs), "outputs": list(n.outputs), "attributes": asdict(n.op),
            "flops": s.call.flops, "bytes": s.call.bytes}


def _jsonable(x):
    if is_dataclass(x):
        return asdict(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.dtype):
        return x.name
    return str(x)
