"""Division in emitted index expressions: a // or % whose dividend cannot be negative is
rendered as unsigned C division; anything that may go negative keeps the floored helpers.
The rendered C is compiled on the host and compared with GIR's floored semantics."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from powerfusion.backends.cstyle.index import render_index
from powerfusion.gir.expr import Const, Load, I, J, U, evaluate

FLOOR = {"floordiv": "pf_floordiv", "mod": "pf_mod"}


def _render(e):
    return render_index(e, {}, load=lambda b, idx: f"{b}[{idx}]", floor=lambda op, a, b: f"{FLOOR[op]}({a}, {b})")


def test_nonnegative_dividend_is_unsigned_division():
    src = _render((U // 3248) * 90944 + (U % 3248 // 56) * 784 + J)
    assert "pf_" not in src and src.count("(uidx_t)") == 3


def test_possibly_negative_dividend_keeps_floored_forms():
    assert _render((U - 5) // 7).startswith("pf_floordiv(")
    assert _render(Load("idx", U) % 4).startswith("pf_mod(")
    # (u - 15) // 7 + 1 >= -2: both floored; (u - 5) // 7 + 1 >= 0: the outer one unsigned
    assert _render(((U - 15) // 7 + 1) % 3).count("pf_") == 2
    assert _render(((U - 5) // 7 + 1) % 3).count("pf_") == 1


def test_outer_division_of_a_floored_mod_is_unsigned():
    # pf_mod's result is in [0, k): a division of it needs no sign fix-up
    src = _render(((U - 100) % 64) // 8)
    assert src.startswith("((idx_t)((uidx_t)(pf_mod(")


PRELUDE = """
#include <stdio.h>
typedef int idx_t;
typedef unsigned int uidx_t;
static idx_t pf_floordiv(idx_t a, idx_t b) { idx_t q = a / b; return q - ((a % b) < 0); }
static idx_t pf_mod(idx_t a, idx_t b) { idx_t r = a % b; return r + (r < 0 ? b : 0); }
"""


def _random_expr(rng, depth):
    if depth == 0 or rng.random() < 0.25:
        return [U, I, J, Const(int(rng.integers(-40, 40)))][rng.integers(4)]
    op = rng.choice(["add", "sub", "mul", "floordiv", "mod"])
    a = _random_expr(rng, depth - 1)
    if op in ("floordiv", "mod"):
        return a // int(rng.choice([1, 2, 3, 7, 8, 56, 64, 1000])) if op == "floordiv" else \
            a % int(rng.choice([2, 3, 7, 8, 28, 64]))
    b = _random_expr(rng, depth - 1) if op != "mul" else Const(int(rng.integers(-3, 4)))
    return {"add": a + b, "sub": a - b, "mul": a * b}[op]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a host C compiler")
def test_rendered_division_matches_floored_semantics(tmp_path):
    rng = np.random.default_rng(16)
    exprs = [_random_expr(rng, 4) for _ in range(300)]
    u, i, j = np.meshgrid(np.arange(0, 200, 7), np.arange(0, 9), np.arange(0, 70, 3), indexing="ij")
    u, i, j = u.ravel(), i.ravel(), j.ravel()
    body = "".join(f"static idx_t f{k}(idx_t u, idx_t i, idx_t j) {{ return {_render(e)}; }}\n"
                   for k, e in enumerate(exprs))
    calls = " ".join(f'printf("%d\\n", f{k}(u, i, j));' for k in range(len(exprs)))
    main = ("int main(void) { int u, i, j; while (scanf(\"%d %d %d\", &u, &i, &j) == 3) { " + calls + " } return 0; }")
    (tmp_path / "t.c").write_text(PRELUDE + body + main)
    subprocess.run(["cc", "-O1", "-o", str(tmp_path / "t"), str(tmp_path / "t.c")], check=True)
    feed = "\n".join(f"{a} {b} {c}" for a, b, c in zip(u, i, j))
    out = subprocess.run([str(tmp_path / "t")], input=feed, capture_output=True, text=True, check=True).stdout
    got = np.array(out.split(), dtype=np.int64).reshape(len(u), len(exprs))
    for k, e in enumerate(exprs):
        want = np.broadcast_to(evaluate(e, {"u": u, "i": i, "j": j}), u.shape)
        assert np.array_equal(got[:, k], want), f"{e!r}: {_render(e)}"
