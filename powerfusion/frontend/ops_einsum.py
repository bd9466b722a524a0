"""Einsum, decomposed: operands are contracted left to right, each pair as transposes and a
batched MatMul ([batch, left, k] x [batch, k, right]); letters that no later operand and
not the output needs are summed out first by a reduce; a repeated letter within one term
(a diagonal) is a Gather by a constant index map; the result is transposed to the output's
letter order. Ellipses become fresh letters, aligned from the right as in numpy."""
from __future__ import annotations

import string

import numpy as np

from powerfusion.basic import Gather
from powerfusion.frontend.builder import NodeCtx
from powerfusion.frontend.ops_nn import matmul


def parse_equation(cx: NodeCtx, equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """Input terms and the output term, ellipses replaced by letters not used elsewhere."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        cx.fail(f"equation '{equation}' has {len(terms)} operands, the node {len(ranks)}")
    spare = [c for c in string.ascii_letters if c not in eq]
    widths = [r - (len(t) - 3) if "..." in t else 0 for t, r in zip(terms, ranks)]
    width = max(widths, default=0)
    fresh = "".join(spare[:width])
    terms = [t.replace("...", fresh[width - w:]) for t, w in zip(terms, widths)]
    if arrow:
        out = rhs.replace("...", fresh)
    else:   # implicit output: the ellipsis letters, then letters seen once, alphabetically
        counts = {c: sum(t.count(c) for t in terms) for c in "".join(terms)}
        out = fresh + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in fresh))
    for t, r in zip(terms, ranks):
        if len(t) != r:
            cx.fail(f"term '{t}' of equation '{equation}' does not match an operand of rank {r}")
    return terms, out


def _diagonal(cx: NodeCtx, name: str, term: str) -> tuple[str, str]:
    """A term with a repeated letter -> its diagonal, by a Gather with a constant index map."""
    unique = "".join(dict.fromkeys(term))
    if unique == term:
        return name, term
    shape = cx.info(name).shape
    index = np.einsum(f"{term}->{unique}", np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape))
    flat = cx.reshape(name, (cx.info(name).size,))
    idx = cx.b.constant(np.asarray(index, order="C").astype(np.int64), hint="diagonal")
    return cx.emit(Gather(0), [flat, idx], index.shape, cx.info(name).dtype), unique


def _sum_out(cx: NodeCtx, name: str, term: str, keep: set[str]) -> tuple[str, str]:
    axes = [i for i, c in enumerate(term) if c not in keep]
    if not axes:
        return name, term
    return cx.reduce("sum", name, axes, False), "".join(c for c in term if c in keep)


def _arrange(cx: NodeCtx, name: str, term: str, order: str) -> str:
    return cx.transpose(name, [term.index(c) for c in order]) if term != order else name


def _contract(cx: NodeCtx, a: str, ta: str, b: str, tb: str, needed: set[str]) -> tuple[str, str]:
    sizes = {c: d for t, n in ((ta, a), (tb, b)) for c, d in zip(t, cx.info(n).shape)}
    batch = "".join(c for c in ta if c in tb and c in needed)
    inner = "".join(c for c in ta if c in tb and c not in needed)
    left = "".join(c for c in ta if c not in tb)
    right = "".join(c for c in tb if c not in ta)
    size = lambda s: int(np.prod([sizes[c] for c in s], dtype=np.int64))  # noqa: E731
    a3 = cx.reshape(_arrange(cx, a, ta, batch + left + inner), (size(batch), size(left), size(inner)))
    b3 = cx.reshape(_arrange(cx, b, tb, batch + inner + right), (size(batch), size(inner), size(right)))
    y = matmul(cx, a3, b3)
    term = batch + left + right
    return cx.reshape(y, tuple(sizes[c] for c in term)), term


def _broadcast_letters(cx: NodeCtx, names: list[str], terms: list[str]) -> list[str]:
    """A letter of extent 1 in one operand and n in another is broadcast to n first."""
    sizes: dict[str, int] = {}
    for n, t in zip(names, terms):
        for c, d in zip(t, cx.info(n).shape):
            sizes[c] = max(sizes.get(c, 1), d)
    out = []
    for n, t in zip(names, terms):
        want = tuple(sizes[c] for c in t)
        if cx.info(n).shape != want:
            if any(d not in (1, w) for d, w in zip(cx.info(n).shape, want)):
                cx.fail(f"operand of shape {cx.info(n).shape} does not match the letters '{t}' ({want})")
            n = cx.bcast(n, want)
        out.append(n)
    return out


def convert_einsum(cx: NodeCtx):
    names = [cx.inp(i) for i in range(cx.n_in())]
    terms, out = parse_equation(cx, cx.attr("equation"), [len(cx.shape(n)) for n in names])
    names = _broadcast_letters(cx, names, terms)
    pairs = [_diagonal(cx, n, t) for n, t in zip(names, terms)]
    acc, term = None, ""
    for k, (name, t) in enumerate(pairs):
        needed = set(out).union(*(set(tt) for _, tt in pairs[k + 1:]))
        name, t = _sum_out(cx, name, t, needed | set(term))
        if acc is None:
            acc, term = name, t
            continue
        acc, term = _sum_out(cx, acc, term, needed | set(t))
        acc, term = _contract(cx, acc, term, name, t, needed)
    acc, term = _sum_out(cx, acc, term, set(out))
    result = _arrange(cx, acc, term, out)
    cx.reshape(result, cx.info(result).shape, out=cx.out())


CONVERTERS = {"Einsum": convert_einsum}
