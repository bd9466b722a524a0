"""`powerfusion quantize MODEL --calibration DATA.npz [--method minmax|percentile|entropy]
[--per-channel] [--symmetric] [--equalize] [--ops all|weight-gemms] [--dynamic] -o OUT.onnx`: INT8 post-training
quantisation to a standard QDQ model, with a short accuracy report on the calibration data."""
from __future__ import annotations

import numpy as np

from powerfusion.cli.common import load_model, progress
from powerfusion.errors import PowerFusionError

HELP = "quantise an fp32 model to INT8 (QDQ ONNX) from calibration data, or dynamically"
REPORT_SAMPLES = 64


def add_arguments(p) -> None:
    p.add_argument("model", help="path of an fp32 .onnx file")
    p.add_argument("--calibration", help=".npz with one array per model input, samples on a new leading axis")
    p.add_argument("--method", default="minmax", choices=["minmax", "percentile", "entropy"],
                   help="how activation ranges are chosen from the calibration data (default minmax)")
    p.add_argument("--per-channel", action="store_true", help="one weight scale per output channel")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", action="store_true", help="activations without zero point, range [-127, 127]")
    sym.add_argument("--asymmetric", action="store_true", help="activations with a zero point (default)")
    p.add_argument("--equalize", action="store_true", help="cross-layer weight equalisation before quantising")
    p.add_argument("--ops", default="all", choices=["all", "weight-gemms"],
                   help="which ops get Q/DQ pairs (static): onnxruntime's default, or only the inputs of "
                        "MatMul / Gemm / Conv with constant weights (the integer GEMMs; the rest stays float)")
    p.add_argument("--dynamic", action="store_true", help="activation scales at run time (no calibration needed)")
    p.add_argument("-o", "--output", required=True, help="path of the quantised .onnx file")


def main(args) -> int:
    import onnx

    from powerfusion.precision.calibration import load_calibration
    from powerfusion.precision.ptq import QuantizeOptions, quantize_model
    path, model = load_model(args.model)
    if not args.dynamic and not args.calibration:
        raise PowerFusionError("static quantisation needs --calibration DATA.npz (or pass --dynamic)")
    data = load_calibration(args.calibration, model) if args.calibration else None
    opts = QuantizeOptions(args.method, args.per_channel, args.symmetric, args.dynamic, args.equalize, args.ops)
    progress(f"quantising with {opts}")
    out = quantize_model(model, data, opts)
    onnx.save(out, args.output)
    print(f"{args.model} -> {args.output}: {'dynamic' if args.dynamic else 'static ' + args.method} INT8")
    if data is not None:
        _report(model, out, data)
    return 0


def _report(model, quantized, data) -> None:
    """Per-output error against fp32 on up to REPORT_SAMPLES calibration samples (onnxruntime runs both)."""
    import onnxruntime as ort

    from powerfusion.precision.ptq import output_errors
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(model.SerializeToString(), so)
    qs = ort.InferenceSession(quantized.SerializeToString(), so)
    names = [o.name for o in ref.get_outputs()]
    n = min(data.count, REPORT_SAMPLES)
    runs = [(ref.run(None, data.sample(i)), qs.run(None, data.sample(i))) for i in range(n)]
    refs = [np.concatenate([r[0][k] for r in runs]) for k in range(len(names))]
    outs = [np.concatenate([r[1][k] for r in runs]) for k in range(len(names))]
    print(f"accuracy on {n} calibration sample(s), against the fp32 model:")
    for e in output_errors(refs, outs, names):
        top1 = "" if e.top1_agreement is None else f", top-1 agreement {e.top1_agreement:.3f}"
        print(f"  {e.name}: max |error| {e.max_abs:.4g} ({e.rel:.3%} of max |fp32|){top1}")
