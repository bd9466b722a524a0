"""`powerfusion quantize-weights MODEL --dtype int4|nf4|fp4|mxfp4|fp8_e4m3|int2|int1 [--group 128]
[--act int8] -o OUT.onnx`: weight-only (or W4A8 / W2A8) low-bit quantisation of every MatMul
with a constant 2-D float weight. int4 and int2 weights with float activations become
com.microsoft.MatMulNBits (onnxruntime runs them too); the other types, and int8
activations, become ai.powerfusion.MatMulLowBit (docs/ttile.md defines it)."""
from __future__ import annotations

import os

from powerfusion.cli.common import load_model, progress
from powerfusion.errors import PowerFusionError

HELP = "quantise MatMul weights to int4 / nf4 / fp4 / mxfp4 / fp8 / int2 / int1 (MatMulNBits or MatMulLowBit)"
DTYPES = {"int4": "int4", "int2": "int2", "int1": "int1", "nf4": "nf4", "fp4": "fp4_e2m1",
          "mxfp4": "mxfp4", "fp8_e4m3": "fp8_e4m3"}
NBITS = ("int4", "int2")   # the types MatMulNBits holds (symmetric: its default zero point)


def add_arguments(p) -> None:
    p.add_argument("model", help="path of a float .onnx file")
    p.add_argument("--dtype", required=True, choices=sorted(DTYPES), help="weight type")
    p.add_argument("--group", type=int, default=None,
                   help="elements of K per scale: a power of two >= 32 (default 128; mxfp4 has its fixed 32)")
    p.add_argument("--act", choices=["int8"], default=None,
                   help="also round activations to int8 per row at run time (int4, int2 and int1 weights)")
    p.add_argument("-o", "--output", required=True, help="path of the quantised .onnx file")


def quantize_weights_model(model, dtype: str, group: int | None, act: str | None):
    """(model, op type written) for the flags; ValueError naming the bad flag."""
    from powerfusion.ttile.onnx_lowbit import quantize_model_lowbit
    from powerfusion.ttile.onnx_quant import quantize_weights
    W = DTYPES[dtype]
    if group is None:
        group = 32 if W == "mxfp4" else 128
    if W in NBITS and not act:
        if group < 32 or group & (group - 1):
            raise ValueError(f"--group must be a power of two >= 32, got {group}")
        return quantize_weights(model, W, group), "MatMulNBits"
    try:
        return quantize_model_lowbit(model, W, group, act or ""), "MatMulLowBit"
    except ValueError as e:
        msg = str(e).replace("group size", "--group").replace("weight dtype", "--dtype")
        raise ValueError(msg.replace("int8 activations", "--act int8")) from None


def main(args) -> int:
    import onnx
    path, model = load_model(args.model)
    progress(f"quantising MatMul weights to {args.dtype}" + (" with int8 activations" if args.act else ""))
    try:
        out, op = quantize_weights_model(model, args.dtype, args.group, args.act)
    except ValueError as e:
        raise PowerFusionError(f"quantize-weights {args.model}: {e}") from None
    count = sum(n.op_type == op for n in out.graph.node)
    if not count:
        raise PowerFusionError(f"'{path}' has no MatMul whose weight (input 1) is a constant 2-D float "
                               "initializer: nothing to quantise")
    onnx.save(out, args.output)
    print(f"{args.model} -> {args.output}: {count} MatMul(s) as {op} ({args.dtype}"
          f"{', int8 activations' if args.act else ''}), {os.path.getsize(path)} -> "
          f"{os.path.getsize(args.output)} bytes")
    return 0
