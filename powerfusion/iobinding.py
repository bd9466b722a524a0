"""onnxruntime's `OrtValue` and `IOBinding`, over numpy (device "cpu") and CuPy (device "cuda")
arrays, so that onnxruntime scripts that bind device buffers run unchanged.

    binding = sess.io_binding()
    binding.bind_input("x", "cuda", 0, np.float32, x.shape, x.data.ptr)   # or bind_ortvalue_input
    binding.bind_output("y", "cuda")                                      # a fresh device array per run
    sess.run_with_iobinding(binding)
    y = binding.get_outputs()[0]          # OrtValue: .numpy(), .data_ptr(), .shape(), __dlpack__

On the cuda target bound device inputs are read where they lie and outputs with a buffer are
written where they lie (with `options={"cuda_graph": True}` through one device-to-device copy
each way, or, once a binding of device buffers has run three times, through a graph captured
for those buffers; see backends/cuda/bound.py). A binding is checked and prepared at its
first run and repeated until a bind_* or clear_* call changes it. `bind_array(name, array)` binds any numpy / CuPy /
torch / DLPack array directly (an extension; onnxruntime has no such call).
"""
from __future__ import annotations

import ctypes

import numpy as np
from onnx import helper

from powerfusion.errors import FeedError, PowerFusionError

DEVICES = ("cpu", "cuda")


def _device(device_type: str) -> str:
    name = str(device_type).lower()
    if name == "gpu":
        name = "cuda"
    if name not in DEVICES:
        raise PowerFusionError(f"device_type {device_type!r}: PowerFusion binds buffers on {list(DEVICES)}")
    return name


class OrtValue:
    """A tensor on the host (numpy) or a GPU (CuPy), with onnxruntime's OrtValue methods."""

    def __init__(self, array, device: str = "cpu", device_id: int = 0):
        self._array, self._device, self._device_id = array, device, device_id

    # ---- onnxruntime's constructors ----
    @staticmethod
    def ortvalue_from_numpy(numpy_obj, device_type: str = "cpu", device_id: int = 0) -> "OrtValue":
        device = _device(device_type)
        array = np.asarray(numpy_obj, order="C")
        if device == "cuda":
            import cupy
            with cupy.cuda.Device(device_id):
                array = cupy.asarray(_bits(array))
        return OrtValue(array, device, device_id)

    @staticmethod
    def ortvalue_from_shape_and_type(shape, element_type, device_type: str = "cpu", device_id: int = 0) -> "OrtValue":
        device = _device(device_type)
        dtype = np.dtype(element_type)
        if device == "cuda":
            import cupy
            with cupy.cuda.Device(device_id):
                return OrtValue(cupy.empty(tuple(shape), dtype=_bits_dtype(dtype)), device, device_id)
        return OrtValue(np.empty(tuple(shape), dtype=dtype), device, device_id)

    @staticmethod
    def from_dlpack(data, is_bool_tensor: bool = False) -> "OrtValue":
        from powerfusion.device_arrays import as_cupy, is_device_array
        if is_device_array(data):
            array = as_cupy(data)
            return OrtValue(array, "cuda", array.device.id)
        return OrtValue(np.from_dlpack(data), "cpu", 0)

    # ---- onnxruntime's accessors ----
    def numpy(self) -> np.ndarray:
        """A host copy, as onnxruntime gives: the buffer may belong to someone else."""
        return self._array.get() if self._device == "cuda" else self._array.copy()

    def data_ptr(self) -> int:
        return int(self._array.data.ptr) if self._device == "cuda" else int(self._array.ctypes.data)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def device_name(self) -> str:
        return self._device

    def data_type(self) -> str:
        """onnxruntime's type string, e.g. "tensor(float)"."""
        name = np.dtype(self._array.dtype).name
        name = {"float32": "float", "float64": "double"}.get(name, name)
        return f"tensor({name.replace('_', '')})"

    def element_type(self) -> int:
        return helper.np_dtype_to_tensor_dtype(np.dtype(self._array.dtype))

    def is_tensor(self) -> bool:
        return True

    def has_value(self) -> bool:
        return True

    def tensor_size_in_bytes(self) -> int:
        return int(self._array.nbytes)

    def update_inplace(self, np_arr) -> None:
        if self._device == "cuda":
            self._array.set(_bits(np.asarray(np_arr, order="C")))
        else:
            np.copyto(self._array, np_arr)

    # ---- beyond onnxruntime: the array itself, and DLPack for torch / CuPy / JAX ----
    @property
    def array(self):
        return self._array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class IOBinding:
    """Inputs and outputs bound to buffers for `InferenceSession.run_with_iobinding`."""

    def __init__(self, session):
        self._session = session
        self._inputs: dict[str, OrtValue] = {}
        self._outputs: dict[str, tuple[str, int, OrtValue | None]] = {}   # name -> (device, id, buffer)
        self._results: dict[str, OrtValue] = {}
        self._prepared = None   # the run for the current bindings (_prepare), made at the first run

    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        self._prepared = None
        self._inputs[name] = OrtValue(np.asarray(arr_on_cpu), "cpu")

    def bind_input(self, name: str, device_type, device_id: int, element_type, shape, buffer_ptr: int) -> None:
        """A buffer given by address (onnxruntime's form), e.g. a CuPy array's `data.ptr`."""
        device = _device(device_type)
        self._prepared = None
        self._inputs[name] = OrtValue(_wrap(buffer_ptr, shape, element_type, device, device_id), device, device_id)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._prepared = None
        self._inputs[name] = _as_ortvalue(ortvalue, name)

    def bind_output(self, name: str, device_type="cpu", device_id: int = 0, element_type=None, shape=None,
                    buffer_ptr: int | None = None) -> None:
        """Without `buffer_ptr`, every run gives a fresh array on that device."""
        device = _device(device_type)
        buffer = None
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise PowerFusionError(f"bind_output('{name}'): a buffer_ptr needs element_type and shape")
            buffer = OrtValue(_wrap(buffer_ptr, shape, element_type, device, device_id), device, device_id)
        self._prepared = None
        self._outputs[name] = (device, device_id, buffer)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        value = _as_ortvalue(ortvalue, name)
        self._prepared = None
        self._outputs[name] = (value.device_name(), value._device_id, value)

    def bind_array(self, name: str, array) -> None:
        """Any numpy / CuPy / torch / DLPack array as input `name` (read in place on the GPU)."""
        self._prepared = None
        self._inputs[name] = _as_ortvalue(array, name)

    def clear_binding_inputs(self) -> None:
        self._prepared = None
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._prepared = None
        self._outputs.clear()
        self._results = {}

    def synchronize_inputs(self) -> None:
        _synchronize(self._inputs.values())

    def synchronize_outputs(self) -> None:
        _synchronize(self._results.values())

    def get_outputs(self) -> list[OrtValue]:
        return [self._results[n] for n in self._outputs if n in self._results]

    def get_outputs_as_ortvaluevector(self) -> list[OrtValue]:
        return self.get_outputs()

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [v.numpy() for v in self.get_outputs()]

    def run(self) -> None:
        """What `InferenceSession.run_with_iobinding(binding)` does: the first run after a change
        of bindings checks them and prepares the run; later runs repeat it."""
        prepared = self._prepared
        if prepared is None:
            prepared = self._prepared = self._prepare()
        self._results = prepared()

    def _prepare(self):
        """`() -> {output: OrtValue}` for the current bindings. An output bound to a buffer comes
        back as that buffer's OrtValue, the same object at every run; the others as new ones."""
        feeds = {name: value.array for name, value in self._inputs.items()}
        wanted = {name: (device, None if buf is None else buf.array) for name, (device, _, buf) in self._outputs.items()}
        run = self._session.prepare_bound(feeds, wanted)
        outputs = [(name, device, device_id, buf) for name, (device, device_id, buf) in self._outputs.items()]
        if all(buf is not None and device == "cuda" for _, device, _, buf in outputs):
            # on the GPU every output is written into its own buffer (in place or by a device copy)
            results = {name: buf for name, _, _, buf in outputs}

            def into_buffers() -> dict:   # the same dict at every run: nothing changes it in place
                run()
                return results
            return into_buffers

        def wrapped() -> dict:
            arrays = run()
            return {name: buf if buf is not None and arrays[name] is buf.array else OrtValue(arrays[name], device, device_id)
                    for name, device, device_id, buf in outputs}
        return wrapped


def _as_ortvalue(value, name: str) -> OrtValue:
    from powerfusion.device_arrays import as_cupy, is_device_array
    if isinstance(value, OrtValue):
        return value
    if is_device_array(value):
        array = as_cupy(value, f"'{name}'")
        return OrtValue(array, "cuda", array.device.id)
    return OrtValue(np.asarray(value), "cpu")


def _wrap(ptr: int, shape, element_type, device: str, device_id: int):
    """An array over memory the caller owns (no copy): numpy on the host, CuPy on a GPU."""
    dtype = np.dtype(element_type)
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not ptr:
        raise FeedError("bind: buffer_ptr is 0")
    if device == "cuda":
        import cupy
        memory = cupy.cuda.UnownedMemory(int(ptr), nbytes, owner=None, device_id=device_id)
        return cupy.ndarray(shape, dtype=_bits_dtype(dtype), memptr=cupy.cuda.MemoryPointer(memory, 0))
    raw = (ctypes.c_byte * nbytes).from_address(int(ptr))
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _bits_dtype(dtype: np.dtype) -> np.dtype:
    """CuPy has no bfloat16: its device buffers hold the bits as uint16."""
    return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def _synchronize(values) -> None:
    if any(v.device_name() == "cuda" for v in values):
        import cupy
        cupy.cuda.get_current_stream().synchronize()
