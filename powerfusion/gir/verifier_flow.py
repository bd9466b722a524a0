"""The data-flow half of the verifier (see verifier.py for the rules): walks the schedule
keeping, per buffer element, the op, unit and lane that last wrote it."""
from __future__ import annotations

import numpy as np

from powerfusion.gir.expr import BinOp, Const, Expr, Load, Select, Var, evaluate, loads
from powerfusion.gir.ir import Broadcast, GIRGraph, GOp, Level, MemorySlice, Reduce, Scope, Sync, _grid


class GIRVerifyError(Exception):
    """A GIR graph breaks a structural or data-flow rule (a template or rewrite bug)."""


# ---- interval evaluation (for index expressions that load) ------------------------------

_BIG = 1 << 62


def interval(e: Expr, env) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) bounds of e over u, i, j bound to arrays; a Load may return any int64."""
    if isinstance(e, Const):
        return np.int64(e.value), np.int64(e.value)
    if isinstance(e, Var):
        return env[e.name], env[e.name]
    if isinstance(e, Load):
        return np.int64(-_BIG), np.int64(_BIG)
    if isinstance(e, Select):
        clo, chi = interval(e.cond, env)
        alo, ahi = interval(e.a, env)
        blo, bhi = interval(e.b, env)
        lo = np.where(clo == chi, np.where(clo != 0, alo, blo), np.minimum(alo, blo))
        hi = np.where(clo == chi, np.where(clo != 0, ahi, bhi), np.maximum(ahi, bhi))
        return lo, hi
    assert isinstance(e, BinOp), e
    alo, ahi = interval(e.a, env)
    blo, bhi = interval(e.b, env)
    with np.errstate(all="ignore"):
        if e.op == "add":
            return np.clip(alo + blo, -_BIG, _BIG), np.clip(ahi + bhi, -_BIG, _BIG)
        if e.op == "sub":
            return np.clip(alo - bhi, -_BIG, _BIG), np.clip(ahi - blo, -_BIG, _BIG)
        if e.op == "mul":
            c = [np.clip(x.astype(np.float64) * y, -_BIG, _BIG) for x in (alo, ahi) for y in (blo, bhi)]
            return np.minimum.reduce(c).astype(np.int64), np.maximum.reduce(c).astype(np.int64)
        if e.op in ("min", "max"):
            f = np.minimum if e.op == "min" else np.maximum
            return f(alo, blo), f(ahi, bhi)
        if e.op == "floordiv":  # divisors in index expressions are positive constants
            d = np.maximum(blo, 1)
            return alo // d, ahi // d
        if e.op == "mod":
            exact = (alo == ahi) & (blo == bhi)
            m = np.maximum(bhi, 1)
            return np.where(exact, alo % m, 0), np.where(exact, alo % m, m - 1)
    # comparisons and logic: exact when both sides are, else unknown (0..1)
    from powerfusion.gir.expr import _NP_BINOPS
    exact = (alo == ahi) & (blo == bhi)
    v = _NP_BINOPS[e.op](alo, blo).astype(np.int64)
    return np.where(exact, v, 0), np.where(exact, v, 1)


_UNWRITTEN, _PRESET = -1, -2


class _State:
    """Last writer of every element of one buffer (rows: units or groups for local levels)."""

    def __init__(self, rows: int, size: int, preset: bool):
        self.size = size  # flat arrays: element (row, addr) at row*size + addr
        self.op = np.full(rows * size, _PRESET if preset else _UNWRITTEN, dtype=np.int32)
        self.unit = np.zeros(rows * size, dtype=np.int32)
        self.lane = np.zeros(rows * size, dtype=np.int16)
        self.repl = np.zeros(rows * size, dtype=bool)
        self.read_op = np.full(rows * size, -1, dtype=np.int32)   # last op that read the element
        self.reader = np.zeros(rows * size, dtype=np.int32)       # and one unit that did


class _Flow:
    def __init__(self, g: GIRGraph, cap: int, seed: int):
        self.g = g
        P = g.parallel
        self.P = P
        # work per unit: the largest slice it evaluates, or its share of register/shared state
        biggest = max((s.count for op in g.ops for s in op.inputs + op.outputs), default=1)
        local = sum(b.size for b in g.buffers if b.level == Level.REGISTER) + \
            sum(b.size for b in g.buffers if b.level == Level.SHARED) // P.units_per_group
        per_unit = max(biggest, local, 1)
        groups = np.arange(P.groups)
        self.sampled = P.units * per_unit > cap
        if self.sampled:
            keep = max(2, cap // (per_unit * P.units_per_group))
            rng = np.random.default_rng(seed)
            pick = rng.choice(P.groups, size=min(P.groups, keep), replace=False)
            groups = np.unique(np.concatenate([[0, P.groups - 1], pick]))
        units = (groups[:, None] * P.units_per_group + np.arange(P.units_per_group)[None, :]).reshape(-1)
        self.units = units[units < P.units]
        self.groups = groups
        self.unit_row = np.full(P.units, -1, dtype=np.int64)   # unit -> its row in register states
        self.unit_row[self.units] = np.arange(len(self.units))
        self.group_row = np.full(P.groups, -1, dtype=np.int64)  # group -> its row in shared states
        self.group_row[groups] = np.arange(len(groups))
        self.bufs = {b.name: b for b in g.buffers}
        preset = set(g.inputs) | {n for n, _ in g.constants}
        self.state: dict[str, _State] = {}
        for b in g.buffers:
            rows = {Level.GLOBAL: 1, Level.SHARED: len(groups), Level.REGISTER: len(self.units)}[b.level]
            self.state[b.name] = _State(rows, b.size, b.name in preset)
        self.last_sync = {s: -1 for s in Scope}  # latest sync position of at least this scope
        self.last_write = {b: -1 for b in self.bufs}

    def fail(self, k, op, msg):
        raise GIRVerifyError(f"GIR graph '{self.g.name}' at op {k} ({op.describe()}, from '{op.origin}'): {msg}")

    def run(self):
        for k, op in enumerate(self.g.ops):
            if isinstance(op.args, Sync):
                for s in Scope:
                    if s <= op.args.scope:
                        self.last_sync[s] = k
                continue
            units = self._active(op)
            if len(units) == 0:
                continue
            for s in op.inputs:
                self._read(k, op, s, units)
            for s in op.inputs + op.outputs:
                for lb in _loaded(s):
                    self._read_loaded(k, op, lb)
            for s in op.outputs:
                self._write(k, op, s, units)
        if not self.sampled:
            for name in self.g.outputs:
                st = self.state[name]
                missing = np.flatnonzero(st.op == _UNWRITTEN)
                if missing.size:
                    raise GIRVerifyError(f"GIR graph '{self.g.name}': output '{name}' element {missing[0]} "
                                         f"({missing.size} of {st.size}) is never written")

    def _active(self, op: GOp) -> np.ndarray:
        if op.guard is None:
            return self.units
        if loads(op.guard):
            return self.units  # data-dependent guard: check every unit
        v = np.broadcast_to(evaluate(op.guard, {"u": self.units}), self.units.shape).astype(bool)
        return self.units[v]

    def _positions(self, k, op, s: MemorySlice, units):
        """Flat (state position, address, unit, lane) of the valid elements, bounds checked;
        None for data-dependent addresses (after an interval bounds check)."""
        size = self.bufs[s.buffer].size
        if _loaded(s):
            u, i, j = _grid(units, s.num, s.width)
            lo, hi = interval(s.index, {"u": u, "i": i, "j": j})
            mask = _const_mask(s, units)
            lo = np.broadcast_to(lo, mask.shape[:1] + (s.num, s.width)).reshape(mask.shape)
            hi = np.broadcast_to(hi, mask.shape[:1] + (s.num, s.width)).reshape(mask.shape)
            bad = mask & ((lo < 0) | (hi >= size))
            if np.any(bad):
                who = np.broadcast_to(units[:, None], bad.shape)[bad][0]
                self.fail(k, op, f"slice {s.describe()} may touch [{lo[bad][0]}, {hi[bad][0]}] outside "
                                 f"'{s.buffer}' ({size} elements) for unit {who}"
                                 " (bound the loaded index)")
            return None
        addr = s.addresses(units)
        mask = s.mask(units)
        bad = mask & ((addr < 0) | (addr >= size))
        if np.any(bad):
            uu = np.broadcast_to(units[:, None], bad.shape)[bad][0]
            self.fail(k, op, f"slice {s.describe()} touches element {addr[bad][0]} outside '{s.buffer}' "
                             f"({size} elements) for unit {uu}")
        uu = np.broadcast_to(units[:, None], addr.shape)
        lane = np.broadcast_to(s.lanes_of(self.P.lanes)[None, :], addr.shape)
        addr, uu, lane = addr[mask], uu[mask], lane[mask]
        if s.level == Level.GLOBAL:
            return addr, addr, uu, lane
        row = self.group_row[uu // self.P.units_per_group] if s.level == Level.SHARED else self.unit_row[uu]
        return row * size + addr, addr, uu, lane

    def _read(self, k, op, s: MemorySlice, units):
        pos = self._positions(k, op, s, units)
        st = self.state[s.buffer]
        if pos is None:  # data-dependent addresses: the whole buffer must be ready for anyone
            self._read_loaded(k, op, s.buffer)
            return
        flat, addr, ru, rl = pos
        if s.level != Level.REGISTER:
            st.read_op[flat] = k
            st.reader[flat] = ru
        wop = st.op[flat]
        unwritten = wop == _UNWRITTEN
        if np.any(unwritten) and not (self.sampled and s.level == Level.GLOBAL):
            e = np.flatnonzero(unwritten)[0]
            self.fail(k, op, f"unit {ru[e]} reads element {addr[e]} of '{s.buffer}' before anything writes it")
        w = wop >= 0
        if not np.any(w):
            return
        flat, addr, ru, rl, wop = flat[w], addr[w], ru[w], rl[w], wop[w]
        wu, wl, repl = st.unit[flat], st.lane[flat], st.repl[flat]
        G = self.P.units_per_group
        if s.level == Level.REGISTER:  # per-unit arrays: only lanes can differ
            need = np.where(wl != rl, Scope.WARP, Scope.LANE)
        else:
            need = np.where(wu // G != ru // G, Scope.DEVICE,
                            np.where(wu != ru, Scope.BLOCK, np.where(wl != rl, Scope.WARP, Scope.LANE)))
        if not np.any(need):
            return
        if s.level == Level.REGISTER and isinstance(op.args, (Reduce, Broadcast)):
            need = np.where(need == Scope.WARP, Scope.LANE, need)  # the op exchanges lanes itself
        need = np.where((need == Scope.WARP) & repl, Scope.LANE, need)
        last = np.array([self.last_sync[sc] for sc in Scope])
        bad = (need > Scope.LANE) & (last[need] < wop)
        if np.any(bad):
            e = np.flatnonzero(bad)[0]
            self.fail(k, op, f"element {addr[e]} of '{s.buffer}' written by op {wop[e]} (unit {wu[e]}, lane {wl[e]}) "
                             f"is read by unit {ru[e]}, lane {rl[e]} with no {Scope(need[e]).label} sync between")

    def _read_loaded(self, k, op, name):
        """A read at data-dependent positions: fine for untouched inputs, else the last write
        must be a DEVICE sync away."""
        if self.last_write[name] >= 0 and self.last_sync[Scope.DEVICE] < self.last_write[name]:
            self.fail(k, op, f"'{name}' is read at data-dependent positions after op {self.last_write[name]} "
                             "wrote it, with no DEVICE sync between")
        st = self.state[name]
        if not self.sampled and np.any(st.op == _UNWRITTEN):
            self.fail(k, op, f"'{name}' is read at data-dependent positions but is not fully written")

    def _write(self, k, op, s: MemorySlice, units):
        pos = self._positions(k, op, s, units)
        if pos is None:
            self.fail(k, op, f"write to '{s.buffer}' at data-dependent positions (scatter) is not supported")
        flat, addr, wu, wl = pos
        if s.level != Level.REGISTER and len(units) > 1:  # register arrays are private to a unit
            order = np.lexsort((wu, flat))
            ks, us = flat[order], wu[order]
            clash = (ks[1:] == ks[:-1]) & (us[1:] != us[:-1])
            if np.any(clash):
                e = order[1:][clash][0]
                self.fail(k, op, f"element {addr[e]} of '{s.buffer}' is written by several units in one gOperator")
        st = self.state[s.buffer]
        if s.level != Level.REGISTER:
            self._check_overwrite(k, op, s, st, flat, addr, wu)
        st.op[flat] = k
        st.unit[flat] = wu
        st.lane[flat] = wl
        st.repl[flat] = isinstance(op.args, Reduce) and op.args.over == "width"
        self.last_write[s.buffer] = k


    def _check_overwrite(self, k, op, s, st, flat, addr, wu):
        """Write after read: an element another unit read since its last write may only be
        overwritten after a sync that orders that read (BLOCK within the group, else DEVICE)."""
        rop = st.read_op[flat]
        live = (rop >= 0) & (rop > st.op[flat]) & (st.reader[flat] != wu)
        if not np.any(live):
            return
        G = self.P.units_per_group
        need = np.where(st.reader[flat] // G != wu // G, Scope.DEVICE, Scope.BLOCK)
        last = np.array([self.last_sync[sc] for sc in Scope])
        bad = live & (last[need] < rop)
        if np.any(bad):
            e = np.flatnonzero(bad)[0]
            self.fail(k, op, f"unit {wu[e]} overwrites element {addr[e]} of '{s.buffer}' that unit "
                             f"{st.reader[flat][e]} read at op {rop[e]}, with no {Scope(need[e]).label} sync between")


def _loaded(s: MemorySlice) -> frozenset[str]:
    out = loads(s.index)
    if s.valid is not None:
        out |= loads(s.valid)
    return out


def _const_mask(s: MemorySlice, units) -> np.ndarray:
    if s.valid is None or loads(s.valid):
        return np.ones((len(units), s.count), dtype=bool)
    return s.mask(units)
