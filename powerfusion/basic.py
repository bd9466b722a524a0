"""The frontend's output: a graph of *basic ops* with static shapes.

Every supported ONNX op is decomposed into these kinds (docs/design.md):
elementwise, broadcast, reduce, moves (transpose, reshape, concat, slice, pad,
gather, window) and library ops (matmul, conv, typed low-precision matmul).
Broadcasting is always explicit:
an Elementwise node's inputs all have its output's shape (a Broadcast node is
inserted where ONNX broadcasts implicitly). Each op's arguments live in a small
frozen dataclass; adding a kind touches this file and the converters only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import numpy as np


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype  # numpy dtype; bfloat16 is ml_dtypes.bfloat16

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


# ---- op arguments ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Elementwise:
    """out = fn(*inputs); all inputs have the output's shape. fn names powerfusion.scalar.SCALAR_FNS."""
    fn: str
    params: tuple[tuple[str, object], ...] = ()  # e.g. (("alpha", 0.01),) or (("to", np.dtype("float16")),)

    def param(self, name: str):
        return dict(self.params)[name]


@dataclass(frozen=True, slots=True)
class Broadcast:
    """numpy.broadcast_to(input, shape) (input rank may be lower, as in numpy)."""
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reduce:
    """fn in sum | max | min | prod over `axes` (sorted, non-negative)."""
    fn: str
    axes: tuple[int, ...]
    keepdims: bool


@dataclass(frozen=True, slots=True)
class Transpose:
    perm: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reshape:
    """Free: a new shape over the same row-major data."""
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Concat:
    axis: int  # non-negative


@dataclass(frozen=True, slots=True)
class Slice:
    """out = input[tuple(slice(b, e, s) for b, e, s in zip(starts, stops, steps))],
    one entry per axis, already clamped; stops may be negative-sentinel None for reversed slices."""
    starts: tuple[int, ...]
    stops: tuple[int | None, ...]
    steps: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Pad:
    """numpy.pad(input, list(zip(begins, ends)), mode) with constant `value` for mode 'constant'.
    Negative pads crop."""
    begins: tuple[int, ...]
    ends: tuple[int, ...]
    mode: str = "constant"  # constant | edge | reflect
    value: float = 0.0


@dataclass(frozen=True, slots=True)
class Gather:
    """numpy.take(data, indices, axis) with negative indices wrapped; inputs (data, indices)."""
    axis: int


@dataclass(frozen=True, slots=True)
class GatherElements:
    """numpy.take_along_axis(data, indices, axis) with negative indices wrapped; inputs (data, indices),
    output shaped like indices (ONNX GatherElements)."""
    axis: int


@dataclass(frozen=True, slots=True)
class Window:
    """Sliding windows for pooling and depthwise conv: input [N, C, *S] ->
    output [N, C, *O, *K], out[n, c, o.., k..] = padded[n, c, o*stride + k*dilation - pad_begin]
    where positions outside the input read `pad_value`. channels_last: input [N, *S, C] ->
    output [N, *O, *K, C], the same windows (frontend/layout.py)."""
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pad_begins: tuple[int, ...]
    pad_ends: tuple[int, ...]
    pad_value: float = 0.0
    channels_last: bool = False


@dataclass(frozen=True, slots=True)
class Involution:
    """RedNet's involution (Li et al. 2021): a K x K kernel per output position and channel group.
    Inputs (X [N, C, H, W], Wt [N, G, KH*KW, OH, OW]); out[n, c, oh, ow] =
    sum_k padded(X)[n, c, oh*sh + kh*dh - ph, ow*sw + kw*dw - pw] * Wt[n, c // (C // G), k, oh, ow],
    k = kh*KW + kw, positions outside X reading 0 (frontend/window_stack.py makes it)."""
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pad_begins: tuple[int, int]
    pad_ends: tuple[int, int]


@dataclass(frozen=True, slots=True)
class MatMul:
    """numpy.matmul(A', B') with A' = swapaxes(A, -1, -2) if trans_a, likewise B; batch dims broadcast.
    bias: a third input, a vector over the result's last axis, added before the one rounding to
    the result's type (a GEMM epilogue; made by frontend/gemm_bias.py for CUDA graphs only)."""
    trans_a: bool = False
    trans_b: bool = False
    bias: bool = False


@dataclass(frozen=True, slots=True)
class Conv:
    """ONNX Conv, inputs (X, W[, B]); pads as explicit begins/ends per spatial axis.
    channels_last: X is [N, *S, C], W is [M, *K, C/group] and the output [N, *S', M] (the same
    convolution on transposed tensors, frontend/layout.py)."""
    strides: tuple[int, ...]
    pad_begins: tuple[int, ...]
    pad_ends: tuple[int, ...]
    dilations: tuple[int, ...]
    group: int
    channels_last: bool = False


@dataclass(frozen=True, slots=True)
class TypedMatMul:
    """Y[..., N] = A[..., K] @ dequant(W)[K, N] (+ bias), W a constant held in `bits`-bit integers
    with scales (and zero points): a typed low-precision GEMM (powerfusion.ttile), always a library
    call. Inputs (A, *constants); constant i was input `slots[i]` of the source ONNX node, so that
    node can be rebuilt from `source`, `attrs` and the constants (frontend/quantized.py).
    source: "MatMulNBits" (com.microsoft; slots among B, scales, zero_points, bias) or
    "DequantizeLinear" (a DequantizeLinear on a constant feeding MatMul's B; slots among x, x_scale,
    x_zero_point)."""
    source: str
    bits: int
    block_size: int   # K elements per scale; K itself when there is one scale per output column
    K: int
    N: int
    attrs: tuple[tuple[str, object], ...]   # the source node's ONNX attributes
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Attention:
    """softmax(Q @ K^T * scale + bias) @ V, inputs (Q, K, V[, bias]): Q [..., Sq, D], K [..., Skv, D],
    V [..., Skv, Dv] with equal leading dims, bias broadcasting to [..., Sq, Skv]; the products and
    the softmax in float32, the probabilities rounded to Q's type before the second product (as
    in the decomposed graph it replaces). Always a library call. Made only by
    frontend/attention.py, on CUDA: fp16 / bf16 graphs, where cuDNN runs it fused, and decode
    steps (at most 8 query rows, also float32), which the split-KV kernel runs
    (backends/cuda/decode_attention.py; the probabilities stay float32 there).
    nan_to_zero: probabilities that are NaN (a row whose scores are all -inf) become 0, as the
    exporters' guard where(isnan(p), 0, p) has them. out_perm: the output is the result
    transposed by it (rank 4, the head size staying last: heads merged back, [B, S, H, Dv]),
    written so directly (cuDNN's output strides), () for none; out_shape: then reshaped to it
    (the same bytes: [B * S, H * Dv]), () for none. in_perms: one permutation per Q, K, V (()
    for none): that operand is its stored tensor, viewed with leading 1s to rank 4, transposed
    by it (heads split in the stored layout [B, S, H, D], read through cuDNN's strides).
    in_views: one (offset, shape, strides) per Q, K, V, in elements of its stored tensor (() for
    none; it replaces that operand's in_perm): the operand is a strided view of the stored tensor,
    e.g. one third of a fused QKV projection's result, heads split (frontend/attention.py).
    kv_tail: rows appended to the keys and values (a decode step's new token after its KV cache):
    inputs (Q, K, V, K_tail, V_tail), the keys cat(K, K_tail) and the values cat(V, V_tail) along
    the row axis, never materialised (frontend/kv_append.py; no bias, perm or view then); 0 for none."""
    scale: float
    nan_to_zero: bool = False
    out_perm: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    in_perms: tuple[tuple[int, ...], ...] = ()
    in_views: tuple[tuple, ...] = ()
    kv_tail: int = 0


def attention_bias(op: Attention, stored):
    """The bias input of an Attention (stored inputs as attention_operands takes them), or None."""
    return stored[3] if len(stored) > 3 and not op.kv_tail else None


def attention_operands(op: Attention, stored):
    """Q, K, V of an Attention from its stored inputs (numpy or CuPy arrays): each the strided view
    its in_view names, else transposed by its in_perm, viewed with leading 1s to that rank first;
    with a kv_tail, K and V joined with their tails (stored: Q, K, V, K_tail, V_tail)."""
    out = []
    for k, x in enumerate(stored[:3]):
        view = op.in_views[k] if op.in_views else ()
        if view:
            out.append(strided_view(x, *view))
            continue
        perm = op.in_perms[k] if op.in_perms else ()
        if perm:
            x = x.reshape((1,) * (len(perm) - x.ndim) + tuple(x.shape)).transpose(perm)
        out.append(x)
    if op.kv_tail:   # K and V are stored whole (frontend/kv_append.py): the tails follow their rows
        if isinstance(out[1], np.ndarray):
            concatenate = np.concatenate
        else:
            from cupy import concatenate   # CuPy arrays (the CUDA session's stand-in path)
        out[1] = concatenate([out[1], stored[3]], axis=-2)
        out[2] = concatenate([out[2], stored[4]], axis=-2)
    return out


def plain_view(view: tuple, stored_shape) -> bool:
    """True where an in_view (offset, shape, strides) reads its whole stored tensor in memory
    order (offset 0, row-major strides over the axes longer than 1): the same bytes, unpermuted."""
    if not view:
        return True
    offset, shape, strides = view
    if int(offset) or int(np.prod(shape, dtype=np.int64)) != int(np.prod(stored_shape, dtype=np.int64)):
        return False
    want = 1
    for d, s in reversed([(int(d), int(s)) for d, s in zip(shape, strides)]):
        if d != 1 and s != want:
            return False
        want *= d
    return True


def strided_view(x, offset: int, shape, strides):
    """The view of contiguous `x` (numpy or CuPy) starting at element `offset` with these shape
    and strides (in elements); bounds were checked where the view was made."""
    flat = x.reshape(-1)[int(offset):]
    shape = tuple(int(d) for d in shape)
    strides = tuple(int(s) * flat.dtype.itemsize for s in strides)
    if isinstance(flat, np.ndarray):
        return np.lib.stride_tricks.as_strided(flat, shape, strides, writeable=False)
    from cupy.lib.stride_tricks import as_strided   # a CuPy array (the CUDA session)
    return as_strided(flat, shape, strides)


@dataclass(frozen=True, slots=True)
class OnnxFallback:
    """An ONNX node the frontend does not convert, run as it is by onnxruntime on the CPU
    (option fallback='onnxruntime'); always a library step. Inputs are the node's inputs
    (absent optional ones left out, `slots` says which they were); the output is the node's
    output number `output` (one basic node per used output). frontend/fallback.py runs it."""
    op_type: str
    node: bytes              # the serialized onnx.NodeProto
    opset: int
    slots: tuple[int, ...]   # node input index of each basic input
    output: int


OpArgs = Union[Elementwise, Broadcast, Reduce, Transpose, Reshape, Concat, Slice, Pad, Gather,
               GatherElements, Window, Involution, MatMul, Conv, TypedMatMul, Attention, OnnxFallback]
MOVE_OPS = (Transpose, Reshape, Concat, Slice, Pad, Gather, GatherElements, Window)
LIBRARY_OPS = (MatMul, Conv, TypedMatMul, Attention, OnnxFallback)


def kind_of(op: OpArgs) -> str:
    """'elementwise' | 'broadcast' | 'reduce' | 'move' | 'library'."""
    if isinstance(op, Elementwise):
        return "elementwise"
    if isinstance(op, Broadcast):
        return "broadcast"
    if isinstance(op, (Reduce, Involution)):   # a weighted sum over each window
        return "reduce"
    if isinstance(op, MOVE_OPS):
        return "move"
    return "library"


@dataclass(frozen=True, slots=True)
class Origin:
    """The ONNX node a basic op came from, for error messages and per-subgraph reports."""
    node: str
    op_type: str
    opset: int


@dataclass(frozen=True, slots=True)
class BasicNode:
    name: str                 # unique in the graph
    op: OpArgs
    inputs: tuple[str, ...]   # tensor names
    outputs: tuple[str, ...]  # one output, except where an op says otherwise
    origin: Origin

    @property
    def kind(self) -> str:
        return kind_of(self.op)


@dataclass
class BasicGraph:
    """Topologically ordered basic ops over named tensors with static shapes."""
    name: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    tensors: dict[str, TensorInfo]
    constants: dict[str, np.ndarray]
    nodes: list[BasicNode]
    opset: int = 17
    metadata: dict = field(default_factory=dict)

    def producer(self) -> dict[str, BasicNode]:
        return {t: n for n in self.nodes for t in n.outputs}

    def consumers(self) -> dict[str, list[BasicNode]]:
        out: dict[str, list[BasicNode]] = {}
        for n in self.nodes:
            for t in n.inputs:
                out.setdefault(t, []).append(n)
        return out

    def drop_unread(self) -> None:
        """Remove the nodes whose outputs nothing reads (after a rewrite), and the constants and
        tensors no remaining node or graph input/output names; one sweep from the outputs back."""
        live, keep = {t.name for t in self.outputs}, []
        for n in reversed(self.nodes):
            if any(o in live for o in n.outputs):
                keep.append(n)
                live.update(n.inputs)
        self.nodes[:] = keep[::-1]
        used = live | {t.name for t in self.inputs}
        for name in [c for c in self.constants if c not in used]:
            del self.constants[name]
        for name in [t for t in self.tensors if t not in used]:
            del self.tensors[name]


# ---- partition ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LibraryCall:
    """A compute-bound op sent to a vendor library (or a typed GEMM)."""
    node: BasicNode
    flops: int
    bytes: int  # compulsory: inputs read once, output written once

    @property
    def intensity(self) -> float:
        return self.flops / max(self.bytes, 1)


@dataclass(frozen=True, slots=True)
class Subgraph:
    """A maximal connected group of memory-bound basic ops, acyclic once contracted."""
    name: str                      # sanitised-safe identifier, e.g. "sg3"
    nodes: tuple[BasicNode, ...]   # topological order
    inputs: tuple[str, ...]        # tensors read from outside (graph inputs, constants, other steps)
    outputs: tuple[str, ...]       # tensors used outside or graph outputs
    flops: int
    bytes: int                     # compulsory bytes: each input read once + each output written once

    @property
    def intensity(self) -> float:
        return self.flops / max(self.bytes, 1)


@dataclass
class Partition:
    graph: BasicGraph
    target: str
    steps: list  # Subgraph | LibraryCall, in an executable (topological) order

    @property
    def subgraphs(self) -> list[Subgraph]:
        return [s for s in self.steps if isinstance(s, Subgraph)]

    @property
    def library_calls(self) -> list[LibraryCall]:
        return [s for s in self.steps if isinstance(s, LibraryCall)]
