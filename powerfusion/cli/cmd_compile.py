"""`powerfusion compile MODEL --target cuda|hip|mlu|cpu -o DIR`: kernel sources + plan.json."""
from __future__ import annotations

from powerfusion.cli.common import add_model_arguments, check_model_path, parse_shapes, progress
from powerfusion.errors import PowerFusionError

HELP = "compile a model to kernel sources and a plan.json (library calls, kernels, buffers)"


def add_arguments(p) -> None:
    add_model_arguments(p, target=False)
    p.add_argument("--target", default="cuda", help="cuda (default), hip, mlu, cpu (C with OpenMP), or a device name (h100, mi250, mlu370)")
    p.add_argument("-o", "--output", required=True, help="folder for the sources and plan.json")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="automatic mixed precision before compiling (default fp32: the model as given)")
    p.add_argument("--timings", action="store_true", help="print the seconds spent in each pipeline step")
    p.add_argument("--tune", action="store_true", help="time the perf model's best plans on the GPU and keep the fastest")
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help="processes searching subgraph plans at once (default: the usable cores; "
                        "POWERFUSION_SEARCH_WORKERS); the plans chosen do not depend on it")
    p.add_argument("--no-cache", action="store_true",
                   help="compile again even if this model and these options were compiled before "
                        "(search decisions still come from the plan cache)")


def main(args) -> int:
    if args.jobs is not None:
        if args.jobs < 1:
            raise PowerFusionError(f"--jobs must be at least 1, got {args.jobs}")
        from powerfusion import options
        # a context, not set_defaults: the CLI runs every command inside options.context, whose
        # copy of the settings set_defaults does not reach (-j was ignored)
        with options.context(search_workers=args.jobs):
            return _compile(args)
    return _compile(args)


def _compile(args) -> int:
    import time
    from powerfusion import compile_cache
    from powerfusion.targets.specs import get_target
    t0 = time.perf_counter()
    from powerfusion.targets.registry import backend, source_backends
    entry = backend(get_target(args.target).backend)
    if entry.extension is None:
        raise PowerFusionError(f"target '{args.target}' ({entry.name}) has no source backend; use "
                               f"{', '.join(source_backends())}")
    args.model = model = check_model_path(args.model)
    shapes = parse_shapes(args.shapes)
    check_output_folder(args.output)
    use_cache = not (args.no_cache or args.tune)
    if use_cache:
        key_target = args.target if args.precision == "fp32" else f"{args.target}+{args.precision}"
        key, hash_s = compile_cache.compile_key(model, key_target, shapes, entry.extension)
        hit = compile_cache.lookup(key, args.output)
        if hit is not None:
            _write_manifest(args, hit.digests)
            _print_summary(args, hit.summary)
            progress(f"cached compile {key[:12]}: output folder "
                     + ("up to date" if not hit.copied else f"restored ({hit.copied} file(s))"))
            if args.timings:
                print(f"  {'hash model':<10} {hash_s:8.3f} s   (cached compile {key[:12]})")
                for step, secs in hit.seconds.items():
                    print(f"  {step:<10} {secs:8.3f} s")
                print(f"  {'total':<10} {time.perf_counter() - t0:8.3f} s")
            return 0
    from powerfusion.compiler import compile_model
    from powerfusion.pipeline.plan_io import write_plan
    compile_cache.remove_stamp(args.output)   # a half-written folder must not look up to date
    # with --precision, the pipeline's import rewrites the ONNX model (AMP), weighed by this target's figures
    plan = compile_model(model, args.target, shapes, tune=args.tune, progress=progress, precision=args.precision)
    t2 = time.perf_counter()
    path = write_plan(plan, args.output, entry.extension)
    t3 = time.perf_counter()
    summary = {"kernels": sum(len(s.kernels) for s in plan.kernel_steps), "subgraphs": len(plan.kernel_steps),
               "library_calls": len(plan.library_steps)}
    _print_summary(args, summary)
    digests = {}
    if use_cache:
        digests = compile_cache.store(key, path.parent, compile_cache.output_files(path), summary,
                                      plan.graph.metadata.get("external_data", []))
    _write_manifest(args, digests)
    t4 = time.perf_counter()
    if args.timings:
        if use_cache:
            print(f"  {'hash model':<10} {hash_s:8.3f} s")
        for step, secs in plan.timings.items():
            print(f"  {step:<10} {secs:8.3f} s")
        # writing: plan.json, kernel sources and every constant the kernels read (.npy)
        print(f"  {'write':<10} {t3 - t2:8.3f} s")
        if use_cache:
            print(f"  {'cache':<10} {t4 - t3:8.3f} s   (storing the result for the next compile)")
        print(f"  {'total':<10} {t4 - t0:8.3f} s (including writing)")
    return 0


def _write_manifest(args, known: dict | None = None) -> None:
    """artefact.json: what `InferenceSession(DIR)` / `powerfusion run DIR` check before loading."""
    from powerfusion.artefact import write_manifest
    write_manifest(args.output, args.model, args.target, known)


def check_output_folder(path: str) -> None:
    """The output must be a folder we can create or reuse: not empty text, a file, a device or a
    dangling link."""
    import os
    if not path or not path.strip():
        raise PowerFusionError("-o/--output is empty; name a folder for the sources and plan.json")
    if os.path.islink(path) and not os.path.exists(path):
        raise PowerFusionError(f"output '{path}' is a link to '{os.readlink(path)}', which does not exist")
    if os.path.exists(path) and not os.path.isdir(path):
        raise PowerFusionError(f"output '{path}' exists and is not a folder; name a folder for the sources "
                               "and plan.json")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        if os.path.exists(parent):
            raise PowerFusionError(f"output '{path}': '{parent}' is not a folder")


def _print_summary(args, summary: dict) -> None:
    print(f"{args.model} -> {args.output}: {summary['kernels']} kernel(s) in {summary['subgraphs']} "
          f"memory-bound subgraph(s), {summary['library_calls']} library call(s)")
