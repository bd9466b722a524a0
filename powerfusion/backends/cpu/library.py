"""Library ops of the cpu target on the per-step path (steps the whole-model driver of
driver.py leaves to Python, or every step without it): MatMul/Gemm through numpy's BLAS,
Conv as im2col + GEMM (1x1 convolutions as a plain GEMM, depthwise ones directly), buffers
planned once.

Each library step gets a runner at session creation that holds its output array, its padded
input and its im2col matrix; a run copies into those and calls the BLAS with `out=`. The BLAS
runs on one thread and a large GEMM is split by output rows over a pool of `threads` Python
threads (numpy releases the GIL in matmul): OpenBLAS's own threads wait for each other at
every step, which on a 2-core machine shared with other processes made one 14x14x256 3x3
convolution 28 ms instead of 8 ms (threadpoolctl sets the BLAS to one thread per run and
restores it afterwards). Half types accumulate in float32, as in the reference.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from powerfusion.basic import Conv, MatMul

SPLIT_MIN_FLOPS = 4e6   # below this a GEMM runs on the calling thread alone (a hand-off costs ~50 us)


@cache
def _blas():
    from threadpoolctl import ThreadpoolController
    return ThreadpoolController().select(user_api="blas")


def blas_on_one_thread():
    """A context in which the BLAS runs single-threaded (about 25 us to enter and leave)."""
    return _blas().limit(limits=1)


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, threads() - 1), thread_name_prefix="pf-gemm")


@cache
def threads() -> int:
    """OMP_NUM_THREADS if set, else the cores this process may use (read once)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[..., M, N] = a[..., M, K] @ b[..., K, N], split by rows of M over the pool."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    parts = min(threads(), m)
    if parts < 2 or 2.0 * m * n * k * max(1, a.size // (m * k)) < SPLIT_MIN_FLOPS:
        return np.matmul(a, b, out=out)
    edges = np.linspace(0, m, parts + 1).astype(int)
    futures = [_pool().submit(np.matmul, a[..., lo:hi, :], b, out=out[..., lo:hi, :])
               for lo, hi in zip(edges[1:-1], edges[2:])]
    np.matmul(a[..., :edges[1], :], b, out=out[..., :edges[1], :])
    for f in futures:
        f.result()
    return out


@dataclass
class MatMulRunner:
    op: MatMul
    out: np.ndarray
    checked: set = field(default_factory=set)   # operand shapes seen to give `out`'s shape

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a = np.swapaxes(a, -1, -2) if self.op.trans_a else a
        b = np.swapaxes(b, -1, -2) if self.op.trans_b else b
        if (a.shape, b.shape) not in self.checked:
            if a.ndim == 1 or b.ndim == 1 or self.out.dtype != a.dtype or \
                    np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]) != self.out.shape:
                return np.matmul(a, b)
            self.checked.add((a.shape, b.shape))
        return gemm(a, b, self.out)


@dataclass
class ConvRunner:
    """One Conv with its buffers: padded input, im2col matrix, output."""
    op: Conv
    x_shape: tuple
    w: np.ndarray
    out: np.ndarray
    padded: np.ndarray | None = None
    cols: np.ndarray | None = None
    taps: list = field(default_factory=list)
    term: np.ndarray | None = None   # depthwise: one tap's products

    def __call__(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        op, g = self.op, self.op.group
        n, c = x.shape[:2]
        m = w.shape[0]
        xp = x
        if self.padded is not None:
            self.padded[self.interior] = x
            xp = self.padded
        y = self.out.reshape(n, g, m // g, -1)
        if g == c == m and w.shape[1] == 1:            # depthwise: accumulate tap by tap
            acc = self.out.reshape(n, c, *self.out.shape[2:])
            wt = w.reshape(c, -1)
            for t, window in enumerate(self.taps):
                scale = wt[:, t].reshape((1, c) + (1,) * (x.ndim - 2))
                np.multiply(xp[window], scale, out=acc if t == 0 else self.term)
                if t:
                    acc += self.term
        elif self.cols is None:                         # 1x1, stride 1: the input is the column matrix
            gemm(w.reshape(g, m // g, c // g), xp.reshape(n, g, c // g, -1), y)
        else:
            for t, window in enumerate(self.taps):      # cols[n, g, c/g, tap, positions]
                self.cols[:, :, :, t] = xp[window].reshape(self.cols[:, :, :, t].shape)
            k = (c // g) * len(self.taps)
            gemm(w.reshape(g, m // g, k), self.cols.reshape(n, g, k, -1), y)
        if b is not None:
            self.out += b.reshape((1, m) + (1,) * (x.ndim - 2))
        return self.out

    @property
    def interior(self):
        return (slice(None), slice(None)) + tuple(slice(p, p + s) for p, s in zip(self.op.pad_begins, self.x_shape[2:]))


def conv_runner(op: Conv, x_shape: tuple, w: np.ndarray, out_shape: tuple, dtype) -> ConvRunner:
    n, c = x_shape[:2]
    kernel = tuple(w.shape[2:])
    out = np.empty(out_shape, dtype)
    padded = None
    if any(op.pad_begins) or any(op.pad_ends):
        padded = np.zeros((n, c) + tuple(s + a + b for s, a, b in zip(x_shape[2:], op.pad_begins, op.pad_ends)), dtype)
    runner = ConvRunner(op, tuple(x_shape), w, out, padded)
    for k in np.ndindex(*kernel):
        runner.taps.append((slice(None), slice(None)) + tuple(
            slice(ki * d, ki * d + (o - 1) * st + 1, st)
            for ki, d, st, o in zip(k, op.dilations, op.strides, out_shape[2:])))
    pointwise = all(s == 1 for s in kernel) and all(s == 1 for s in op.strides) and padded is None
    depthwise = op.group == c == w.shape[0] and w.shape[1] == 1
    if depthwise:
        runner.term = np.empty(out_shape, dtype)
    elif not pointwise:
        g = op.group
        runner.cols = np.empty((n, g, c // g, len(runner.taps)) + tuple(out_shape[2:]), dtype)
    return runner


def library_runner(node, graph):
    """A runner for a float32/float64 MatMul or Conv step with its buffers, or None (the
    reference path of session.run_library_op runs it: other dtypes, TypedMatMul)."""
    out = graph.tensors[node.outputs[0]]
    dtypes = {np.dtype(graph.tensors[t].dtype) for t in node.inputs} | {np.dtype(out.dtype)}
    if len(dtypes) != 1 or dtypes.pop() not in (np.float32, np.float64):
        return None
    shapes = [tuple(graph.tensors[t].shape) for t in node.inputs]
    if isinstance(node.op, MatMul) and len(node.inputs) == 2:
        return MatMulRunner(node.op, np.empty(tuple(out.shape), out.dtype))
    if isinstance(node.op, Conv) and node.inputs[1] in graph.constants and len(shapes[0]) >= 3 \
            and not node.op.channels_last:   # NHWC convs (CUDA plans only) take the reference path
        return conv_runner(node.op, shapes[0], np.asarray(graph.constants[node.inputs[1]]), tuple(out.shape),
                           out.dtype)
    return None
