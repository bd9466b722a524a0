"""Which ONNX ops automatic mixed precision may run in fp16 / bf16, and which stay in fp32.

Following the PAI notes: compute-bound ops start the conversion (tensor cores only take
16-bit operands); memory-bound ops on the white list carry it downstream (half the bytes);
everything else -- reductions' accumulators, exp / log / softmax statistics, normalisation
statistics, divisions and powers that overflow fp16's 65504 -- stays in fp32. Our kernels
compute elementwise arithmetic on 16-bit data in fp32 registers (powerfusion.scalar), so
the white list is about *storage* precision: an op is on it when rounding its output to
16 bits loses no more than the rounding its 16-bit inputs already carry.

Both lists are overridable: `AmpConfig(white=..., fp32=...)`, or `powerfusion convert
--fp16-ops OPS --fp32-ops OPS` to move single ops from one side to the other.
"""
from __future__ import annotations

# Compute-bound: where conversion starts (the cost rule still decides per node).
COMPUTE_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})

# Memory-bound ops that may run on 16-bit data once an input already is 16-bit.
WHITE_LIST = frozenset({
    # arithmetic and activations whose result is no larger than their inputs (or bounded)
    "Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Relu", "LeakyRelu", "PRelu", "Clip",
    "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Erf", "Gelu", "Where",
    # data movement: exact in any precision
    "Identity", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Slice",
    "Split", "Gather", "Expand", "Tile", "Pad", "DepthToSpace", "SpaceToDepth",
    # windows of a few elements
    "MaxPool", "AveragePool",
    # inference normalisation with constant statistics: one affine map per channel (folded into a
    # scale and a shift computed in float64 at import), bounded like Mul + Add. Without this every
    # Conv -> BatchNormalization -> Relu chain of a CNN went back to fp32 after the Conv and was
    # cast down again before the next one (30 casts in resnet_small; 4 with it)
    "BatchNormalization",
}) | COMPUTE_OPS

# Kept in fp32 whatever the white list says (documented reasons above).
FP32_LIST = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "InstanceNormalization",
    "GroupNormalization", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Div", "Softplus", "Mish",
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSumExp", "ReduceSumSquare", "GlobalAveragePool", "LpNormalization", "CumSum",
})

# Inputs that ONNX types separately from the data (they must keep their own type).
UNTYPED_INPUTS = {"Gather": (1,), "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4),
                  "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "Pad": (1, 3), "Where": (0,)}


def parse_op_list(text: str | None) -> frozenset[str]:
    """'Add, Mul' -> {'Add', 'Mul'} (empty or None -> empty set)."""
    return frozenset(t.strip() for t in (text or "").split(",") if t.strip())
