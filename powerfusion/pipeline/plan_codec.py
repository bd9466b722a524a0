"""Plan-cache entries as plain JSON data: nothing read from a cache can run code.

A value is written as JSON; a frozen dataclass of the GIR / search vocabulary as
`{"$": class name, field: value, ...}` (fields in name order), an enum as
`{"$": name, "v": int}` and a numpy dtype (a cast's target) as `{"$": "dtype", "v": name}`. An index subexpression (BinOp, Select, Load) written before in the
same entry is written again as `{"$": "ref", "v": n}`, n counting the subexpressions in the
order their writing finished: composed index maps repeat subexpressions so often that the
expanded trees of one Swin subgraph took 33 MB. Reading resolves a reference only to a
subexpression already read (no cycles) and builds shared nodes (`gir.expr`). Reading
builds only the classes in `_CLASSES`, through their own constructors, with exactly
their fields, and checks the strings that later choose code (scalar function names,
index operators, dtypes) against the tables that hold them. JSON arrays come back as
tuples (every sequence field of these classes is a tuple). Arrays (constants) are never
stored: a hit binds the subgraph's own constant values.

Written here rather than with a serialisation library: the ones that round-trip
dataclasses (pickle, jsonpickle, dill) rebuild arbitrary classes, which is the hazard.
"""
from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

from powerfusion.gir.expr import BinOp, Const, Load, Select, Var, _C_BINOPS, _PY_BINOPS, shared_node
from powerfusion.gir.ir import (Broadcast, Buffer, Elementwise, GIRGraph, GOp, Level, MemorySlice, Move,
                                Parallel, Reduce, Scope, Sync)


class CodecError(ValueError):
    """An entry is not well-formed plan data (a foreign, corrupted or hostile file)."""


def _search_classes():
    from powerfusion.perfmodel.cost import Estimate
    from powerfusion.pipeline.choice import PlanChoice, RankedPlan
    return PlanChoice, RankedPlan, Estimate


_BASE = (Const, Var, BinOp, Select, Load, Parallel, Buffer, MemorySlice, Elementwise, Reduce, Broadcast,
         Move, Sync, GOp, GIRGraph)
_ENUMS = {"Level": Level, "Scope": Scope}
_REDUCE_FNS = frozenset({"sum", "max", "min", "prod", "sumexp"})
# numpy dtypes a plan may name as values (an elementwise cast's `to`): written by name; without
# them every subgraph holding a cast (fp16 models' fp32 islands) stayed out of the disk cache,
# and a forked search worker's decision for it was lost and searched again in the parent
_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                     "float16", "float32", "float64"})


def _classes() -> dict[str, type]:
    return {c.__name__: c for c in _BASE + _search_classes()}


_SHARED_EXPRS = (BinOp, Select, Load)


def encode(x):
    """JSON-ready data for `x`; TypeError for anything outside the vocabulary (numpy arrays included)."""
    return _encode(x, {}, _classes())


def _encode(x, refs: dict, classes):
    if x is None or isinstance(x, (bool, str, int)) and not isinstance(x, enum.Enum):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$": "float", "v": repr(x)}
    if isinstance(x, enum.Enum):
        return {"$": type(x).__name__, "v": int(x.value)}
    if isinstance(x, (np.integer, np.bool_)):
        return int(x)
    if isinstance(x, np.floating):
        return _encode(float(x), refs, classes)
    if isinstance(x, (tuple, list)):
        return [_encode(v, refs, classes) for v in x]
    if isinstance(x, np.dtype) and x.name in _DTYPES:   # a cast's target type
        return {"$": "dtype", "v": x.name}
    if dataclasses.is_dataclass(x) and type(x).__name__ in classes:
        shared = isinstance(x, _SHARED_EXPRS)
        if shared and x in refs:
            return {"$": "ref", "v": refs[x]}
        out = {"$": type(x).__name__}
        for name in _field_names(type(x)):   # name order: the order reading visits them (sorted JSON keys)
            out[name] = _encode(getattr(x, name), refs, classes)
        if shared:
            refs[x] = len(refs)
        return out
    raise TypeError(f"plan cache cannot store a {type(x).__name__}")


def _field_names(cls) -> tuple[str, ...]:
    """The constructor fields of a vocabulary class, in name order."""
    hit = _FIELDS.get(cls)
    if hit is None:
        hit = _FIELDS[cls] = tuple(sorted(f.name for f in dataclasses.fields(cls) if f.init))
    return hit


_FIELDS: dict[type, tuple[str, ...]] = {}


def decode(d):
    """The value `encode` wrote; CodecError for anything else."""
    return _decode(d, _classes(), [])


def _decode(d, classes, refs: list):
    if d is None or isinstance(d, (bool, str, int, float)):
        return d
    if isinstance(d, list):
        return tuple(_decode(v, classes, refs) for v in d)
    if not isinstance(d, dict) or not isinstance(d.get("$"), str):
        raise CodecError(f"unexpected value {type(d).__name__}")
    name = d["$"]
    if name == "ref":
        n = d.get("v")
        if type(n) is not int or not 0 <= n < len(refs) or len(d) != 2:
            raise CodecError("bad reference")
        return refs[n]
    if name == "float":
        if d.get("v") not in ("inf", "-inf", "nan"):
            raise CodecError("bad float")
        return float(d["v"])
    if name == "dtype":
        if not isinstance(d.get("v"), str) or d["v"] not in _DTYPES or len(d) != 2:
            raise CodecError(f"unknown dtype {d.get('v')!r}")
        return np.dtype(d["v"])
    if name in _ENUMS:
        try:
            return _ENUMS[name](d["v"])
        except (KeyError, ValueError, TypeError):
            raise CodecError(f"bad {name}") from None
    cls = classes.get(name)
    if cls is None:
        raise CodecError(f"unknown class {name!r}")
    expected = _field_names(cls)
    given = set(d) - {"$"}
    if not given <= set(expected):
        raise CodecError(f"{name}: unknown field(s) {sorted(given - set(expected))}")
    kw = {k: _decode(d[k], classes, refs) for k in expected if k in d}   # name order, as written
    _check(cls, kw)
    try:
        if cls in _SHARED_EXPRS:
            out = shared_node(cls, *(kw[f.name] for f in dataclasses.fields(cls) if f.init))
            refs.append(out)
            return out
        return cls(**kw)
    except (TypeError, ValueError, KeyError) as e:
        raise CodecError(f"{name}: {e}") from None


def _check(cls, kw) -> None:
    """Strings that select code or types must name entries of the tables that hold them."""
    from powerfusion.scalar import SCALAR_FNS
    if cls is BinOp and kw.get("op") not in (_C_BINOPS.keys() | _PY_BINOPS.keys()):
        raise CodecError(f"unknown index operator {kw.get('op')!r}")
    if cls is Var and kw.get("name") not in ("u", "i", "j"):
        raise CodecError(f"unknown index variable {kw.get('name')!r}")
    if cls is Elementwise and kw.get("fn") not in SCALAR_FNS:
        raise CodecError(f"unknown scalar function {kw.get('fn')!r}")
    if cls is Reduce and kw.get("fn") not in _REDUCE_FNS:
        raise CodecError(f"unknown reduction {kw.get('fn')!r}")
    if cls in (Buffer, MemorySlice):
        try:
            np.dtype(kw.get("dtype") if kw.get("dtype") != "bfloat16" else "float32")
        except TypeError:
            raise CodecError(f"unknown dtype {kw.get('dtype')!r}") from None
    for k, v in kw.items():
        if isinstance(v, str) and len(v) > 4096:
            raise CodecError(f"{cls.__name__}.{k}: a string of {len(v)} characters")
