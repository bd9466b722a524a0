"""`powerfusion compile MODEL --target cuda|hip|mlu -o DIR`: kernel sources + plan.json."""
from __future__ import annotations

import sys

from powerfusion.cli.common import add_model_arguments, check_model_path, parse_shapes, progress
from powerfusion.errors import PowerFusionError

HELP = "compile a model to kernel sources and a plan.json (library calls, kernels, buffers)"
EXTENSIONS = {"cuda": ".cu", "hip": ".hip", "mlu": ".mlu"}


def add_arguments(p) -> None:
    add_model_arguments(p, target=False)
    p.add_argument("--target", default="cuda", help="cuda (default), hip, mlu, or a device name (h100, mi250, mlu370)")
    p.add_argument("-o", "--output", required=True, help="folder for the sources and plan.json")
    p.add_argument("--timings", action="store_true", help="print the seconds spent in each pipeline step")
    p.add_argument("--tune", action="store_true", help="time the perf model's best plans on the GPU and keep the fastest")


def main(args) -> int:
    from powerfusion.compiler import compile_model
    from powerfusion.perfmodel.specs import get_target
    from powerfusion.plan_io import write_plan
    import time
    backend = get_target(args.target).backend
    if backend not in EXTENSIONS:
        raise PowerFusionError(f"target '{args.target}' ({backend}) has no source backend; use cuda, hip or mlu")
    t0 = time.perf_counter()
    plan = compile_model(check_model_path(args.model), args.target, parse_shapes(args.shapes), tune=args.tune,
                         progress=progress)
    t1 = time.perf_counter()
    path = write_plan(plan, args.output, EXTENSIONS[backend])
    t2 = time.perf_counter()
    total = t2 - t0
    n_src = sum(len(s.kernels) for s in plan.kernel_steps)
    print(f"{args.model} -> {path.parent}: {n_src} kernel(s) in {len(plan.kernel_steps)} memory-bound subgraph(s), "
          f"{len(plan.library_steps)} library call(s)")
    if args.timings:
        for step, secs in plan.timings.items():
            print(f"  {step:<10} {secs:8.3f} s")
        # writing: plan.json, kernel sources and every constant the kernels read (.npy)
        print(f"  {'write':<10} {t2 - t1:8.3f} s")
        print(f"  {'total':<10} {total:8.3f} s (including writing)")
    return 0
