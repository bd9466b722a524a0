"""The cpu target's whole-model driver: consecutive steps run as one generated C function.

Per-step Python (a ctypes call, feeding a dict, a numpy BLAS call) costs 10-20 us a step, more
than many small models' kernels take. So the session groups the partition's steps into runs of
consecutive steps that C can do alone -- memory-bound subgraphs compiled to C and float32/64
MatMul and 2-D Conv library calls -- and renders each run to one C function (`pf_drive`) that
calls the subgraphs' module entry points (by address, so their cached shared objects are
reused) and the library ops of templates/driver.h in order, over buffers planned once: each
tensor made in a run has its own array, allocated at session creation and reused every run
(model outputs excepted: they get a fresh array each run, as they leave the session).

GEMMs go to the CBLAS entry points of the OpenBLAS that numpy itself loads (numpy >= 2 ships
it as scipy-openblas, with `scipy_` / `64_` symbol names); their addresses are passed to the
driver, so nothing is linked and nothing new is installed. A numpy built against a BLAS without
CBLAS symbols (Accelerate, MKL) leaves the library calls on the per-step numpy path.

Steps the driver does not take -- subgraphs on the GIR or basic-op executor, typed GEMMs,
onnxruntime fallbacks, other dtypes, zero-size tensors -- run in Python between runs, as
before; `Driver.reason` says why a step was left out. Gather indices that come from outside
a subgraph are checked before the run (frontend/index_check.py); a gather whose indices are
made by an earlier step of the same run ends the run there, so that they can be checked.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.resources
import math
from dataclasses import dataclass, field

import numpy as np

from powerfusion.backends.cpu.epilogue import Activation, conv_activation
from powerfusion.backends.cpu.library import threads
from powerfusion.basic import BasicGraph, Conv, MatMul, Subgraph
from powerfusion.frontend.index_check import check_gathers, gather_nodes
from powerfusion.gir.interpreter import np_dtype

FLOATS = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
CONV_TILE_BYTES = 128 * 1024   # one block's im2col matrix: about half a core's L2
CONV_TILE_MIN_COLUMNS = 256
IGEMM_ROWS, IGEMM_VECTORS = 8, 3   # driver.h's PF_IG_MR and PF_IG_NR
IGEMMC_VECTORS = 3                 # driver.h's PF_IGC_NC
IGEMM_MIN_USE = 0.85               # of the positions it computes, the part that are outputs
IGEMM_MAX_BYTES = 16 << 20         # the phase planes of all input channels


@dataclass(frozen=True)
class Blas:
    """Addresses of numpy's OpenBLAS entry points and the integer width of its interface."""
    sgemm: int
    dgemm: int
    get_threads: int
    set_threads: int
    int_type: str      # the C type of its integers


@functools.cache
def numpy_blas() -> Blas | None:
    """numpy's OpenBLAS, found through threadpoolctl, or None when it has no CBLAS GEMM."""
    from powerfusion.backends.cpu.library import _blas
    for lib in _blas().lib_controllers:
        if lib.internal_api != "openblas":
            continue
        dll = ctypes.CDLL(lib.filepath)
        for prefix, suffix, int_type in (("scipy_", "64_", "long long"), ("", "64_", "long long"),
                                         ("scipy_", "", "int"), ("", "", "int")):
            try:
                names = [f"{prefix}cblas_sgemm{suffix}", f"{prefix}cblas_dgemm{suffix}",
                         f"{prefix}openblas_get_num_threads{suffix}", f"{prefix}openblas_set_num_threads{suffix}"]
                addrs = [ctypes.cast(getattr(dll, n), ctypes.c_void_p).value for n in names]
            except AttributeError:
                continue
            return Blas(*addrs, int_type)
    return None


class Table:
    """The driver's pointer table: a slot per tensor of the run, per constant and per scratch
    buffer; `arrays` keeps what the slots point to alive."""

    def __init__(self):
        self.slots: dict[str, int] = {}
        self.arrays: list[np.ndarray | None] = []

    def tensor(self, name: str) -> int:
        if name not in self.slots:
            self.slots[name] = len(self.arrays)
            self.arrays.append(None)
        return self.slots[name]

    def static(self, array: np.ndarray, key: str | None = None) -> int:
        if key is not None and key in self.slots:
            return self.slots[key]
        self.arrays.append(array)
        if key is not None:
            self.slots[key] = len(self.arrays) - 1
        return len(self.arrays) - 1


@dataclass
class RunBuilder:
    """Collects the C statements and buffers of one run."""
    graph: BasicGraph
    table: Table = field(default_factory=Table)
    lines: list[str] = field(default_factory=list)
    decls: list[str] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)     # kernel entry addresses, F[k]
    names: list[str] = field(default_factory=list)       # step names, in order
    made: set = field(default_factory=set)               # tensors the run writes
    read: dict = field(default_factory=dict)             # tensors it reads from outside -> dtype
    gathers: list = field(default_factory=list)          # gather nodes whose indices come from outside
    fused: list = field(default_factory=list)            # the nodes of its subgraphs (indices computed there)

    def operand(self, name: str) -> str:
        """`T[k]` for a tensor a step reads: a constant's own array, or one fed or made."""
        if name in self.graph.constants:
            info = self.graph.tensors[name]
            a = np.asarray(np.asarray(self.graph.constants[name]), dtype=np.dtype(info.dtype), order="C")
            return f"T[{self.table.static(a, 'const:' + name)}]"
        if name not in self.made:
            self.read[name] = np.dtype(self.graph.tensors[name].dtype)
        return f"T[{self.table.tensor(name)}]"

    def result(self, name: str) -> str:
        self.made.add(name)
        return f"T[{self.table.tensor(name)}]"


def _static_shape(graph: BasicGraph, names) -> bool:
    return all(all(int(d) > 0 for d in graph.tensors[t].shape) for t in names)


def add_subgraph(b: RunBuilder, sub: Subgraph, kernel) -> str | None:
    """Append a compiled subgraph's call; the reason it cannot be appended, else None."""
    ng = kernel.native
    if ng is None:
        return f"runs on the {kernel.path} path"
    if not _static_shape(b.graph, list(sub.inputs) + list(sub.outputs)):
        return "a zero-size tensor"
    interface = {buf: t for buf, t in kernel.inputs + kernel.outputs}
    for buf, t in interface.items():
        info = b.graph.tensors[t]
        if np_dtype(ng.graph.buffer(buf).dtype) != np.dtype(info.dtype) or ng.graph.buffer(buf).size != info.size:
            return f"GIR buffer {buf} does not have tensor {t}'s dtype and size"
    args = []
    outputs = {buf for buf, _ in kernel.outputs}
    for buf in ng.module.buffers:
        if buf in interface:
            args.append(b.result(interface[buf]) if buf in outputs else b.operand(interface[buf]))
        elif buf in ng.bound:
            args.append(f"T[{b.table.static(ng.bound[buf])}]")
        else:
            return f"GIR buffer {buf} has no array"
    b.entries.append(ng.entry_address)
    b.lines.append(f"{{ void *a[] = {{{', '.join(args) or '0'}}}; F[{len(b.entries) - 1}](a); }}")
    return None


def add_matmul(b: RunBuilder, node, k: int) -> str | None:
    g = b.graph
    if len(node.inputs) != 2:
        return "not a two-operand MatMul"
    a_info, b_info, out = (g.tensors[t] for t in (*node.inputs, node.outputs[0]))
    dtypes = {np.dtype(a_info.dtype), np.dtype(b_info.dtype), np.dtype(out.dtype)}
    if len(dtypes) != 1 or (dt := dtypes.pop()) not in FLOATS:
        return "not float32/float64"
    sa, sb = tuple(a_info.shape), tuple(b_info.shape)
    if len(sa) < 2 or len(sb) < 2 or not _static_shape(g, [*node.inputs, node.outputs[0]]):
        return "a vector or zero-size operand"
    op: MatMul = node.op
    m, ka = (sa[-1], sa[-2]) if op.trans_a else (sa[-2], sa[-1])
    kb, n = (sb[-1], sb[-2]) if op.trans_b else (sb[-2], sb[-1])
    batch = np.broadcast_shapes(sa[:-2], sb[:-2])
    if ka != kb or tuple(out.shape) != tuple(batch) + (m, n):
        return f"shapes {sa} @ {sb} -> {tuple(out.shape)} disagree"
    items = math.prod(batch)
    if not op.trans_a and math.prod(sb[:-2]) == 1 and items > 1:   # a weight: the batch folds into M
        m, items, a_off, b_off = m * items, 1, [0], [0]
    else:
        a_off = (np.broadcast_to(np.arange(math.prod(sa[:-2])).reshape(sa[:-2]), batch).reshape(-1) * (m * ka)).tolist()
        b_off = (np.broadcast_to(np.arange(math.prod(sb[:-2])).reshape(sb[:-2]), batch).reshape(-1) * (kb * n)).tolist()
    A, B = b.operand(node.inputs[0]), b.operand(node.inputs[1])
    b.decls.append(f"static const long long pf_a{k}[] = {{{', '.join(map(str, a_off))}}};")
    b.decls.append(f"static const long long pf_b{k}[] = {{{', '.join(map(str, b_off))}}};")
    ctype = "float" if dt == np.float32 else "double"
    b.lines.append(f"pf_matmul_{FLOATS[dt]}({items}, pf_a{k}, pf_b{k}, {int(op.trans_a)}, {int(op.trans_b)}, "
                   f"{m}, {n}, {ka}, ({ctype} *){A}, ({ctype} *){B}, ({ctype} *){b.result(node.outputs[0])});")
    return None


def add_conv(b: RunBuilder, node, k: int, act: Activation | None = None, writes: str | None = None) -> str | None:
    """Append a 2-D Conv; with `act`, it applies that activation and writes tensor `writes`
    (the fused subgraph's output) instead of its own output."""
    g, op = b.graph, node.op
    x, w, out = g.tensors[node.inputs[0]], g.tensors[node.inputs[1]], g.tensors[node.outputs[0]]
    dtypes = {np.dtype(g.tensors[t].dtype) for t in (*node.inputs, node.outputs[0])}
    if len(dtypes) != 1 or (dt := dtypes.pop()) not in FLOATS:
        return "not float32/float64"
    if len(x.shape) != 4 or not _static_shape(g, [*node.inputs, node.outputs[0]]):
        return "not a 2-D convolution"
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh, ow = out.shape[2:]
    grp = op.group
    if cg * grp != c or m % grp or tuple(out.shape[:2]) != (n, m):
        return "channels and groups disagree"
    direct = c == grp or m // grp <= 4   # as PF_DIRECT_MAX_OUTPUTS in driver.h
    pointwise = kh == kw == 1 and tuple(op.strides) == (1, 1) and not any(op.pad_begins) and not any(op.pad_ends)
    nbuf = threads()
    if direct:   # an output channel a job over its inputs' phase planes (driver.h)
        rows, scratch = 0, plane_scratch(kh, kw, oh, ow, op.strides, op.dilations, dt.itemsize) * nbuf
    else:
        # blocks of output rows whose im2col matrix stays in a core's cache (CONV_TILE_BYTES)
        # (at least CONV_TILE_MIN_COLUMNS positions: every block streams the whole weight matrix)
        rows = min(oh, max(CONV_TILE_BYTES // max(1, c * kh * kw * ow * dt.itemsize), -(-CONV_TILE_MIN_COLUMNS // ow), 1))
        scratch = 0 if pointwise else c * kh * kw * max(nbuf * rows * ow, oh * ow)
    s = [n, c, h, wd, m, grp, kh, kw, oh, ow, *op.strides, *op.dilations, *op.pad_begins, rows, nbuf]
    implicit = None if direct or grp != 1 or kh * kw == 1 else implicit_gemm(
        c, kh, kw, oh, ow, op.strides, op.dilations, dt.itemsize)
    X, W = b.operand(node.inputs[0]), None
    if implicit is not None:   # the weights packed once; the scratch holds the phase planes
        fn, scratch = implicit
        panel = IGEMM_ROWS if fn == "pf_igemm" else IGEMMC_VECTORS * 64 // dt.itemsize
        W = f"T[{b.table.static(pack_weights(np.asarray(b.graph.constants[node.inputs[1]], dt), panel))}]"
    W = W or b.operand(node.inputs[1])
    bias = b.operand(node.inputs[2]) if len(node.inputs) > 2 else "0"
    cols = f"T[{b.table.static(np.empty(scratch, dt))}]" if scratch else "0"
    ctype = "float" if dt == np.float32 else "double"
    b.decls.append(f"static const pf_conv_shape pf_c{k} = {{{', '.join(str(int(v)) for v in s)}}};")
    if act is not None:
        b.decls.append(f"static const pf_act pf_e{k} = {act.c_initializer()};")
    fn = implicit[0] if implicit is not None else "pf_conv2d"
    b.lines.append(f"{fn}_{FLOATS[dt]}(&pf_c{k}, ({ctype} *){X}, ({ctype} *){W}, ({ctype} *){bias}, "
                   f"({ctype} *){b.result(writes or node.outputs[0])}, ({ctype} *){cols}, "
                   f"{f'&pf_e{k}' if act is not None else '0'});")
    return None


def phase_plane(kh: int, kw: int, oh: int, ow: int, strides, dilations) -> tuple[int, int]:
    """Rows and pitch of one of driver.h's phase planes: the padded input rows and columns that
    the outputs read, split by stride (phase (pr, pc) holds rows pr, pr + sh, ...)."""
    (sh, sw), (dh, dw) = strides, dilations
    return (-(-((oh - 1) * sh + (kh - 1) * dh + 1) // sh), -(-((ow - 1) * sw + (kw - 1) * dw + 1) // sw))


def plane_scratch(kh: int, kw: int, oh: int, ow: int, strides, dilations, itemsize: int) -> int:
    """Scratch elements one thread needs in driver.h's direct conv over phase planes: the planes
    (in whole vectors), the positions read past them, the results, one vector to align."""
    (sh, sw), vec = strides, 64 // itemsize
    rows, pitch = phase_plane(kh, kw, oh, ow, strides, dilations)
    runs = -(-(oh * pitch) // vec) * vec
    planes = -(-(sh * sw * rows * pitch) // vec) * vec
    return planes + 2 * runs + vec


def implicit_gemm(c: int, kh: int, kw: int, oh: int, ow: int, strides, dilations,
                  itemsize: int) -> tuple[str, int] | None:
    """Which of driver.h's implicit GEMMs a one-group KxK conv takes, and its scratch elements
    (the phase planes of every input channel; for pf_igemm also the positions read past them and
    alignment): pf_igemm, strips of positions, where at least IGEMM_MIN_USE of the positions it
    computes are outputs; else pf_igemmc, vectors of output channels (a 14x14 plane: 196 of 240;
    a 7x7 one: 49 of 96). None where the planes exceed IGEMM_MAX_BYTES: im2col."""
    (sh, sw), vec = strides, 64 // itemsize
    rows, pitch = phase_plane(kh, kw, oh, ow, strides, dilations)
    strip = IGEMM_VECTORS * vec
    computed = -(-(oh * pitch) // strip) * strip
    planes = c * (-(-(sh * sw * rows * pitch) // vec) * vec)
    if planes * itemsize > IGEMM_MAX_BYTES:
        return None
    if oh * ow < IGEMM_MIN_USE * computed:
        return "pf_igemmc", c * sh * sw * rows * pitch
    return "pf_igemm", planes + computed + 2 * vec


def pack_weights(w: np.ndarray, panel: int) -> np.ndarray:
    """Conv weights [M, C, KH, KW] as driver.h's implicit GEMMs read them: panels of `panel`
    output channels, [M / panel][C * KH * KW][panel], zero past M."""
    m = w.shape[0]
    panels = -(-m // panel)
    flat = np.zeros((panels * panel, int(np.prod(w.shape[1:]))), w.dtype)
    flat[:m] = w.reshape(m, -1)
    return np.ascontiguousarray(flat.reshape(panels, panel, -1).transpose(0, 2, 1))


def step_name(step) -> str:
    return step.name if isinstance(step, Subgraph) else step.node.name


def add_step(b: RunBuilder, step, plan, fused: tuple | None = None) -> str | None:
    """Append `step` to the run; the reason it cannot run in C, else None. `fused`: (activation,
    subgraph) of a Conv step that applies the subgraph's activation (epilogue.py)."""
    if isinstance(step, Subgraph):
        return add_subgraph(b, step, plan.kernels[step.name])
    if numpy_blas() is None:
        return "numpy's BLAS has no CBLAS entry points"
    if isinstance(step.node.op, MatMul):
        return add_matmul(b, step.node, len(b.names))
    if isinstance(step.node.op, Conv) and step.node.inputs[1] in b.graph.constants and not step.node.op.channels_last:
        act, sub = fused or (None, None)
        return add_conv(b, step.node, len(b.names), act, sub.outputs[0] if sub else None)
    return f"library op {type(step.node.op).__name__} has no C implementation"


def fusable(step, after, graph: BasicGraph, consumers: dict, keep: frozenset) -> tuple | None:
    """(activation, subgraph) where Conv `step` can apply subgraph `after`'s activation."""
    if not (isinstance(after, Subgraph) and not isinstance(step, Subgraph) and isinstance(step.node.op, Conv)):
        return None
    act = conv_activation(step.node, after, graph, consumers, keep)
    return (act, after) if act is not None else None


def render(b: RunBuilder, blas: Blas | None) -> str:
    from powerfusion.backends.cpu.renderer import C_HELPERS   # the inline exp of the activations
    header = C_HELPERS + "\n" + importlib.resources.files("powerfusion.backends.cpu").joinpath("templates/driver.h").read_text()
    body = "\n".join(f"  {line}\n  times[{i + 1}] = pf_now();" for i, line in enumerate(b.lines))
    return "\n".join([
        "// generated by PowerFusion: one run of a model's steps; do not edit",
        f"#define PF_BLASINT {blas.int_type if blas else 'long long'}", header, *b.decls,
        # the kernel entries come with every call, not bound in the library: two runs whose
        # sources are the same text share one cached shared object (dlopen returns the same
        # handle), and a table bound into it would make the first run call the second's kernels
        "void pf_bind(void *sgemm, void *dgemm, void *get_threads, void *set_threads)\n{",
        "  pf_sgemm = (pf_sgemm_fn)sgemm; pf_dgemm = (pf_dgemm_fn)dgemm;",
        "  pf_blas_get_threads = (pf_get_threads_fn)get_threads; pf_blas_set_threads = (pf_set_threads_fn)set_threads;",
        "}",
        "void pf_drive(void **T, double *times, void **fns)\n{",
        "  pf_entry_fn *F = (pf_entry_fn *)fns; (void)F;",
        "  int blas_threads = pf_blas_enter();",
        "  times[0] = pf_now();", body,
        "  pf_blas_leave(blas_threads);", "}", ""])


class Driver:
    """One compiled run of consecutive steps. `run(env)` reads the run's inputs from `env`
    and adds every tensor the run makes to it."""

    def __init__(self, b: RunBuilder, library, blas: Blas | None, keep: frozenset):
        self.names, self.graph = tuple(b.names), b.graph
        self.source_lines = tuple(b.lines)   # each step's C statement, in order
        self._lib = ctypes.CDLL(str(library))
        self._fns = (ctypes.c_void_p * max(1, len(b.entries)))(*b.entries)
        bind = self._lib.pf_bind
        bind.restype, bind.argtypes = None, [ctypes.c_void_p] * 4
        bind(*((blas.sgemm, blas.dgemm, blas.get_threads, blas.set_threads) if blas else (None,) * 4))
        self._fn = self._lib.pf_drive
        self._fn.restype, self._fn.argtypes = None, [ctypes.c_void_p] * 3
        self._table = (ctypes.c_void_p * max(1, len(b.table.arrays)))()
        self._arrays = list(b.table.arrays)
        self.times = np.zeros(len(b.names) + 1)
        tensors = b.graph.tensors
        self._inputs = [(t, b.table.slots[t], dt) for t, dt in b.read.items()]
        self._fresh = [(t, b.table.slots[t], tuple(tensors[t].shape), np.dtype(tensors[t].dtype))
                       for t in sorted(b.made) if t in keep]
        self._views = {}
        for t in b.made - keep:
            a = np.empty(tuple(tensors[t].shape), np.dtype(tensors[t].dtype))
            self._arrays[b.table.slots[t]] = a
            self._views[t] = a
        for k, a in enumerate(self._arrays):
            if a is not None:
                self._table[k] = a.ctypes.data
        self._gathers, self._fused = tuple(b.gathers), tuple(b.fused)

    def run(self, env: dict) -> None:
        if self._gathers:
            check_gathers(self._gathers, env, self.graph.tensors, self._fused)
        held = []   # arrays made here must outlive the call
        table = self._table
        for t, slot, dtype in self._inputs:
            a = env[t]
            if a.dtype != dtype or not a.flags.c_contiguous:
                a = np.asarray(a, dtype=dtype, order="C")
                held.append(a)
            table[slot] = a.ctypes.data
        for t, slot, shape, dtype in self._fresh:
            a = env[t] = np.empty(shape, dtype)
            table[slot] = a.ctypes.data
        self._fn(table, self.times.ctypes.data, self._fns)
        env.update(self._views)

    def step_times(self) -> list[tuple[str, float]]:
        """(step name, seconds) of the last run, as the C clock saw them."""
        return list(zip(self.names, np.diff(self.times).tolist()))


def plan_runs(partition, plan) -> tuple[list, dict[str, str]]:
    """The partition's steps as a list of Drivers (runs of steps in C) and the steps left to
    Python, in order; and why each left step is not in C."""
    graph = partition.graph
    blas = numpy_blas()
    keep = frozenset(t.name for t in graph.outputs)
    pieces, left, builder = [], {}, None
    consumers = graph.consumers()
    steps = list(partition.steps)
    skip = None   # a subgraph whose activation the Conv before it applied
    for i, step in enumerate(steps):
        if step is skip:
            builder.lines.append(f"/* {step_name(step)}: applied by the convolution before it */")
            builder.names.append(step_name(step))
            builder.fused += step.nodes
            continue
        nodes = step.nodes if isinstance(step, Subgraph) else [step.node]
        gathers = [n for n in gather_nodes(nodes) if n.inputs[1] not in graph.constants]
        if builder is not None and any(n.inputs[1] in builder.made for n in gathers):
            pieces.append(builder)   # its indices must be checked between runs
            builder = None
        trial = builder or RunBuilder(graph)
        snapshot = _snapshot(trial)
        fused = fusable(step, steps[i + 1], graph, consumers, keep) if i + 1 < len(steps) else None
        why = add_step(trial, step, plan, fused)
        if why is None:
            skip = fused[1] if fused else None
            trial.names.append(step_name(step))
            trial.gathers += [n for n in gathers if n.inputs[1] not in trial.made]
            trial.fused += nodes if isinstance(step, Subgraph) else []
            builder = trial
            continue
        _restore(trial, snapshot)
        left[step_name(step)] = why
        if builder is not None:
            pieces.append(builder)
            builder = None
        pieces.append(step)
    if builder is not None:
        pieces.append(builder)
    return _compile(pieces, blas, keep), left


def _snapshot(b: RunBuilder) -> tuple:
    return (dict(b.table.slots), len(b.table.arrays), len(b.lines), len(b.decls), len(b.entries),
            set(b.made), dict(b.read))


def _restore(b: RunBuilder, snap: tuple) -> None:
    slots, arrays, lines, decls, entries, made, read = snap
    b.table.slots = slots
    del b.table.arrays[arrays:], b.lines[lines:], b.decls[decls:], b.entries[entries:]
    b.made, b.read = made, read


def _compile(pieces: list, blas: Blas | None, keep: frozenset) -> list:
    from powerfusion.backends.cpu.toolchain import shared_objects
    runs = [p for p in pieces if isinstance(p, RunBuilder)]
    libraries = dict(zip(map(id, runs), shared_objects([render(r, blas) for r in runs])))
    return [Driver(p, libraries[id(p)], blas, keep) if isinstance(p, RunBuilder) else p for p in pieces]
