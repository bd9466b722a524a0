"""PowerFusion as an `onnx.backend.base.Backend`, so ONNX's backend test runner plugs in:

    import onnx.backend.test
    from powerfusion.backend import PowerFusionBackend
    suite = onnx.backend.test.BackendTest(PowerFusionBackend, __name__)

Devices: "CPU" always; "CUDA" when the CUDA runtime, CuPy and a GPU are present.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from powerfusion.errors import FeedError
from powerfusion.session import InferenceSession

_TARGETS = {DeviceType.CPU: "cpu", DeviceType.CUDA: "cuda"}


def cuda_available() -> bool:
    """CUDA runs need our CUDA runtime module, CuPy and at least one device."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        if importlib.util.find_spec("powerfusion.backends.cuda.session") is None:
            return False
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # CuPy without a driver raises its own CUDARuntimeError
        return False


class PowerFusionBackendRep(BackendRep):
    """A prepared model: `run(inputs)` takes arrays in graph-input order (or a dict) and returns outputs."""

    def __init__(self, session: InferenceSession, input_names: list[str]):
        self.session = session
        self.input_names = input_names

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            inputs = list(inputs)
            if len(inputs) != len(self.input_names):
                raise FeedError(f"got {len(inputs)} input(s); the model takes {len(self.input_names)}: "
                                f"{self.input_names}")
            feeds = dict(zip(self.input_names, inputs))
        names = [o.name for o in self.session.get_outputs()]
        return namedtupledict("Outputs", names)(*self.session.run(None, feeds))


class PowerFusionBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> PowerFusionBackendRep:
        """Import and partition `model`; kwargs: shapes, options (as for InferenceSession)."""
        target = cls._target(device)
        session = InferenceSession(model, target=target, shapes=kwargs.get("shapes"),
                                   options=kwargs.get("options"))
        initializers = {t.name for t in model.graph.initializer}
        names = [i.name for i in model.graph.input if i.name not in initializers]
        return PowerFusionBackendRep(session, names)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None, **kwargs: Any):
        """One node as a one-node model; output types from `outputs_info` or from shape inference."""
        from onnx import helper
        inputs = list(inputs)
        names = [n for n in node.input if n]
        graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(x).dtype),
                                                      np.asarray(x).shape) for n, x in zip(names, inputs)]
        if outputs_info is not None:
            graph_outputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)
                             for n, (dt, shape) in zip(node.output, outputs_info)]
        else:
            graph_outputs = [helper.make_empty_tensor_value_info(n) for n in node.output if n]
        opset = kwargs.pop("opset_version", None)
        model = helper.make_model(helper.make_graph([node], "run_node", graph_inputs, graph_outputs),
                                  opset_imports=[helper.make_opsetid("", opset)] if opset else None)
        if outputs_info is None:
            model = _typed_outputs(model)
        return cls.run_model(model, dict(zip(names, inputs)), device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        kind = Device(device).type
        if kind == DeviceType.CPU:
            return True
        return kind == DeviceType.CUDA and cuda_available()

    @classmethod
    def _target(cls, device: str) -> str:
        kind = Device(device).type
        return _TARGETS.get(kind, "cpu")


def _typed_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fill the outputs' types from shape inference (run_node without outputs_info)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in model.graph.output:
        if out.name in known:
            out.CopyFrom(known[out.name])
    return model


prepare = PowerFusionBackend.prepare
run_model = PowerFusionBackend.run_model
run_node = PowerFusionBackend.run_node
supports_device = PowerFusionBackend.supports_device
