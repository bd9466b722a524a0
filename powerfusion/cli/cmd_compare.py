"""`powerfusion compare MODEL`: our outputs against onnxruntime's CPU provider.

With --per-subgraph every output of every memory-bound subgraph that is also a tensor
of the ONNX model is compared too: those tensors become extra graph outputs for
onnxruntime (Polygraphy's trick); our partition is left as it is.
"""
from __future__ import annotations

import numpy as np

from powerfusion.cli.common import (TOLERANCES, add_model_arguments, load_or_make_inputs, make_session,
                                    progress)
from powerfusion.errors import PowerFusionError

HELP = "compare outputs (and optionally every subgraph's outputs) with onnxruntime on the CPU"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--inputs", help=".npz file with one array per model input (default: seeded random)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--per-subgraph", action="store_true", help="also compare each memory-bound subgraph's outputs")
    p.add_argument("--rtol", type=float, help="relative tolerance for float outputs (default: per dtype)")
    p.add_argument("--atol", type=float, help="absolute tolerance for float outputs (default: per dtype)")


def main(args) -> int:
    import onnx

    _require_onnxruntime()   # before any work: the reference is the point of the command
    sess = make_session(args, target=args.target or "cpu")
    feeds = load_or_make_inputs(sess, args.inputs, args.seed)
    ours = sess.run_all_tensors(feeds) if args.per_subgraph else dict(zip(
        [t.name for t in sess.graph.outputs], sess.run(None, feeds)))
    proto = onnx.load(args.model)
    feeds = {k: (v.get() if hasattr(v, "get") else v) for k, v in feeds.items()}
    outputs = [t.name for t in sess.graph.outputs]
    rows = [(None, name) for name in outputs]
    skipped = 0
    if args.per_subgraph:
        onnx_names = {o for n in proto.graph.node for o in n.output if o} | {i.name for i in proto.graph.input}
        for sg in sess.partition.subgraphs:
            for name in sg.outputs:
                if name in onnx_names and name not in outputs:
                    rows.append((sg.name, name))
                elif name not in onnx_names:
                    skipped += 1
        _expose(proto, [name for sg, name in rows if sg is not None], sess.graph)
    progress("running onnxruntime (CPUExecutionProvider)")
    reference = _run_onnxruntime(proto, feeds, [name for _, name in rows])
    width = max([len("tensor")] + [len(name) for _, name in rows]) + 2   # full names: no two read alike
    print(f"{'subgraph':<10}{'tensor':<{width}}{'shape':<18}{'dtype':<9}{'max abs':>11}{'max rel':>11}"
          f"{'rtol':>8}{'atol':>8}  result")
    failures = 0
    for sg, name in rows:
        got, want = np.asarray(ours[name]), np.asarray(reference[name])
        rtol, atol, max_abs, max_rel, ok = compare_arrays(got, want, args.rtol, args.atol)
        failures += not ok
        print(f"{sg or 'output':<10}{name:<{width}}{str(tuple(want.shape)):<18}{want.dtype.name:<9}"
              f"{max_abs:>11.3g}{max_rel:>11.3g}{rtol:>8.0e}{atol:>8.0e}  {'pass' if ok else 'FAIL'}")
    if skipped:
        print(f"({skipped} subgraph output(s) are internal to a decomposed ONNX node and have no onnxruntime "
              "counterpart)")
    print(f"{len(rows) - failures}/{len(rows)} tensors within tolerance "
          "(|ours - onnxruntime| <= atol + rtol * |onnxruntime|)")
    return 0 if failures == 0 else 1


def compare_arrays(got: np.ndarray, want: np.ndarray, rtol=None, atol=None):
    """(rtol, atol, max abs error, max rel error, within tolerance); exact for integers and booleans."""
    if got.shape != want.shape:
        raise PowerFusionError(f"shape mismatch: ours {got.shape}, onnxruntime {want.shape}")
    default = TOLERANCES.get(want.dtype.name, (0.0, 0.0))
    scaled = atol is None
    rtol = default[0] if rtol is None or default == (0.0, 0.0) else rtol
    atol = default[1] if atol is None or default == (0.0, 0.0) else atol
    g, w = got.astype(np.float64), want.astype(np.float64)
    if scaled and w.size:
        # the dtype's default atol is for values of order one: each tensor is judged on its own
        # scale (an intermediate of magnitude 40 carries 40x the rounding of the output)
        finite_w = np.abs(w[np.isfinite(w)])
        atol *= max(1.0, float(finite_w.max()) if finite_w.size else 1.0)
    same_nan = np.isnan(g) == np.isnan(w)
    finite = ~np.isnan(w) & ~np.isnan(g)
    diff = np.where(finite & (g != w), np.abs(g - w), 0.0)  # g != w keeps equal infinities at 0
    max_abs = float(diff.max()) if diff.size else 0.0
    rel = np.divide(diff, np.abs(w), out=np.zeros_like(diff), where=np.abs(w) > 0)
    max_rel = float(rel.max()) if rel.size else 0.0
    ok = bool(same_nan.all() and (diff <= atol + rtol * np.abs(np.where(finite, w, 0))).all())
    return rtol, atol, max_abs, max_rel, ok


def _expose(proto, names: list[str], graph) -> None:
    """Add intermediate tensors as graph outputs, typed from our (static) tensor infos."""
    from onnx import helper
    present = {o.name for o in proto.graph.output}
    for name in names:
        if name in present:
            continue
        info = graph.tensors[name]
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
        proto.graph.output.append(helper.make_tensor_value_info(name, elem, list(info.shape)))


def _require_onnxruntime() -> None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise PowerFusionError("compare needs onnxruntime, the reference it compares against: "
                               "python3 -m pip install 'powerfusion[ort]'") from None


def _run_onnxruntime(proto, feeds, names) -> dict[str, np.ndarray]:
    import onnxruntime as ort
    from onnx import helper
    # onnx may stamp an IR version newer than onnxruntime reads; the opsets fix the one needed
    proto.ir_version = min(proto.ir_version, helper.find_min_ir_version_for(list(proto.opset_import), True))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        ref = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        values = ref.run(names, feeds)
    except Exception as e:  # onnxruntime raises its own exception types
        raise PowerFusionError(f"onnxruntime could not run the model: {str(e).splitlines()[0]}") from None
    return dict(zip(names, values))
