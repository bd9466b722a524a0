"""Emitting basic ops: a graph builder, and the per-ONNX-node context converters use.

Converters call `cx.ew("add", a, b, out=cx.out())` and friends; implicit ONNX
broadcasting becomes explicit Broadcast nodes here, in one place.
"""
from __future__ import annotations

import numpy as np
import onnx

from powerfusion.errors import NodeError
from powerfusion.basic import (BasicNode, Broadcast, Elementwise, OpArgs, Origin, Reduce, Reshape,
                                        TensorInfo, Transpose)
from powerfusion.frontend.numpy_exec import EXECUTORS
from powerfusion.scalar import scalar_fn


class GraphBuilder:
    def __init__(self, reserved: set[str]):
        self.tensors: dict[str, TensorInfo] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.nodes: list[BasicNode] = []
        self._reserved = set(reserved)
        self._fresh: set[str] = set()
        self._counter = 0

    def fresh(self, hint: str) -> str:
        while True:
            self._counter += 1
            name = f"{hint}_{self._counter}"
            if name not in self._reserved and name not in self.tensors:
                self._reserved.add(name)
                self._fresh.add(name)
                return name

    def rename_last_output(self, old: str, new: str) -> bool:
        """Give the last node's fresh output the ONNX name instead (saves an aliasing node)."""
        if not self.nodes or self.nodes[-1].outputs != (old,) or old not in self._fresh or new in self.tensors:
            return False
        last = self.nodes.pop()
        info = self.tensors.pop(old)
        self.tensors[new] = TensorInfo(new, info.shape, info.dtype)
        self.nodes.append(BasicNode(last.name, last.op, last.inputs, (new,), last.origin))
        return True

    def constant(self, value: np.ndarray, name: str | None = None, hint: str = "const") -> str:
        value = np.asarray(value)
        name = name or self.fresh(hint)
        self.constants[name] = value
        self.tensors[name] = TensorInfo(name, tuple(value.shape), value.dtype)
        return name

    def emit(self, op: OpArgs, inputs, shape, dtype, origin: Origin, out: str | None = None) -> str:
        out = out or self.fresh(f"{origin.op_type.lower()}")
        info = TensorInfo(out, tuple(int(d) for d in shape), np.dtype(dtype))
        if info.size == 0:   # an empty tensor is a constant: nothing to compute
            return self.constant(np.empty(info.shape, dtype=info.dtype), name=out)
        if self._foldable(op, inputs, info):
            value = EXECUTORS[type(op)](op, [self.constants[i] for i in inputs], info.dtype)
            return self.constant(np.asarray(value).astype(info.dtype).reshape(info.shape), name=out)
        self.tensors[out] = info
        self.nodes.append(BasicNode(f"n{len(self.nodes)}", op, tuple(inputs), (out,), origin))
        return out


    def _foldable(self, op, inputs, out: TensorInfo) -> bool:
        """Ops on constants only (a cast weight, a reshaped scale) become constants, unless that
        would materialise a larger tensor than they read (a broadcast scalar stays a Broadcast)."""
        if not inputs or isinstance(op, Broadcast) or not all(i in self.constants for i in inputs):
            return False
        return out.nbytes <= 2 * sum(self.tensors[i].nbytes for i in inputs) + 4096


class NodeCtx:
    """One ONNX node being converted: its attributes, input facts, and emit helpers."""

    def __init__(self, node: onnx.NodeProto, opset: int, builder: GraphBuilder, consts: dict,
                 infos: dict[str, TensorInfo], index: int):
        self.node, self.opset, self.b = node, opset, builder
        self._consts, self._infos = consts, infos
        self.attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        self.origin = Origin(node.name or f"{node.op_type}_{index}", node.op_type, opset)
        # converters whose shape rule knowingly differs from onnx shape inference turn this off
        self.check_shapes = True

    # ---- facts about the ONNX node ----
    @property
    def op_type(self) -> str:
        return self.node.op_type

    def attr(self, name, default=None):
        v = self.attrs.get(name, default)
        return v.decode() if isinstance(v, bytes) else v

    def has(self, i: int) -> bool:
        return i < len(self.node.input) and self.node.input[i] != ""

    def n_in(self) -> int:
        return len(self.node.input)

    def inferred(self, name: str) -> TensorInfo | None:
        """What shape inference says about an ONNX tensor (None if nothing static)."""
        return self._infos.get(name) if name else None

    def info(self, name: str) -> TensorInfo:
        if name in self.b.tensors:
            return self.b.tensors[name]
        if name in self._infos:
            return self._infos[name]
        self.fail(f"tensor '{name}' has no static shape after shape inference")

    def shape(self, i: int | str) -> tuple[int, ...]:
        return self.info(self.node.input[i] if isinstance(i, int) else i).shape

    def dtype(self, i: int | str) -> np.dtype:
        return np.dtype(self.info(self.node.input[i] if isinstance(i, int) else i).dtype)

    def const(self, i: int) -> np.ndarray | None:
        return self._consts.get(self.node.input[i]) if self.has(i) else None

    def const_ints(self, i: int, what: str) -> list[int] | None:
        """A constant integer input (axes, pads, shape...) as a list, or None if absent."""
        if not self.has(i):
            return None
        v = self.const(i)
        if v is None:
            self.fail(f"input {i} ({what}) must be a constant; it is computed at run time")
        return [int(x) for x in np.asarray(v).reshape(-1)]

    def inp(self, i: int) -> str:
        """Tensor name of input i, registering it as a basic-graph constant if it is one."""
        name = self.node.input[i]
        if name in self._consts and name not in self.b.constants:
            self.b.constant(self._consts[name], name=name)
        return name

    def out(self, i: int = 0) -> str | None:
        return self.node.output[i] if i < len(self.node.output) and self.node.output[i] else None

    def out_info(self, i: int = 0) -> TensorInfo | None:
        return self._infos.get(self.out(i)) if self.out(i) else None

    def input_shapes(self):
        return [self.info(n).shape if n and (n in self.b.tensors or n in self._infos) else None for n in self.node.input]

    def fail(self, message: str):
        raise NodeError(self.origin.node, self.op_type, self.opset, self.input_shapes(), message)

    def axis(self, a: int, rank: int) -> int:
        if not -rank <= a < max(rank, 1):
            self.fail(f"axis {a} is out of range for rank {rank}")
        return a % rank if rank else 0

    # ---- emit helpers ----
    def emit(self, op: OpArgs, inputs, shape, dtype, out: str | None = None) -> str:
        if out is not None and self.check_shapes:
            expect = self._infos.get(out)
            if expect is not None and tuple(expect.shape) != tuple(shape):
                self.fail(f"converted output '{out}' has shape {tuple(shape)}, shape inference says {expect.shape}")
        return self.b.emit(op, inputs, shape, dtype, self.origin, out)

    def scalar(self, value, dtype) -> str:
        return self.b.constant(np.asarray(value, dtype=dtype), hint="scalar")

    def bcast(self, name: str, shape) -> str:
        if self.info(name).shape == tuple(shape):
            return name
        return self.emit(Broadcast(tuple(shape)), [name], shape, self.info(name).dtype)

    def ew(self, fn: str, *names: str, out: str | None = None, params=(), dtype=None) -> str:
        """Elementwise fn with ONNX (numpy) broadcasting made explicit."""
        try:
            shape = np.broadcast_shapes(*(self.info(n).shape for n in names))
        except ValueError:
            self.fail(f"inputs of shapes {[self.info(n).shape for n in names]} do not broadcast")
        ins = [self.bcast(n, shape) for n in names]
        if dtype is None:
            kind = scalar_fn(fn).result
            if kind == "bool":
                dtype = np.dtype(bool)
            elif kind == "param:to":
                dtype = dict(params)["to"]
            else:
                dtype = self.info(names[-1] if fn == "where" else names[0]).dtype
        return self.emit(Elementwise(fn, tuple(params)), ins, shape, dtype, out)

    def reduce(self, fn: str, name: str, axes, keepdims: bool, out: str | None = None) -> str:
        shape = self.info(name).shape
        axes = tuple(sorted({a % len(shape) for a in axes})) if shape else ()
        if keepdims:
            oshape = tuple(1 if i in axes else d for i, d in enumerate(shape))
        else:
            oshape = tuple(d for i, d in enumerate(shape) if i not in axes)
        return self.emit(Reduce(fn, axes, keepdims), [name], oshape, self.info(name).dtype, out)

    def reshape(self, name: str, shape, out: str | None = None) -> str:
        shape = tuple(int(d) for d in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.info(name).size:
            self.fail(f"cannot reshape {self.info(name).shape} to {shape}")
        if out is None and shape == self.info(name).shape:
            return name
        return self.emit(Reshape(shape), [name], shape, self.info(name).dtype, out)

    def transpose(self, name: str, perm, out: str | None = None) -> str:
        shape = self.info(name).shape
        if sorted(perm) != list(range(len(shape))):
            self.fail(f"perm {list(perm)} is not a permutation of the {len(shape)} axes of {shape}")
        moved = [p for p in perm if shape[p] != 1]
        if moved == sorted(moved):   # only extent-1 axes move: the same bytes in the same order
            return self.reshape(name, tuple(shape[p] for p in perm), out=out)
        return self.emit(Transpose(tuple(perm)), [name], tuple(shape[p] for p in perm), self.info(name).dtype, out)

    def alias(self, name: str, out: str) -> str:
        """Bind an existing tensor to an ONNX output name (a free same-shape Reshape if need be)."""
        expect = self._infos.get(out)
        if (expect is None or expect.shape == self.info(name).shape) and self.b.rename_last_output(name, out):
            return out
        return self.reshape(name, self.info(name).shape, out=out)

    def cast(self, name: str, dtype, out: str | None = None) -> str:
        dtype = np.dtype(dtype)
        if out is None and self.info(name).dtype == dtype:
            return name
        return self.ew("cast", name, out=out, params=(("to", dtype),))
