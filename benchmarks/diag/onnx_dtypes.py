"""Which element types an exported model's compute ops see: `python benchmarks/diag/onnx_dtypes.py MODEL.onnx`
prints (op type, input element types) -> count after ONNX shape inference, and, through the
importer, the basic MatMul nodes by operand dtype (to find an exporter's fp32 islands in an
fp16 model)."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(path: str) -> None:
    import onnx
    from onnx import shape_inference
    m = shape_inference.infer_shapes(onnx.load(path))
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.input)}
    types.update({i.name: i.data_type for i in m.graph.initializer})
    name = {v: k for k, v in onnx.TensorProto.DataType.items()}
    ops = collections.Counter()
    for n in m.graph.node:
        if n.op_type in ("MatMul", "Gemm", "LayerNormalization", "Softmax", "Cast", "Add", "Mul"):
            ops[(n.op_type, tuple(name.get(types.get(i), "?") for i in n.input if i))] += 1
    for k, v in sorted(ops.items(), key=lambda kv: -kv[1]):
        print(v, *k)
    from powerfusion.basic import MatMul
    from powerfusion.frontend import import_model
    g = import_model(path)
    mm = collections.Counter((str(g.tensors[n.inputs[0]].dtype), str(g.tensors[n.inputs[1]].dtype))
                             for n in g.nodes if isinstance(n.op, MatMul))
    print("basic MatMul operand dtypes:", dict(mm))


if __name__ == "__main__":
    main(sys.argv[1])
