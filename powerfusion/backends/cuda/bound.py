"""One IO binding's run on a CudaPlanRunner, prepared once when the binding is first run.

onnxruntime-style `run_with_iobinding` calls repeat with the same buffers, so everything that
does not change between calls -- feed checks, which tensor goes where, the device pointers
and byte counts of the copies into and out of the captured graph's arena, the fault words to
read -- is worked out here once. With CUDA graphs a call then issues one cudaMemcpyAsync per
bound input and output (about 5 us of host time each on an H200), the graph launches, one
stream synchronisation and the fault check: no dict building, no per-array flag or dtype
checks, no CuPy elementwise copies. From a binding's fourth run, where the run is one
captured graph, that graph is captured once more over the bound device buffers themselves
(CudaPlanRunner.bound_graph), so the copies go too: a call is one launch and one wait.

What a call promises (as onnxruntime's does): the work is queued on the caller's current CuPy
stream (so it sees whatever the caller queued there before, e.g. writes into a bound input),
and the call returns once every output is complete in its buffer (the stream is
synchronised). Host inputs (bind_cpu_input) are read again at every call. Device buffers are
bound by address: they must stay allocated while bound, as in onnxruntime.
"""
from __future__ import annotations

import numpy as np

D2D = 3   # cudaMemcpyDeviceToDevice
# Runs of one binding through the arena after its first before it gets a graph of its own, so
# from its fourth run (a capture costs milliseconds: a binding run two or three times, or
# changed before every run, keeps the copies through the arena)
DIRECT_AFTER = 2


class BoundRun:
    """`__call__() -> {output name: CuPy array}` for fixed feeds and output buffers.

    `feeds`: validated feeds (CuPy or numpy arrays); `names`: outputs wanted; `into`: output
    name -> bound CuPy buffer (outputs not in it come back as fresh arrays, one per call)."""

    def __init__(self, runner, feeds: dict, names: list[str], into: dict):
        self.runner, self.feeds, self.names, self.into = runner, feeds, list(names), dict(into)
        self._fast: bool | None = None   # None: not yet run; False: every call takes run_device
        self._direct_key = None          # the buffers of a graph that reads and writes them in place
        self._calls = 0

    def __call__(self) -> dict:
        runner = self.runner
        if not self._fast:
            # the first run captures the graph; without graphs every step runs from Python anyway
            out = runner.run_device(self.feeds, self.names, self.into)
            if self._fast is None:
                self._fast = runner.use_cuda_graph and runner._cuda_graph is not None and self._prepare()
            return out
        import cupy
        device = cupy.cuda.runtime.getDevice()
        if device != runner.device_id:
            cupy.cuda.runtime.setDevice(runner.device_id)
        try:
            return self._replay(cupy)
        finally:
            if device != runner.device_id:
                cupy.cuda.runtime.setDevice(device)

    def _prepare(self) -> bool:
        """Work out the copies once; False (stay on run_device) where an input or output is not
        a plain copy: a constant or empty output, a dtype or size the arena slot does not match."""
        runner, tensors = self.runner, self.runner.tensors
        self._copies_in, self._uploads = [], []
        for t in runner.graph.inputs:
            if t.name not in tensors:
                continue
            slot, value = tensors[t.name], self.feeds[t.name]
            if _device_contiguous(value) and value.dtype == slot.dtype and value.size == slot.size:
                if value.data.ptr == slot.data.ptr:
                    continue
                self._copies_in.append((slot.data.ptr, value.data.ptr, slot.nbytes))
            elif isinstance(value, np.ndarray):
                self._uploads.append((slot, value))   # read again at every call: the host array may change
            else:
                return False
        self._copies_out, self._fresh, self._bound = [], [], {}
        for name in self.names:
            slot, target = tensors.get(name), self.into.get(name)
            if slot is None or name in runner.graph.constants:
                return False
            if target is None:
                self._fresh.append((name, slot))
            elif _device_contiguous(target) and target.dtype.itemsize == slot.dtype.itemsize \
                    and target.size == slot.size:
                if target.data.ptr != slot.data.ptr:
                    self._copies_out.append((target.data.ptr, slot.data.ptr, slot.nbytes))
                self._bound[name] = target
            else:
                return False
        self._faults = runner.fault_checks()
        self._pieces = runner._cuda_graph
        self._direct_key = self._direct_buffers()
        return True

    def _direct_buffers(self) -> tuple | None:
        """(tensor, address) of each device buffer where a graph of their own can read and write
        them in place (host inputs are still uploaded into the arena, fresh outputs copied out of
        it): one captured piece, bound buffers of the arena slot's dtype, none shared, no output
        that is also an input; else None (the copies through the arena stay)."""
        runner, tensors = self.runner, self.runner.tensors
        if len(self._pieces) != 1 or self._pieces[0][0] != "graph":
            return None
        inputs = {t.name for t in runner.graph.inputs}
        ins = [(n, self.feeds[n]) for n in sorted(inputs) if n in tensors and not isinstance(self.feeds[n], np.ndarray)]
        outs = list(self._bound.items())
        if any(n in inputs for n, _ in outs) or any(a.dtype != tensors[n].dtype for n, a in ins + outs):
            return None
        ptrs = [a.data.ptr for _, a in ins + outs]
        if len(set(ptrs)) != len(ptrs):
            return None
        return tuple((n, a.data.ptr) for n, a in ins + outs)

    def _replay(self, cupy) -> dict:
        runner = self.runner
        stream = cupy.cuda.get_current_stream()
        own = self._direct_key is not None and self._calls >= DIRECT_AFTER
        if not own:
            self._calls += 1
            _copy(cupy, self._copies_in, stream.ptr)
        for slot, host in self._uploads:   # host inputs: uploaded again at every run
            runner.copy_into(slot, host)
        if own:
            runner.bound_graph(self._direct_key, self.feeds, self.into).launch(stream)
        else:
            for kind, piece in self._pieces:
                if kind == "graph":
                    piece.launch(stream)
                else:
                    runner._run_steps(piece)
            _copy(cupy, self._copies_out, stream.ptr)
        out = dict(self._bound)   # host work between the launch and the wait costs no time
        for name, slot in self._fresh:   # a fresh array: the next run must not overwrite what the caller holds
            out[name] = slot.copy()
        stream.synchronize()
        for check in self._faults:
            check()
        return out


def _copy(cupy, copies, stream_ptr: int) -> None:
    """(destination, source, bytes) device-to-device copies, queued on the stream."""
    for dst, src, nbytes in copies:
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, D2D, stream_ptr)


def _device_contiguous(value) -> bool:
    import cupy
    return isinstance(value, cupy.ndarray) and value.flags.c_contiguous
