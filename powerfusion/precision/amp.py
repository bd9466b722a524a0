"""Automatic mixed precision as an ONNX graph rewrite (the PAI notes' four steps).

    convert_precision(model, "float16") -> model whose MatMul / Gemm / Conv and the
    white-listed ops downstream of them compute on 16-bit tensors

1. **White list** (`lists.py`): only listed ops may be converted; FP32_LIST ops never are.
2. **Propagation**: in topological order, a compute op (MatMul, Gemm, Conv) is a candidate
   by itself; a white-listed op is a candidate when one of its float inputs is already
   16-bit (so conversion flows downstream from the compute ops until an op off the list).
   An integer GEMM's dequantised result (Mul(Cast(MatMulInteger), scale), from a QDQ model)
   starts propagation too: the Mul stays fp32, its result is rounded to 16 bits, so the
   memory-bound ops after an int8 GEMM run on 16-bit tensors as after a 16-bit one.
3. **Cost rule** (`cost.py`): a candidate is converted only when its modelled time in 16 bits,
   including the casts its fp32 inputs then need, is below its time in fp32.
4. **Casts**: every converted node first gets a down-cast on each runtime fp32 input and an
   up-cast on each output (constants are converted offline); then **cast elimination**
   (`casts.py`) cancels each up-cast followed by the inverse down-cast, and casts nobody reads
   are dropped. The casts that remain are ordinary Cast nodes: the frontend turns them into
   elementwise basic ops, so the partition fuses them into the neighbouring memory-bound
   GIR kernels (cast fusion) rather than giving them kernels of their own.

Graph inputs and outputs keep their types, so a converted model is fed and read exactly like
the original; the result is standard ONNX (onnxruntime runs it where it has the kernels).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from powerfusion.errors import PowerFusionError
from powerfusion.precision.casts import eliminate_casts, remove_unused_casts
from powerfusion.precision.cost import CastCost, conversion_pays
from powerfusion.precision.lists import COMPUTE_OPS, FP32_LIST, UNTYPED_INPUTS, WHITE_LIST

INTEGER_GEMMS = ("MatMulInteger", "ConvInteger")

LOW_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
PRECISION_NAMES = {"fp32": None, "float32": None, "fp16": "float16", "float16": "float16",
                   "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class AmpConfig:
    """What to convert and by which cost figures. `cost_target` names the target whose
    bandwidth and peak FLOP/s decide whether a conversion pays (a GPU: AMP is for tensor cores)."""
    dtype: str = "float16"
    white: frozenset[str] = WHITE_LIST
    fp32: frozenset[str] = FP32_LIST
    cost_target: str = "h200"

    def with_ops(self, low: frozenset[str] = frozenset(), keep: frozenset[str] = frozenset()) -> "AmpConfig":
        """Move `low` onto the white list and `keep` onto the fp32 list."""
        return AmpConfig(self.dtype, (self.white | low) - keep, (self.fp32 - low) | keep, self.cost_target)


@dataclass
class AmpReport:
    """What the rewrite did: converted node names, and the candidates the cost rule kept in fp32."""
    converted: list[str] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)
    casts_inserted: int = 0
    casts_eliminated: int = 0
    casts_left: int = 0


def precision_dtype(name: str) -> str | None:
    """'fp16' -> 'float16', 'bf16' -> 'bfloat16', 'fp32' -> None; anything else is an error."""
    key = str(name).lower()
    if key not in PRECISION_NAMES:
        raise PowerFusionError(f"unknown precision {name!r}; choose fp32, fp16 or bf16")
    return PRECISION_NAMES[key]


def convert_precision(model: onnx.ModelProto, config: AmpConfig | str = "float16",
                      report: AmpReport | None = None) -> onnx.ModelProto:
    """A copy of `model` rewritten to mixed precision (see the module docstring)."""
    if isinstance(config, str):
        config = AmpConfig(dtype=precision_dtype(config) or "float32")
    if config.dtype not in LOW_TYPES:
        raise PowerFusionError(f"AMP converts to float16 or bfloat16, not {config.dtype!r}")
    report = report if report is not None else AmpReport()
    model = onnx.ModelProto.FromString(model.SerializeToString())
    # quantised MatMuls of a QDQ model first become integer GEMMs (MatMulInteger), which AMP
    # leaves alone; otherwise their float MatMul would be cast to 16 bits between the two
    # DequantizeLinear and the MatMul, and the int8 weight would run as a float GEMM
    from powerfusion.precision.integer_gemm import fuse_qdq_integer
    model = onnx.shape_inference.infer_shapes(fuse_qdq_integer(model))
    rw = _Rewriter(model, config, report)
    rw.run()
    report.casts_eliminated = eliminate_casts(model)
    remove_unused_casts(model)
    _drop_unused_initializers(model)
    report.casts_left = sum(n.op_type == "Cast" for n in model.graph.node) - rw.original_casts
    del model.graph.value_info[:]       # stale after renaming; consumers infer again
    return model


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, config: AmpConfig, report: AmpReport):
        self.model, self.config, self.report = model, config, report
        g = model.graph
        self.low = LOW_TYPES[config.dtype]
        self.types, self.shapes = _value_types(model)
        self.inits = {t.name: t for t in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output}
        self.low_tensors: set[str] = set()    # original names whose value is now 16-bit
        self.down: dict[str, str] = {}        # fp32 tensor -> its down-cast name
        self.const_low: dict[str, str] = {}   # fp32 initializer -> its 16-bit copy
        self.taken = {n for node in g.node for n in list(node.input) + list(node.output)} | set(self.inits)
        self.original_casts = sum(n.op_type == "Cast" for n in g.node)
        self.outputs = {o.name for o in g.output}
        self.cost = CastCost.for_target(config.cost_target, config.dtype)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def run(self) -> None:
        out = []
        for node in self.model.graph.node:
            out.extend(self._visit(node))
        del self.model.graph.node[:]
        self.model.graph.node.extend(out)

    def _float_inputs(self, node) -> list[int]:
        skip = UNTYPED_INPUTS.get(node.op_type, ())
        return [i for i, n in enumerate(node.input)
                if n and i not in skip and self.types.get(n) == TensorProto.FLOAT]

    def _visit(self, node) -> list:
        op, cfg = node.op_type, self.config
        if self._is_dequantized_product(node):
            return self._round_dequantized(node)
        if node.domain not in ("", "ai.onnx") or op in cfg.fp32 or op not in cfg.white:
            return [node]
        ins = self._float_inputs(node)
        outs = [o for o in node.output if o and self.types.get(o) == TensorProto.FLOAT]
        if not ins or not outs:
            return [node]
        if op not in COMPUTE_OPS and not any(node.input[i] in self.low_tensors for i in ins):
            return [node]       # propagation only: no 16-bit input reaches it
        if not _typed_for(node, ins, self.opset, self.config.dtype):
            self.report.declined.append(node.name or node.output[0])
            return [node]       # ONNX has no such kernel at this opset (bf16 Conv before opset 22)
        if not conversion_pays(node, [node.input[i] for i in ins], self, self.cost):
            self.report.declined.append(node.name or node.output[0])
            return [node]
        return self._convert(node, ins, outs)

    def _is_dequantized_product(self, node) -> bool:
        """Mul(Cast(MatMulInteger | ConvInteger, to=FLOAT), scale): an integer GEMM's result in
        float, as integer_gemm.fuse_qdq_integer writes it (not a graph output)."""
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or node.output[0] in self.outputs:
            return False
        cast = self.producer.get(node.input[0])
        if cast is None or cast.op_type != "Cast" or self.types.get(node.output[0]) != TensorProto.FLOAT:
            return False
        gemm = self.producer.get(cast.input[0])
        return gemm is not None and gemm.op_type in INTEGER_GEMMS

    def _round_dequantized(self, node) -> list:
        """An integer GEMM's dequantised result starts 16-bit propagation like a float GEMM's
        output: the Mul stays fp32 (the int32 sum exceeds fp16's range before the scale) and its
        result is rounded to 16 bits, Cast(Cast(y, low), FLOAT) named y, so that the converted
        consumers read the 16-bit value (cast elimination) and the others its fp32 copy."""
        y = node.output[0]
        node2 = onnx.NodeProto()
        node2.CopyFrom(node)
        wide = node2.output[0] = self._fresh(f"{y}_dequantized")
        low, down = self._down_cast(wide)
        self.low_tensors.add(y)
        self.report.converted.append(node.name or y)
        self.report.casts_inserted += 1
        return [node2, *down, helper.make_node("Cast", [low], [y], to=TensorProto.FLOAT, name=self._fresh(f"{y}_to_float"))]

    # -- queried by the cost rule --------------------------------------------------------

    def elements(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None or any(d is None for d in shape) else int(np.prod(shape, dtype=np.int64))

    def input_state(self, name: str) -> str:
        """'low' (already 16-bit), 'const' (converted offline), 'fused' (a memory-bound producer
        takes the cast) or 'alone' (a graph input or a library op's output: a cast of its own)."""
        if name in self.low_tensors or name in self.down:
            return "low"
        if name in self.inits:
            return "const"
        prod = self.producer.get(name)
        return "alone" if prod is None or prod.op_type in COMPUTE_OPS else "fused"

    # -- the rewrite ----------------------------------------------------------------------

    def _convert(self, node, ins: list[int], outs: list[str]) -> list:
        """Down-casts of runtime fp32 inputs, the node on 16-bit tensors, up-casts of its outputs."""
        before, after, node2 = [], [], onnx.NodeProto()
        node2.CopyFrom(node)
        for i in ins:
            name = node.input[i]
            if name in self.inits:
                node2.input[i] = self._const_copy(name)
            else:
                node2.input[i], cast = self._down_cast(name)
                before.extend(cast)
        for k, o in enumerate(node.output):
            if o not in outs:
                continue
            low_name = self._fresh(f"{o}_{self.config.dtype}")
            node2.output[k] = low_name
            after.append(helper.make_node("Cast", [low_name], [o], to=TensorProto.FLOAT,
                                          name=self._fresh(f"{o}_to_float")))
            self.low_tensors.add(o)
            self.report.casts_inserted += 1
        self.report.converted.append(node.name or node.output[0])
        return before + [node2] + after

    def _down_cast(self, name: str) -> tuple[str, list]:
        if name in self.down:
            return self.down[name], []
        low_name = self._fresh(f"{name}_{self.config.dtype}")
        self.down[name] = low_name
        self.report.casts_inserted += 1
        return low_name, [helper.make_node("Cast", [name], [low_name], to=self.low, name=self._fresh(low_name))]

    def _const_copy(self, name: str) -> str:
        if name not in self.const_low:
            array = numpy_helper.to_array(self.inits[name]).astype(np.float32)
            low_name = self._fresh(f"{name}_{self.config.dtype}")
            self.model.graph.initializer.append(_low_initializer(array, low_name, self.config.dtype))
            self.const_low[name] = low_name
        return self.const_low[name]

    def _fresh(self, base: str) -> str:
        from powerfusion.names import fresh_name
        return fresh_name(base, self.taken)


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    """fp32 originals of weights that only converted nodes read."""
    g = model.graph
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    keep = [t for t in g.initializer if t.name in read]
    if len(keep) < len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(keep)


def _typed_for(node, ins: list[int], opset: int, dtype: str) -> bool:
    """Whether the op's schema at `opset` admits `dtype` for each input we would convert."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    want = f"tensor({dtype})"
    for i in ins:
        formal = schema.inputs[min(i, len(schema.inputs) - 1)].type_str
        if formal in allowed and want not in allowed[formal]:
            return False
    return True


def _low_initializer(array: np.ndarray, name: str, dtype: str) -> TensorProto:
    if dtype == "float16":
        return numpy_helper.from_array(array.astype(np.float16), name)
    return helper.make_tensor(name, TensorProto.BFLOAT16, array.shape, array.astype(_bfloat16()).tobytes(), raw=True)


def _bfloat16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def _value_types(model: onnx.ModelProto) -> tuple[dict, dict]:
    """Element type and shape (None for unknown dims) of every tensor shape inference typed."""
    types, shapes = {}, {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.elem_type:
            types[vi.name] = tt.elem_type
            if tt.HasField("shape"):
                shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
    for t in g.initializer:
        types[t.name], shapes[t.name] = t.data_type, tuple(t.dims)
    return types, shapes
