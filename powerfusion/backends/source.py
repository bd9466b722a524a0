"""What every backend's renderer returns: kernel sources with their launch shape, and the error
a renderer raises for a layout it does not implement."""
from __future__ import annotations

from dataclasses import dataclass, field


class RenderError(Exception):
    """The GIR graph uses a layout this renderer does not implement (a template/rule bug)."""


@dataclass(frozen=True)
class KernelSource:
    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    params: tuple[tuple[str, str, bool], ...]   # (buffer name, dtype, written)
    op_lines: dict = field(default_factory=dict, compare=False)  # op uid -> (first line, last line)


def op_line_ranges(src: str) -> dict[int, tuple[int, int]]:
    """gOperator uid -> (first, last) 1-based source line, from the `// gop N:` markers."""
    out, cur, lines = {}, None, src.splitlines()
    for n, line in enumerate(lines, 1):
        t = line.strip()
        if t.startswith("// gop "):
            cur = int(t[7:t.index(":")])
            out[cur] = (n, n)
        elif cur is not None and t != "}" or (cur is not None and t == "}" and n < len(lines)):
            out[cur] = (out[cur][0], n)
    return out
