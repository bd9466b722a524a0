"""Fused attention (basic.Attention, made by frontend/attention.py) through cuDNN's scaled dot
product attention, by NVIDIA's Python frontend (the same `cudnn` module as cudnn_conv.py).

cuDNN's SDPA is flash attention: the scores and probabilities stay on chip, in float32, and the
probabilities are rounded to the operands' type for the second product, as in the decomposed
graph. Each Attention step gets a graph built for its exact shapes when the session is built
(`plan_attention`), or the reason it runs on the stand-in instead (library.attention: two
cuBLAS products and a CuPy softmax, outside CUDA-graph capture). Execution is one
`cudnnBackendExecute` on the handle's stream with the session's planned workspace.

What goes to cuDNN: fp16 / bf16, head sizes that are multiples of 8 up to 128, a bias (if any)
that is one [Sq, Skv] matrix, one per batch x head, or (rank 4) one per batch or per head
broadcast over the other. Probabilities cuDNN cannot zero the way
the exporters' guard where(isnan(p), 0, p) does (`nan_to_zero`: a row whose scores are all
-inf) only arise from such a bias row or from NaN / inf inputs: with `nan_to_zero` the bias must
be a constant with a finite entry in every row, and the NaN-input case differs (cuDNN: NaN,
the guard: 0; docs/cuda-conv.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerfusion.backends.cuda import cudnn_conv

_DTYPES = {"float16": "HALF", "bfloat16": "BFLOAT16"}
MAX_HEAD = 128


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention as cuDNN sees it: Q [B, H, Sq, D], K [B, H, Skv, D], V [B, H, Skv, Dv],
    the bias [Bb, Hb, Sq, Skv] (Bb, Hb: 1 or B, H) or None; row-major."""
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    bias: tuple[int, ...] | None
    dtype: str
    scale: float
    out_perm: tuple[int, ...] = ()   # the output is stored transposed by it (basic.Attention)
    strides: tuple[tuple[int, ...], ...] = ()   # of Q, K, V where their heads are split in storage
    offsets: tuple[int, ...] = (0, 0, 0)   # elements from each stored Q, K, V to its first element

    @property
    def out(self) -> tuple[int, ...]:
        return self.q[:-1] + (self.v[-1],)


def _as_4d(shape) -> tuple[int, ...]:
    """[..., S, D] as [1, prod(...), S, D] (rank 4 stays)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 4:
        return shape
    return (1, int(np.prod(shape[:-2], dtype=np.int64)), *shape[-2:])


def attention_shape(graph, node) -> tuple[AttentionShape | None, str]:
    """(the shape, "") or (None, why cuDNN is not asked)."""
    t = graph.tensors
    if getattr(node.op, "kv_tail", 0):
        return None, "keys and values with appended rows (basic.Attention.kv_tail: the split-KV kernel's)"
    dtype = np.dtype(t[node.inputs[0]].dtype).name
    if dtype not in _DTYPES:
        return None, f"dtype {dtype} (cuDNN's attention is used for fp16 and bf16)"
    operands = [_operand(t[n].shape, node.op.in_perms[i] if node.op.in_perms else (),
                         node.op.in_views[i] if node.op.in_views else ())
                for i, n in enumerate(node.inputs[:3])]
    if any(len(d) != 4 for d, _ in operands):
        return None, "a strided operand of rank other than 4"
    (q, qs), (k, ks), (v, vs) = operands
    if not all(d % 8 == 0 and d <= MAX_HEAD for d in (q[-1], v[-1])):
        return None, f"head sizes {q[-1]}, {v[-1]} (cuDNN: multiples of 8 up to {MAX_HEAD})"
    bias = None
    if len(node.inputs) > 3:
        b = tuple(t[node.inputs[3]].shape)
        lead = _as_4d(q)[:2]
        b = (1,) * (len(q) - len(b)) + b
        if b[-2:] != (q[-2], k[-2]):
            return None, f"bias of shape {t[node.inputs[3]].shape} broadcast over rows (cuDNN wants [Sq, Skv] planes)"
        blead = int(np.prod(b[:-2], dtype=np.int64))
        if len(b) == 4 and len(q) == 4 and all(d in (1, e) for d, e in zip(b[:2], q[:2])):
            bias = b   # [1 or B, 1 or H, Sq, Skv]: cuDNN broadcasts the unit axes (a padding
            # mask per sequence, BERT's [B, 1, S, S]; a relative-position bias per head, Swin's)
        elif blead not in (1, lead[0] * lead[1]) or (blead != 1 and tuple(b[:-2]) != tuple(q[:-2])):
            return None, f"bias of shape {t[node.inputs[3]].shape} broadcast over some leading axes only"
        else:
            bias = (1, 1, *b[-2:]) if blead == 1 else _as_4d(b)
    perm = tuple(node.op.out_perm)
    if perm and len(q) != 4:
        return None, f"an output transpose of a rank-{len(q)} attention"
    offsets = tuple(int(view[0]) if view else 0 for view in (node.op.in_views or ((),) * 3))
    return AttentionShape(q, k, v, bias, dtype, float(node.op.scale), perm, (qs, ks, vs), offsets), ""


def _operand(shape, perm, view=()) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dims [B, H, S, D], strides) of an operand stored as `shape`: the strided view `view`
    (basic.Attention.in_views; a unit axis gets the stride of a packed one), else transposed by
    `perm` (the stored tensor viewed with leading 1s to rank 4 first; no perm: row-major)."""
    if view:
        _, dims, strides = view
        dims, strides = tuple(int(d) for d in dims), [int(x) for x in strides]
        span = max(d * x for d, x in zip(dims, strides) if d > 1) if any(d > 1 for d in dims) else 1
        return dims, tuple(x if d > 1 else span for d, x in zip(dims, strides))
    if not perm:
        dims = _as_4d(shape)
        return dims, tuple(cudnn_conv._row_major(dims))
    view = (1,) * (len(perm) - len(shape)) + tuple(int(d) for d in shape)
    row = cudnn_conv._row_major(view)
    return tuple(view[a] for a in perm), tuple(row[a] for a in perm)


class CudnnAttention:
    """One attention's cuDNN graph with its execution plan, built once; `__call__` enqueues it
    on the handle's stream (bound by `bind`)."""

    def __init__(self, shape: AttentionShape, device_id: int):
        self.shape, self.device_id = shape, device_id
        self.handle = cudnn_conv.handle(device_id)
        with cudnn_conv._LOCK:
            self.graph, self.tensors = _graph(shape, self.handle)
        self.workspace_bytes = int(self.graph.get_workspace_size())

    def bind(self, stream_ptr: int) -> None:
        cudnn_conv.bind_stream(self.handle, stream_ptr)

    def __call__(self, q, k, v, bias, out, workspace) -> None:
        tq, tk, tv, tb, to = self.tensors
        oq, ok, ov = (off * x.dtype.itemsize for off, x in zip(self.shape.offsets, (q, k, v)))
        pack = {tq: q.data.ptr + oq, tk: k.data.ptr + ok, tv: v.data.ptr + ov, to: out.data.ptr}
        if tb is not None:
            pack[tb] = bias.data.ptr
        self.graph.execute(pack, workspace.data.ptr if workspace is not None else 0, handle=self.handle)


def _graph(s: AttentionShape, handle_: int):
    cudnn, _ = cudnn_conv.load()
    io = getattr(cudnn.data_type, _DTYPES[s.dtype])
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle_)
    row = cudnn_conv._row_major
    qs, ks, vs = s.strides or (row(s.q), row(s.k), row(s.v))
    q = g.tensor(name="Q", dim=list(s.q), stride=list(qs), data_type=io)
    k = g.tensor(name="K", dim=list(s.k), stride=list(ks), data_type=io)
    v = g.tensor(name="V", dim=list(s.v), stride=list(vs), data_type=io)
    b = None
    if s.bias is not None:
        b = g.tensor(name="Bias", dim=list(s.bias), stride=row(s.bias), data_type=io)
    o, _ = g.sdpa(name="attention", q=q, k=k, v=v, attn_scale=s.scale, bias=b, generate_stats=False)
    o.set_output(True).set_dim(list(s.out)).set_stride(_out_strides(s)).set_data_type(io)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, (q, k, v, b, o)


def _out_strides(s: AttentionShape) -> list[int]:
    """Strides of the [B, H, Sq, Dv] result in the memory of its transpose by out_perm."""
    if not s.out_perm:
        return cudnn_conv._row_major(s.out)
    stored = [s.out[a] for a in s.out_perm]
    row = cudnn_conv._row_major(stored)
    return [row[s.out_perm.index(a)] for a in range(4)]


def _guard_reason(graph, node) -> str:
    """Why cuDNN cannot reproduce where(isnan(p), 0, p) here ("" where it can)."""
    if not node.op.nan_to_zero or len(node.inputs) < 4:
        return ""
    bias = graph.constants.get(node.inputs[3])
    if bias is None:
        return "a NaN guard over a bias computed at run time (a row could be all -inf)"
    b = np.asarray(bias, np.float32)
    if not np.isfinite(b.reshape(-1, b.shape[-1]) if b.ndim else b.reshape(1, 1)).any(axis=-1).all():
        return "a NaN guard over a bias with an all -inf row"
    return ""


def plan_attention(graph, nodes, device_id: int = 0) -> tuple[dict[str, CudnnAttention], dict[str, str]]:
    """Each Attention node's route, chosen once: ({node: its cuDNN graph}, {node: why it runs on
    library.attention instead})."""
    nodes = list(nodes)
    why = cudnn_conv.load()[1] if nodes else ""
    routes, fallbacks = {}, {}
    for node in nodes:
        shape, reason = attention_shape(graph, node)
        reason = why or reason or _guard_reason(graph, node)
        if not reason:
            try:
                routes[node.name] = CudnnAttention(shape, device_id)
                continue
            except Exception as e:   # no engine for this graph here
                reason = f"no cuDNN engine ({type(e).__name__}: {str(e).strip()[:200]})"
        fallbacks[node.name] = f"Attention through cuBLAS + CuPy (not captured): {reason}"
    return routes, fallbacks
