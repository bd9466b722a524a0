"""One ONNX node run on given inputs at the model's opset: with onnx.reference, or with
onnxruntime (an optional dependency). Constant folding (fold.py) evaluates nodes on constants
with them; the support check (converters.py) runs a node on zeros to name invalid inputs."""
from __future__ import annotations

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator


def _one_node_model(node, feeds, opset) -> onnx.ModelProto:
    """A model of `node` alone at the given opset (a bare NodeProto would run at the latest one)."""
    inputs = [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    outputs = [onnx.helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = onnx.helper.make_graph([node], "fold", inputs, outputs)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


def evaluate_reference(node, feeds, opset):
    """Run one node at the model's opset."""
    values = ReferenceEvaluator(_one_node_model(node, feeds, opset)).run(None, feeds)
    it = iter(values)
    return [next(it) if o else None for o in node.output]


def evaluate_onnxruntime(node, feeds, opset):
    """The same in onnxruntime (an optional dependency: ImportError when it is absent)."""
    import onnxruntime as ort
    model = _one_node_model(node, feeds, opset)
    model.ir_version = 8  # a version every onnxruntime reads; the opset carries the semantics
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    values = dict(zip([o for o in node.output if o], sess.run(None, feeds)))
    return [np.asarray(values[o]) if o else None for o in node.output]
