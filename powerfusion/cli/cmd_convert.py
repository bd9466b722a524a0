"""`powerfusion convert MODEL --precision fp16|bf16 -o OUT.onnx`: automatic mixed precision as an
ONNX-to-ONNX rewrite (powerfusion.precision.amp); the result is a standard ONNX model."""
from __future__ import annotations

from powerfusion.cli.common import load_model, progress

HELP = "rewrite an fp32 model to mixed precision (fp16 / bf16) and write it as ONNX"


def add_arguments(p) -> None:
    p.add_argument("model", help="path of an .onnx file")
    p.add_argument("--precision", required=True, choices=["fp16", "bf16"], help="16-bit type of converted ops")
    p.add_argument("-o", "--output", required=True, help="path of the converted .onnx file")
    p.add_argument("--fp16-ops", default="", help="comma-separated op types to allow in 16 bits (added to the white list)")
    p.add_argument("--fp32-ops", default="", help="comma-separated op types to keep in fp32 (added to the fp32 list)")
    p.add_argument("--cost-target", default="h200", help="device whose figures decide whether a conversion pays")


def main(args) -> int:
    import onnx

    from powerfusion.precision import AmpConfig, AmpReport, convert_precision, precision_dtype
    from powerfusion.precision.lists import parse_op_list
    path, model = load_model(args.model)
    config = AmpConfig(dtype=precision_dtype(args.precision), cost_target=args.cost_target).with_ops(
        parse_op_list(args.fp16_ops), parse_op_list(args.fp32_ops))
    report = AmpReport()
    out = convert_precision(model, config, report)
    onnx.checker.check_model(out)
    onnx.save(out, args.output)
    progress(f"declined by the cost rule or the op's schema: {', '.join(report.declined) or 'none'}")
    print(f"{args.model} -> {args.output}: {len(report.converted)} node(s) in {config.dtype}, "
          f"{len(report.declined)} kept in float32 by the cost rule; casts: {report.casts_inserted} inserted, "
          f"{report.casts_eliminated} eliminated, {report.casts_left} left (fused into neighbouring kernels)")
    return 0
