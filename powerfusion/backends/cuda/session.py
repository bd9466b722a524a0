"""The CUDA target of InferenceSession: a compiled Plan run on one GPU.

Buffers are planned once per session (one arena, reused across runs, tensors that are
never live together share memory); library calls go through cuBLAS (CuPy), memory-bound
subgraphs through their generated kernels, TypedMatMul (low-bit weights) through a typed
GEMM of powerfusion.ttile built and uploaded once per session. With `cuda_graph=True` the
whole run is captured once and replayed."""
from __future__ import annotations

import numpy as np

from powerfusion.errors import PowerFusionError
from powerfusion.basic import Attention, Conv, MatMul, TypedMatMul, attention_bias, attention_operands
from powerfusion.backends.cuda.executor import device_dtype
from powerfusion.gir.interpreter import np_dtype
from powerfusion.plan import KernelStep, LibraryStep, Plan
from powerfusion.runtime.buffers import TensorLife, plan_buffers


def cupy_dtype(dt) -> np.dtype:
    return device_dtype(np.dtype(dt).name)


BOUND_GRAPHS = 8   # graphs captured for IO bindings' own buffers, per session (each a few KB of host and device memory)


class CudaPlanRunner:
    def __init__(self, plan: Plan, cuda_graph: bool = False, device_id: int = 0, fp32_matmul: str = "fp32"):
        import cupy
        self.device_id = device_id
        from powerfusion.backends.cuda.executor import GIRExecutor
        self.plan, self.graph = plan, plan.graph
        g = self.graph
        from powerfusion.targets.specs import get_target
        # a cuda plan's kernels were rendered by the CUDA renderer at compile time: not again here
        rendered = get_target(plan.target).backend == "cuda"
        if rendered:   # every kernel compiled at once on the usable cores, then loaded from the cache
            from powerfusion.backends.cuda.runtime import precompile_sources
            precompile_sources([(ks.source, (), ks.name) for s in plan.kernel_steps for ks in s.kernels])
        self.executors = {s.name: GIRExecutor(s.gir, sources=s.kernels if rendered else None)
                          for s in plan.kernel_steps}
        self.constants = {}
        self.typed = {}
        for s in plan.library_steps:
            if isinstance(s.call.node.op, TypedMatMul):  # its constants travel packed, built once
                mm, packed = typed_gemm(g, s.call.node)
                # fp32 models: the kernel reads fp16 activations from a buffer allocated once
                a16 = cupy.empty((mm.M, mm.K), np.float16) if _is_fp32(g, s.call.node) else None
                self.typed[s.call.node.name] = (mm, mm.to_device(packed), a16)
                continue
            for t in s.call.node.inputs:
                if t in g.constants and t not in self.constants:
                    self.constants[t] = cupy.asarray(_to_device_layout(np.asarray(g.constants[t])))
        self.tensors = self._plan_tensors(cupy)
        # GIR buffers hold at least one element: a kernel given an empty tensor gets a
        # placeholder of its buffer's size instead (allocated here, so graph capture sees none)
        self.placeholders = {(s.name, b): cupy.zeros(s.gir.buffer(b).size, dtype=device_dtype(s.gir.buffer(b).dtype))
                             for s in plan.kernel_steps for b, t in s.buffers.items()
                             if (b in s.gir.inputs or b in s.gir.outputs) and t in self.tensors
                             and self.tensors[t].size == 0}
        self._cuda_graph = None
        self.use_cuda_graph = cuda_graph
        self._fault_checks = None   # fault_checks(), made at the first run
        self._bound_graphs: dict = {}   # bound_graph(): IO-binding buffers -> graph reading them in place
        self._blas = None          # our cuBLAS handle (blas.Blas), made at the first library call
        self._lt = None            # our cuBLASLt handle (blaslt.BlasLt), made at the first bias GEMM
        self._direct: set[str] = set()   # library steps that ran through it
        self._cols: dict = {}      # im2col buffers of the direct Conv path, one per shape
        self._int8 = None          # int8 GEMMs on our cuBLAS handle (int8_gemm.Int8Gemm), made when needed
        from powerfusion.backends.cuda import ape_route
        self._ape = ape_route.router(fp32_matmul)   # fp32 GEMMs through powerfusion.ape, or None
        self._plan_convs(cupy)
        self._plan_attention(cupy)

    def _plan_attention(self, cupy) -> None:
        """Each Attention step's route, chosen once here: the split-KV kernel for decode shapes
        (decode_attention.py; the stand-in for a call whose arrays it does not suit), a cuDNN
        graph (cudnn_attention.py), all sharing one workspace allocated now, or the cuBLAS + CuPy
        stand-in with the reason in `fallbacks`."""
        from powerfusion.backends.cuda import cudnn_attention, decode_attention
        nodes = [s.call.node for s in self.plan.library_steps if isinstance(s.call.node.op, Attention)]
        # decode shapes (a few query rows) through our split-KV kernel, the rest through cuDNN
        self.decodes, _ = decode_attention.plan_decode(self.graph, nodes, self.device_id)
        nodes = [n for n in nodes if n.name not in self.decodes]
        self.attentions, why = cudnn_attention.plan_attention(self.graph, nodes, self.device_id)
        self.fallbacks.update(why)
        need = max((a.workspace_bytes for a in self.attentions.values()), default=0)
        self._attention_workspace = cupy.empty(need, dtype=np.uint8) if need else None

    def _plan_convs(self, cupy) -> None:
        """Each Conv step's route, chosen once here: a cuDNN graph built for its shapes
        (cudnn_conv.py), all sharing one workspace allocated now (before any capture), or
        im2col + cuBLAS with the reason in `fallbacks`."""
        from powerfusion.backends.cuda import cudnn_conv
        convs = [s.call.node for s in self.plan.library_steps if isinstance(s.call.node.op, Conv)]
        ape = []   # fp32 convs under fp32_matmul=<Ape mode> run through their GEMM, which Ape emulates
        if self._ape is not None:
            ape = [n for n in convs if np.dtype(self.graph.tensors[n.inputs[0]].dtype) == np.float32]
        self.convs, self.fallbacks = cudnn_conv.plan_convs(self.graph, [n for n in convs if n not in ape],
                                                           self.device_id)
        for node in ape:
            self.fallbacks[node.name] = f"fp32_matmul={self._ape.mode}: im2col + the Ape-emulated GEMM"
        self.conv_routes = {n: f"im2col + cuBLAS (cuDNN not used: {why})" for n, why in self.fallbacks.items()}
        for node in convs:
            if node.name in self.convs:
                self._prefer_faster_conv(node, self.convs[node.name])
        for node in convs:
            if node.name in self.fallbacks and len(self.graph.tensors[node.inputs[0]].shape) > 4:
                raise PowerFusionError(f"Conv '{node.name}': a 3-D convolution needs cuDNN here (im2col + cuBLAS "
                                       f"runs 1-D and 2-D); {self.fallbacks[node.name]}")
        need = max((c.workspace_bytes for c in self.convs.values()), default=0)
        self._conv_workspace = cupy.empty(need, dtype=np.uint8) if need else None

    def _prefer_faster_conv(self, node, conv) -> None:
        """Keep cuDNN for this Conv unless our im2col + cuBLAS path runs it faster (timed once on
        scratch buffers); the choice and both times go to `conv_routes`."""
        import cupy
        from powerfusion.backends.cuda import blas, cudnn_conv, library
        op = node.op
        engine = f"cuDNN {conv.plan_name} {conv.time_us:.1f} us"
        if not blas.available() or op.channels_last:   # channels-last: im2col would transpose twice
            self.conv_routes[node.name] = engine + (" (channels-last)" if op.channels_last else "")
            return
        if self._blas is None:
            self._blas = blas.Blas()
        self._blas.bind(cupy.cuda.get_current_stream())
        x, w, b, y = cudnn_conv.scratch(conv.shape)
        cols: dict = {}
        logical = "bfloat16" if conv.shape.dtype == "bfloat16" else None

        def im2col() -> bool:
            return library.conv_into(self._blas, x, w, b, y, cols, strides=op.strides,
                                     pads=tuple(op.pad_begins) + tuple(op.pad_ends), dilations=op.dilations,
                                     group=op.group, logical_dtype=logical)
        if not im2col():   # the im2col path declines this conv: cuDNN it is
            self.conv_routes[node.name] = engine
            return
        us = cudnn_conv.time_us(im2col, self._blas.bind)
        if us < conv.time_us:
            del self.convs[node.name]
            self.conv_routes[node.name] = f"im2col + cuBLAS {us:.1f} us (faster than {engine})"
        else:
            self.conv_routes[node.name] = f"{engine} (im2col + cuBLAS {us:.1f} us)"

    @property
    def library_routes(self) -> dict[str, str]:
        """Library call -> how its fp32 GEMMs ran ("ape <mode>: ..." or "cublas: <why>"); empty
        with fp32_matmul="fp32" (everything on cuBLAS)."""
        return {} if self._ape is None else self._ape.routes

    def _plan_tensors(self, cupy) -> dict:
        g, steps = self.graph, self.plan.steps
        first, last = {t.name: -1 for t in g.inputs}, {}
        for k, s in enumerate(steps):
            node_ins, node_outs = _step_io(s)
            for t in node_outs:
                first.setdefault(t, k)
            for t in node_ins:
                if t not in g.constants:
                    last[t] = k
        # Inputs stay live to the end like outputs: a captured graph replayed on its own (as
        # the benchmarks time it) must find the inputs it was fed, not a later tensor's bytes.
        for t in [*g.outputs, *g.inputs]:
            last[t.name] = len(steps)
        lives = [TensorLife(t, max(g.tensors[t].nbytes, 1), first[t], last.get(t, first[t])) for t in first]
        bplan = plan_buffers(lives)
        self.arena = cupy.empty(max(bplan.arena_bytes, 1), dtype=np.uint8)
        views = {}
        for t, off in bplan.offsets.items():
            info = g.tensors[t]
            dt = cupy_dtype(info.dtype)
            views[t] = self.arena[off:off + info.size * dt.itemsize].view(dt).reshape(info.shape)
        return views

    def _run_steps(self, steps=None, env=None) -> None:
        from powerfusion.backends.cuda import library
        env = self.tensors if env is None else env
        for s in self.plan.steps if steps is None else steps:
            if isinstance(s, KernelStep):
                ex = self.executors[s.name]
                arrays = {b: self.placeholders.get((s.name, b), env[t].reshape(-1)) for b, t in s.buffers.items()
                          if (b in s.gir.inputs or b in s.gir.outputs) and t in env}
                ex(arrays)
                continue
            node = s.call.node
            if isinstance(node.op, TypedMatMul):
                self._run_typed(node, env)
                continue
            ins = [self.constants[t] if t in self.constants else env[t] for t in node.inputs]
            logical = np.dtype(self.graph.tensors[node.inputs[0]].dtype).name
            bf16 = logical == "bfloat16"
            if self._library_direct(node, ins, env[node.outputs[0]], "bfloat16" if bf16 else None):
                self._direct.add(node.name)
                continue
            if isinstance(node.op, MatMul):
                y = library.matmul(ins[0], ins[1], ins[2] if node.op.bias else None, trans_a=node.op.trans_a,
                                   trans_b=node.op.trans_b, logical_dtype="bfloat16" if bf16 else None)
                if node.op.bias:
                    self.fallbacks.setdefault(node.name, "MatMul + bias through CuPy (not captured): "
                                                         "cuBLASLt's bias epilogue did not take it")
            elif isinstance(node.op, Attention):
                y = library.attention(*attention_operands(node.op, ins), attention_bias(node.op, ins), scale=node.op.scale,
                                      nan_to_zero=node.op.nan_to_zero, out_perm=node.op.out_perm,
                                      out_shape=node.op.out_shape, logical_dtype="bfloat16" if bf16 else None)
            elif isinstance(node.op, Conv):
                import cupy
                op = node.op
                x, w = ins[0], ins[1]
                if op.channels_last:   # NHWC operands (frontend/layout.py)
                    x, w = cupy.moveaxis(x, -1, 1), cupy.moveaxis(w, -1, 1)
                y = library.conv(x, w, ins[2] if len(ins) > 2 else None, strides=op.strides,
                                 pads=tuple(op.pad_begins) + tuple(op.pad_ends), dilations=op.dilations, group=op.group,
                                 logical_dtype="bfloat16" if bf16 else None)
                if op.channels_last:
                    y = cupy.moveaxis(y, 1, -1)
            else:
                raise PowerFusionError(f"no CUDA library implementation for {type(node.op).__name__}")
            env[node.outputs[0]][...] = y.reshape(env[node.outputs[0]].shape)

    def _library_direct(self, node, ins, out, logical) -> bool:
        """MatMul / Conv written straight into its planned buffer through our own cuBLAS handle
        (blas.py), which CUDA-graph capture accepts; False where that path does not apply (the
        step then calls cupy.matmul, which allocates its result and cannot be captured)."""
        import cupy
        from powerfusion.backends.cuda import blas, int8_gemm, library
        decode = self.decodes.get(node.name) if isinstance(node.op, Attention) else None
        if decode is not None and not decode.misfit(ins[0], ins[1], ins[2], out, *ins[3:5]):   # split-KV decode kernel
            decode(ins[0], ins[1], ins[2], out, *ins[3:5])
            return True
        if isinstance(node.op, Attention):   # cuDNN, chosen when the runner was built
            route = self.attentions.get(node.name)
            if route is None:
                return False
            route.bind(cupy.cuda.get_current_stream().ptr)
            route(ins[0], ins[1], ins[2], ins[3] if len(ins) > 3 else None, out, self._attention_workspace)
            return True
        int8 = isinstance(node.op, (MatMul, Conv)) and int8_gemm.is_int8_gemm(ins[0], ins[1], out)
        conv = None if int8 else self.convs.get(node.name)
        if conv is not None:   # cuDNN, chosen when the runner was built
            conv.bind(cupy.cuda.get_current_stream().ptr)
            conv(ins[0], ins[1], ins[2] if len(ins) > 2 else None, out, self._conv_workspace)
            return True
        if self._blas is None:
            if not blas.available():
                if int8:
                    raise PowerFusionError(f"int8 MatMul '{node.name}' needs cuBLAS, which was not found")
                return False
            self._blas = blas.Blas()
        if int8:
            self._blas.bind(cupy.cuda.get_current_stream())
            return self._int8_into(node, ins, out)
        ape = self._ape is not None and out.dtype == np.float32 and logical is None
        if isinstance(node.op, MatMul) and node.op.bias and not ape:   # cuBLASLt's bias epilogue (blaslt.py)
            return self._gemm_bias_into(node, ins, out, logical)
        gemm = self._blas if self._ape is None else self._ape.for_node(node.name, self._blas)
        gemm.bind(cupy.cuda.get_current_stream())
        if isinstance(node.op, MatMul) and node.op.bias:
            # fp32_matmul sends fp32 GEMMs through Ape (no epilogue there): the product, then the bias
            if not gemm.gemm_into(ins[0], ins[1], out, trans_a=node.op.trans_a, trans_b=node.op.trans_b,
                                  logical_dtype=logical):
                return False
            cupy.add(out, ins[2], out=out)
            return True
        if isinstance(node.op, MatMul):
            return gemm.gemm_into(ins[0], ins[1], out, trans_a=node.op.trans_a, trans_b=node.op.trans_b,
                                  logical_dtype=logical)
        if isinstance(node.op, Conv):
            op = node.op

            def nchw(x, w, y) -> bool:
                return library.conv_into(gemm, x, w, ins[2] if len(ins) > 2 else None, y, self._cols,
                                         strides=op.strides, pads=tuple(op.pad_begins) + tuple(op.pad_ends),
                                         dilations=op.dilations, group=op.group, logical_dtype=logical)
            if op.channels_last:
                return library.channels_last_into(nchw, ins[0], ins[1], out, self._cols)
            return nchw(ins[0], ins[1], out)
        return False

    def _gemm_bias_into(self, node, ins, out, logical) -> bool:
        import cupy
        from powerfusion.backends.cuda import blaslt
        if self._lt is None:
            if not blaslt.available():
                return False
            self._lt = blaslt.BlasLt()
        try:
            return self._lt.gemm_bias_into(ins[0], ins[1], ins[2], out, cupy.cuda.get_current_stream().ptr,
                                           trans_a=node.op.trans_a, trans_b=node.op.trans_b, logical_dtype=logical)
        except blaslt.BlasLtError as e:   # no algorithm for this shape: the step runs on CuPy
            self.fallbacks[node.name] = f"MatMul + bias through CuPy (not captured): {e}"
            return False

    def _int8_into(self, node, ins, out) -> bool:
        """int8 x int8 -> int32 MatMul / Conv on integer tensor cores (int8_gemm.py); cupy.matmul
        would accumulate in int8, so operands that path cannot take are an error, not a fallback."""
        from powerfusion.backends.cuda.int8_gemm import Int8Conv, Int8Gemm
        if self._int8 is None:
            self._int8 = Int8Gemm(self._blas, self._int8_lt())
            self._int8_conv = Int8Conv(self._int8)
        op = node.op
        if isinstance(op, Conv):
            self.conv_routes[node.name] = "int8: im2col + cuBLAS int8 GEMM (int8_gemm.py)"
        if isinstance(op, MatMul):
            ok = self._int8.gemm_into(node.name, ins[0], ins[1], out, trans_a=op.trans_a, trans_b=op.trans_b,
                                      b_constant=node.inputs[1] in self.constants)
        else:
            ok = len(ins) == 2 and self._int8_conv.conv_into(
                node.name, ins[0], ins[1], out, strides=op.strides, pads=tuple(op.pad_begins) + tuple(op.pad_ends),
                dilations=op.dilations, group=op.group)
        if not ok:
            raise PowerFusionError(f"int8 {type(op).__name__} '{node.name}' {ins[0].shape} x {ins[1].shape}: operands "
                                   "the integer path cannot take (non-contiguous, partially broadcast, grouped, "
                                   "biased or not 2-D)")
        return True

    def _int8_lt(self):
        """The cuBLASLt path of the int8 weight GEMMs (int8_lt.py) on our cuBLASLt handle, or None."""
        from powerfusion.backends.cuda import blaslt
        from powerfusion.backends.cuda.int8_lt import Int8Lt
        if not blaslt.available():
            return None
        if self._lt is None:
            self._lt = blaslt.BlasLt()
        return Int8Lt(self._lt)

    @property
    def int8_routes(self) -> dict[str, str]:
        """int8 MatMul / Conv step -> "imma-lt", "imma" or "fallback float64: <why>" (after the first run)."""
        return {} if self._int8 is None else dict(self._int8.routes)

    def _captures(self, s) -> bool:
        """Can this step be captured in a CUDA graph? Our kernels, fused typed GEMMs, and the
        library calls that ran through our own cuBLAS handle in the warm-up run; not those
        that call cuBLAS through CuPy."""
        if isinstance(s, KernelStep):
            return True
        node = s.call.node
        if node.name in self.convs:
            return node.name in self._direct
        if node.name in self._direct:
            return self._ape is None or self._ape.capturable(node.name)
        return isinstance(node.op, TypedMatMul) and self.typed[node.name][0].fused

    def _run_typed(self, node, env) -> None:
        mm, dev, a16 = self.typed[node.name]
        a2 = env[node.inputs[0]].reshape(mm.M, mm.K)
        if a16 is not None:  # fp32 models: activations rounded to fp16, fp32 output written directly
            a16[...] = a2
            a2 = a16
        mm(a2, dev, out=env[node.outputs[0]].reshape(mm.M, mm.N))

    def __call__(self, feeds: dict) -> dict:
        """feeds (numpy or CuPy arrays) -> every output as a numpy array."""
        out = self.run_device(feeds, fresh=False)   # downloaded at once: arena views suffice
        return {name: _to_host(value, self.graph.tensors[name].dtype) for name, value in out.items()}

    def run_device(self, feeds: dict, names=None, into: dict | None = None, fresh: bool = True) -> dict:
        """feeds (numpy or CuPy arrays) -> outputs `names` (default: all) as CuPy arrays.

        Without CUDA graphs, CuPy feeds are read where they lie and outputs in `into` are
        written where they lie (no copy; the plan's arena holds only the other tensors).
        A captured CUDA graph has the arena's addresses baked in, so there device feeds are
        copied into the arena and outputs out of it (device-to-device, no host transfer).
        Outputs not in `into` are fresh CuPy arrays (a device copy), so the next run cannot
        overwrite what a caller holds. Bfloat16 travels as uint16 bits."""
        import cupy
        names = [t.name for t in self.graph.outputs] if names is None else list(names)
        into = dict(into or {})
        with cupy.cuda.Device(self.device_id):
            if self.use_cuda_graph:
                self._run_graph(feeds)
                env = self.tensors
            else:
                env = {**self.tensors, **self._device_feeds(feeds), **self._writable_outputs(into)}
                self._run_steps(env=env)
            out = {name: self._output(name, env, into.get(name), fresh) for name in names}
            cupy.cuda.get_current_stream().synchronize()
            self._check_faults()
        return out

    def prepare_bound(self, feeds: dict, names: list[str], into: dict):
        """An IO binding's run, prepared once (bound.py): `() -> {output: CuPy array}`, the same
        as `run_device(feeds, names, into)` at every call, with less host work per call."""
        from powerfusion.backends.cuda.bound import BoundRun
        return BoundRun(self, feeds, names, into)

    @staticmethod
    def copy_into(dst, src) -> None:
        """dst[...] = src on the current stream, src on the device or the host (_copy_into)."""
        _copy_into(dst, src)

    def _check_faults(self) -> None:
        """A DataError naming the node where a kernel divided an integer by zero or gathered
        with an index out of range in this run (backends/cstyle/faults.py)."""
        for check in self.fault_checks():
            check()

    def fault_checks(self) -> list:
        """One check per kernel step that has fault sites (most have none), made once: each reads
        its step's fault words after the stream is synchronised."""
        if self._fault_checks is None:
            self._fault_checks = [
                lambda ex=self.executors[s.name], s=s: ex.check_faults(lambda site: self._describe_site(s, site))
                for s in self.plan.kernel_steps if self.executors[s.name].has_fault_sites]
        return self._fault_checks

    def _describe_site(self, step, site) -> str:
        if site.fn == "index":   # the gather whose indices the buffer holds, else the one gather of that axis size
            from powerfusion.basic import Gather, GatherElements
            tensor = step.buffers.get(site.basic_op, site.basic_op)
            gathers = [n for n in step.subgraph.nodes if isinstance(n.op, (Gather, GatherElements))]
            sized = [n for n in gathers if str(self.graph.tensors[n.inputs[0]].shape[n.op.axis]) == site.dtype]
            node = next((n for n in gathers if n.inputs[1] == tensor), sized[0] if len(sized) == 1 else None)
            tail = f" with indices '{node.inputs[1]}'" if node is not None else ""
        else:
            node = next((n for n in self.graph.nodes if n.name == site.basic_op), None)
            tail = ""
        if node is None:
            return ""
        o = node.origin
        return f"node '{o.node}' ({o.op_type}, opset {o.opset}){tail}"

    def all_tensors(self, feeds: dict) -> dict:
        """Every output of every step, on the host (the arena reuses memory, so each step's
        outputs are copied down right after it runs; for `compare --per-subgraph`)."""
        import cupy
        out = {}
        with cupy.cuda.Device(self.device_id):
            self._load_inputs(feeds)
            for s in self.plan.steps:
                self._run_steps([s])
                for t in _step_io(s)[1]:
                    if t in self.tensors:
                        out[t] = _to_host(self.tensors[t], self.graph.tensors[t].dtype)
        out.update(self(feeds))
        return out

    def _run_graph(self, feeds: dict) -> None:
        self._load_inputs(feeds)
        if self._cuda_graph is None:
            self._capture()
            # the warm-up run reused the inputs' arena space for later tensors: load them again
            self._load_inputs(feeds)
        self._replay()

    def _device_feeds(self, feeds: dict) -> dict:
        """Inputs as CuPy arrays of the arena's shape and dtype: device feeds as they lie
        (contiguous ones; others copied once), host feeds copied into the arena."""
        import cupy
        env = {}
        for t in self.graph.inputs:
            if t.name not in self.tensors:
                continue
            value, slot = feeds[t.name], self.tensors[t.name]
            if isinstance(value, cupy.ndarray) and value.flags.c_contiguous:
                env[t.name] = value.view(slot.dtype).reshape(slot.shape)
            else:
                slot[...] = _device_layout(value)
                env[t.name] = slot
        return env

    def _writable_outputs(self, into: dict) -> dict:
        """Bound output buffers the steps can write directly: contiguous, of the planned dtype
        and size (others get a copy after the run)."""
        out = {}
        for n, a in into.items():
            slot = self.tensors.get(n)
            if slot is not None and a.flags.c_contiguous and a.dtype == slot.dtype and a.size == slot.size:
                out[n] = a.reshape(slot.shape)
        return out

    def _output(self, name: str, env: dict, target, fresh: bool = True):
        """Output `name` as a CuPy array: written into `target` when given, else a fresh copy."""
        import cupy
        info = self.graph.tensors[name]
        if name in self.graph.constants:  # folded at import (Shape of a static tensor): no buffer
            value = cupy.asarray(_to_device_layout(np.asarray(self.graph.constants[name], dtype=np.dtype(info.dtype))))
        elif name not in env:   # no step writes it: an output without elements
            if all(int(d) for d in info.shape):
                raise PowerFusionError(f"output '{name}' {tuple(info.shape)} is computed by no step of the plan")
            value = cupy.zeros(tuple(info.shape), dtype=cupy_dtype(info.dtype))
        else:
            value = env[name]
        if target is None:
            return value.copy() if fresh and value is self.tensors.get(name) else value
        if target.data.ptr != value.data.ptr:   # not written in place: copy on the device
            if target.dtype != value.dtype and target.dtype.itemsize == value.dtype.itemsize:
                value = value.view(target.dtype)   # bf16 bits into a 2-byte buffer of another name
            _copy_into(target, value.reshape(target.shape))
        return target

    def _load_inputs(self, feeds: dict) -> None:
        for t in self.graph.inputs:
            if t.name in self.tensors:
                _copy_into(self.tensors[t.name], feeds[t.name])

    def _capture(self) -> None:
        """Capture the run as CUDA graphs. CuPy cannot call cuBLAS during stream capture, so
        MatMul / Conv go through our own cuBLAS handle (blas.py) where they can; the steps are
        captured piecewise: each run of capturable steps (GIR kernels, typed GEMMs, direct
        library calls) is one graph; library calls through CuPy stay eager in between.
        A warm-up run first makes the memory pool hold every block the eager steps need; it
        overwrites the arena (inputs included), so the caller loads the inputs again."""
        self._run_steps()
        self._cuda_graph = self._capture_pieces()

    def _capture_pieces(self, env=None) -> list:
        """The ("graph", captured graph) / ("eager", steps) pieces of one run over `env` (default:
        the arena)."""
        import cupy
        capture = cupy.cuda.Stream(non_blocking=True)
        pieces = []
        for eager, steps in _segments(self.plan.steps, self._captures):
            if eager:
                pieces.append(("eager", steps))
                continue
            with capture:
                if self._blas is not None:
                    self._blas.bind(capture)   # before the capture: binding is not a stream operation
                if self._ape is not None:
                    self._ape.bind(capture)
                for conv in self.convs.values():
                    conv.bind(capture.ptr)
                capture.begin_capture()
                self._run_steps(steps, env)
                pieces.append(("graph", capture.end_capture()))
        capture.synchronize()
        return pieces

    def bound_graph(self, key: tuple, feeds: dict, into: dict):
        """A CUDA graph of the whole run that reads `feeds` and writes `into` where they lie (no
        copies through the arena), for an IO binding repeated with the same buffers; `key` names
        those buffers. Captured once; at most BOUND_GRAPHS kept (the oldest dropped first)."""
        graph = self._bound_graphs.get(key)
        if graph is None:
            env = {**self.tensors, **self._device_feeds(feeds), **self._writable_outputs(into)}
            [(_, graph)] = self._capture_pieces(env)
            if len(self._bound_graphs) >= BOUND_GRAPHS:
                del self._bound_graphs[next(iter(self._bound_graphs))]
            self._bound_graphs[key] = graph
        return graph

    def _replay(self) -> None:
        """Replay the captured pieces (eager library calls in between) on the current stream,
        without waiting for them: the caller synchronizes once (run_device after the output
        copies), so back-to-back replays queue up like any other launches."""
        import cupy
        stream = cupy.cuda.get_current_stream()
        for kind, piece in self._cuda_graph:
            if kind == "graph":
                piece.launch(stream)
            else:
                self._run_steps(piece)

def _segments(steps, capturable) -> list[tuple[bool, list]]:
    """(eager, steps) runs: steps `capturable` refuses (cuBLAS calls) are eager."""
    out: list[tuple[bool, list]] = []
    for s in steps:
        eager = not capturable(s)
        if out and out[-1][0] == eager:
            out[-1][1].append(s)
        else:
            out.append((eager, [s]))
    return out


def _is_fp32(graph, node) -> bool:
    return np.dtype(graph.tensors[node.inputs[0]].dtype) == np.float32


def typed_gemm(graph, node):
    """(Matmul, PackedWeight) for a TypedMatMul: M = product of A's leading dims; A and the output
    fp16 / bf16 as in the graph; fp32 models: fp16 activations (the typed GEMMs take
    half-precision activations) and fp32 output."""
    from powerfusion.frontend.quantized import source_node
    from powerfusion.ttile.onnx_quant import dequantize_matmul_to_typed, matmul_nbits_to_typed
    a = graph.tensors[node.inputs[0]]
    M = int(np.prod(a.shape[:-1], dtype=np.int64))
    A_dtype = "bf16" if np.dtype(a.dtype).name == "bfloat16" else "fp16"
    out_dtype = "fp32" if _is_fp32(graph, node) else A_dtype
    onnx_node = source_node(node.op, list(node.inputs))
    onnx_node.name = node.origin.node or node.name   # errors name the model's node
    consts = {t: np.asarray(graph.constants[t]) for t in node.inputs[1:]}
    if node.op.source == "MatMulNBits":
        mm, packed = matmul_nbits_to_typed(onnx_node, consts, M, A_dtype, out_dtype)
    elif node.op.source == "MatMulLowBit":
        from powerfusion.ttile.onnx_lowbit import matmul_lowbit_to_typed
        mm, packed = matmul_lowbit_to_typed(onnx_node, consts, M, A_dtype, out_dtype)
    else:
        import onnx
        matmul = onnx.helper.make_node("MatMul", [node.inputs[0], onnx_node.output[0]], ["Y"])
        mm, packed = dequantize_matmul_to_typed(onnx_node, matmul, consts, M, A_dtype, out_dtype)
    return mm, packed


def _copy_into(dst, src) -> None:
    """dst[...] = src on the current stream. Same dtype and both contiguous: one
    cudaMemcpyAsync (device or host source), which costs a few microseconds less to issue
    than CuPy's elementwise copy kernel; anything else goes through that kernel."""
    import cupy
    if not isinstance(src, cupy.ndarray):
        src = _to_device_layout(np.asarray(src))
        if src.dtype == dst.dtype and src.shape == dst.shape and src.flags.c_contiguous and dst.flags.c_contiguous:
            dst.set(src, stream=cupy.cuda.get_current_stream())
            return
        src = cupy.asarray(src)
    if (src.dtype == dst.dtype and src.size == dst.size and src.flags.c_contiguous and dst.flags.c_contiguous
            and src.data.ptr != dst.data.ptr):
        if dst.nbytes:
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice,
                                          cupy.cuda.get_current_stream().ptr)
        return
    dst[...] = src.reshape(dst.shape) if src.size == dst.size else src


def _device_layout(value):
    """A feed as the arena holds it: CuPy arrays as they are (bf16 as uint16 bits), host arrays
    uploaded in their device layout."""
    import cupy
    if isinstance(value, cupy.ndarray):
        return value
    return cupy.asarray(_to_device_layout(np.asarray(value)))


def _to_host(value, dtype):
    import cupy
    host = cupy.asnumpy(value)
    return host.view(np_dtype("bfloat16")) if np.dtype(dtype).name == "bfloat16" else host


def _to_device_layout(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else np.asarray(a, order="C")


def _step_io(s):
    if isinstance(s, LibraryStep):
        return s.call.node.inputs, s.call.node.outputs
    return s.subgraph.inputs, s.subgraph.outputs


def check_available() -> None:
    """Raise a PowerFusionError where this runtime cannot run here (before a session compiles)."""
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        raise PowerFusionError(f"target 'cuda' needs CuPy ({e})") from None


def make_executor(plan: Plan, options):
    """The session's executor for target 'cuda': run the compiled plan on the chosen GPU."""
    check_available()
    import cupy
    device_id = int(getattr(options, "device_id", 0))
    with cupy.cuda.Device(device_id):
        return CudaPlanRunner(plan, cuda_graph=bool(getattr(options, "cuda_graph", False)), device_id=device_id,
                              fp32_matmul=getattr(options, "fp32_matmul", "fp32"))
