"""`powerfusion viz MODEL -o out.html`: the GIR visualiser (docs/viz.md)."""
from __future__ import annotations

import os

from powerfusion.cli.common import add_model_arguments, check_model_path, parse_shapes, progress

DEFAULT_TIMEOUT = 300.0
HELP = "write a self-contained HTML view of the partition and every subgraph's GIR at every rewrite step"


def add_arguments(p) -> None:
    add_model_arguments(p, target=False)
    p.add_argument("--target", default="cuda",
                   help="cuda (default: kernel source lines need a GPU backend), hip, mlu, cpu or a device "
                        "name (a100, h100, h200, mi100, mi250, mlu370)")
    p.add_argument("-o", "--output", help="output file (default: MODEL's name with the format's extension)")
    p.add_argument("--format", choices=("html", "json", "dot", "svg"), default=None,
                   help="html (default; works offline), json (the data), dot or svg (one view; svg needs Graphviz)")
    p.add_argument("--view", help="dot/svg: 'partition' or a subgraph name, e.g. sg3 (default: partition)")
    p.add_argument("--step", type=int, help="dot/svg: stage index of that subgraph (default: the final graph)")
    p.add_argument("--no-codegen", action="store_true", help="skip rendering kernel source (no source lines shown)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds each subgraph may take (lowering, search, rewriting, codegen); one that "
                        f"runs over is shown as failed (default {DEFAULT_TIMEOUT:g}; 0 = no limit)")
    p.add_argument("--default-choice", action="store_true",
                   help="show the default template choice (as inspect --gir) instead of the perf-model search's")


def main(args) -> int:
    from powerfusion.viz import render, viz_data
    args.model = check_model_path(args.model)
    fmt = args.format or _format_from(args.output) or "html"
    out = args.output or os.path.splitext(os.path.basename(args.model))[0] + "." + fmt
    if args.view is not None or args.step is not None:
        if fmt not in ("dot", "svg"):
            progress("--view/--step choose what dot/svg show; the html and json outputs hold every view")
    data = viz_data(args.model, shapes=parse_shapes(args.shapes), target=args.target,
                    codegen=not args.no_codegen, search=not args.default_choice,
                    timeout=args.timeout or None, progress=progress)
    text = render(data, fmt, args.view, args.step)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    subs = data["subgraphs"]
    failed = [s for s in subs if s["error"]]
    progress(f"wrote {out} ({len(text) / 1024:.0f} KiB): {len(subs)} subgraph(s), "
             f"{sum(s['trace_steps'] for s in subs)} rule application(s)"
             + (f"; {len(failed)} subgraph(s) failed (shown in the view)" if failed else ""))
    print(out)
    return 0


def _format_from(path: str | None) -> str | None:
    if not path:
        return None
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return {"htm": "html"}.get(ext, ext) if ext in ("html", "htm", "json", "dot", "svg") else None
