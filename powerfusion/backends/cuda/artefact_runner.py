"""Running a compiled folder (powerfusion/artefact.py) on one GPU, from plan.json alone:
the kernel sources are compiled by NVRTC (disk-cached) and launched with the grid, block and
parameters plan.json gives; MatMul / Conv go through cuBLAS (CuPy); tensors live in one arena
at plan.json's offsets. No import, partition or search runs. One run at a time (the session
holds a lock); no CUDA-graph capture on this path yet."""
from __future__ import annotations

import numpy as np

from powerfusion.errors import PowerFusionError


class ArtefactRunner:
    def __init__(self, artefact, device_id: int = 0):
        import cupy
        from powerfusion.backends.cuda.executor import device_dtype
        from powerfusion.basic import Attention, Conv, MatMul
        self.artefact, self.graph, self.device_id = artefact, artefact.graph, device_id
        self.use_cuda_graph = False
        plan, folder = artefact.plan, artefact.folder
        self.arena = cupy.empty(max(int(plan["arena_bytes"]), 1), dtype=np.uint8)
        self.tensors, self.constants = {}, {}
        for name, t in plan["tensors"].items():
            info = self.graph.tensors[name]
            dt = device_dtype(np.dtype(info.dtype).name)
            if t.get("offset") is not None:
                off = int(t["offset"])
                self.tensors[name] = self.arena[off:off + info.size * dt.itemsize].view(dt).reshape(info.shape)
            if t.get("file"):
                self.constants[name] = cupy.asarray(_device_array(_load(folder, t["file"]), dt))
        self.steps = []
        for step in plan["steps"]:
            if step["kind"] == "kernels":
                self.steps.append(("kernels", [_load_kernel(folder, k) for k in step["kernels"]],
                                   _scratch(folder, step["scratch"])))
            else:
                attrs = {k: tuple(v) if isinstance(v, list) else v for k, v in step["attributes"].items()}
                op = {"matmul": MatMul, "conv": Conv, "attention": Attention}[step["op"]](**attrs)
                self.steps.append(("library", op, step, _decode_route(self.graph, op, step, device_id)))

    def __call__(self, feeds: dict) -> dict:
        from powerfusion.backends.cuda.session import _to_host
        out = self.run_device(feeds)
        return {n: _to_host(v, self.graph.tensors[n].dtype) for n, v in out.items()}

    def run_device(self, feeds: dict, names=None, into: dict | None = None) -> dict:
        import cupy
        from powerfusion.backends.cuda.executor import raise_first_fault
        from powerfusion.backends.cuda.session import _device_layout
        names = [t.name for t in self.graph.outputs] if names is None else list(names)
        with cupy.cuda.Device(self.device_id):
            for t in self.graph.inputs:
                self.tensors[t.name][...] = _device_layout(feeds[t.name])
            for step in self.steps:
                self._run(step)
            out = {}
            for n in names:
                target = (into or {}).get(n)
                if target is None:
                    out[n] = self.tensors[n].copy()
                else:
                    target[...] = self.tensors[n].reshape(target.shape)
                    out[n] = target
            cupy.cuda.get_current_stream().synchronize()
            raise_first_fault([(k["fault_word"], k["faults"]) for step in self.steps if step[0] == "kernels"
                               for k in step[1] if k["fault_word"] is not None])
        return out

    def _run(self, step) -> None:
        if step[0] == "kernels":
            _, kernels, scratch = step
            for k in kernels:
                args = [self._param(p, scratch) for p in k["params"]]
                k["function"].launch(tuple(k["grid"]), tuple(k["block"]), args, shared_mem=int(k["shared_bytes"]))
            return
        from powerfusion.backends.cuda import library
        from powerfusion.basic import Attention, MatMul, attention_bias, attention_operands
        _, op, s, decode = step
        ins = [self.constants[t] if t in self.constants else self.tensors[t] for t in s["inputs"]]
        if decode is not None:   # a decode step: the split-KV kernel writes the output itself
            decode(ins[0], ins[1], ins[2], self.tensors[s["outputs"][0]], *ins[3:5])
            return
        bf16 = self.artefact.plan["tensors"][s["inputs"][0]]["dtype"] == "bfloat16"
        logical = "bfloat16" if bf16 else None
        if isinstance(op, MatMul):
            y = library.matmul(ins[0], ins[1], ins[2] if op.bias else None, trans_a=op.trans_a, trans_b=op.trans_b,
                               logical_dtype=logical)
        elif isinstance(op, Attention):
            y = library.attention(*attention_operands(op, ins), attention_bias(op, ins), scale=op.scale,
                                  nan_to_zero=op.nan_to_zero, out_perm=op.out_perm, out_shape=op.out_shape,
                                  logical_dtype=logical)
        else:
            import cupy
            x, w = (cupy.moveaxis(a, -1, 1) for a in ins[:2]) if op.channels_last else ins[:2]
            y = library.conv(x, w, ins[2] if len(ins) > 2 else None, strides=op.strides,
                             pads=tuple(op.pad_begins) + tuple(op.pad_ends), dilations=op.dilations,
                             group=op.group, logical_dtype=logical)
            if op.channels_last:   # NHWC operands (frontend/layout.py)
                y = cupy.moveaxis(y, 1, -1)
        out = self.tensors[s["outputs"][0]]
        out[...] = y.reshape(out.shape)

    def _param(self, p: dict, scratch: dict):
        from powerfusion.backends.cuda.executor import device_dtype
        tensor = p.get("tensor")
        if tensor is not None and tensor in self.tensors:
            a = self.tensors[tensor].reshape(-1)
        elif tensor is not None and tensor in self.constants:
            a = self.constants[tensor].reshape(-1)
        elif p["buffer"] in scratch:
            a = scratch[p["buffer"]]
        else:
            raise PowerFusionError(f"compiled folder: kernel parameter '{p['buffer']}' (tensor {tensor}) has no buffer")
        if a.dtype != device_dtype(p["dtype"]):
            raise PowerFusionError(f"compiled folder: parameter '{p['buffer']}' is {p['dtype']}, its buffer {a.dtype}")
        return a


def _load(folder, name: str) -> np.ndarray:
    return np.load(folder / name, allow_pickle=False)   # never pickles from a folder


def _device_array(host: np.ndarray, dt: np.dtype) -> np.ndarray:
    """A saved constant in the device's layout: bf16 (ml_dtypes, or raw 2-byte records) as uint16 bits."""
    if host.dtype.name == "bfloat16" or (host.dtype.kind == "V" and host.dtype.itemsize == 2):
        return np.asarray(host, order="C").view(np.uint16)
    return np.asarray(host.astype(dt, copy=False), order="C")


def _load_kernel(folder, k: dict) -> dict:
    from powerfusion.backends.cuda.runtime import compile_source
    from powerfusion.backends.cstyle.faults import FAULT_WORD, fault_sites
    source = (folder / k["file"]).read_text()
    module = compile_source(source, name=k["name"])
    function = module.kernel(k["name"])
    faults = fault_sites(source)   # integer division by zero, checked after each run
    if int(k["shared_bytes"]) > 48 * 1024:   # above 48 KB a kernel must opt in to dynamic shared memory
        from cupy.cuda import driver
        driver.funcSetAttribute(function.function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                int(k["shared_bytes"]))
    return {**k, "function": function, "faults": faults, "fault_word": module.word(FAULT_WORD) if faults else None}


def _scratch(folder, entries: list) -> dict:
    import cupy
    from powerfusion.backends.cuda.executor import device_dtype
    out = {}
    for e in entries:
        dt = device_dtype(e["dtype"])
        if e.get("constant_file"):
            out[e["buffer"]] = cupy.asarray(_device_array(_load(folder, e["constant_file"]).reshape(-1), dt))
        else:
            out[e["buffer"]] = cupy.empty(int(e["elements"]), dtype=dt)
    return out


def make_artefact_executor(artefact, options):
    if getattr(options, "fp32_matmul", "fp32") != "fp32":   # its GEMMs are CuPy's, not routed through Ape
        raise PowerFusionError(f"fp32_matmul={options.fp32_matmul!r} needs a session built from the .onnx file; "
                               f"the compiled folder '{artefact.folder}' runs its GEMMs as exact fp32 only")
    try:
        import cupy
    except ImportError as e:
        raise PowerFusionError(f"'{artefact.folder}' holds CUDA kernels; running it needs CuPy and a GPU ({e})") from None
    device_id = int(getattr(options, "device_id", 0))
    with cupy.cuda.Device(device_id):
        return ArtefactRunner(artefact, device_id)


def _decode_route(graph, op, step: dict, device_id: int):
    """The split-KV kernel (decode_attention.py) for an Attention step of decode shape, else None."""
    from types import SimpleNamespace

    from powerfusion.backends.cuda import decode_attention
    from powerfusion.basic import Attention
    if not isinstance(op, Attention):
        return None
    node = SimpleNamespace(name=step["node"], op=op, inputs=tuple(step["inputs"]))
    routes, _ = decode_attention.plan_decode(graph, [node], device_id)
    return routes.get(node.name)
