"""IO binding across repeated runs: a binding is checked and prepared at its first run and
repeated after that (iobinding.py, backends/cuda/bound.py). Each run must read the bound
buffers' current contents, a changed binding must be prepared again, and faults must still be
reported. Results are compared with the CPU session (float32: rtol 1e-5, atol 1e-6, as in
test_ort_dropin; Gather exactly)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import powerfusion
from powerfusion.errors import DataError
from tests.test_session import feeds, mlp_model

RTOL, ATOL = 1e-5, 1e-6


def _expected(cpu, x, ids):
    return cpu.run(None, {"x": x, "ids": ids})


def test_cpu_binding_reads_changed_contents_and_rebinds():
    sess = powerfusion.InferenceSession(mlp_model())
    f = feeds()
    x, ids = f["x"].copy(), f["ids"].copy()
    out_y = np.empty((2, 8), np.float32)
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_cpu_input("ids", ids)
    binding.bind_output("y", "cpu", 0, np.float32, out_y.shape, out_y.ctypes.data)
    binding.bind_output("e", "cpu")
    for k in range(3):
        x[...] = k + 0.5 * f["x"]           # changed in place: the next run must see it
        sess.run_with_iobinding(binding)
        want = _expected(sess, x, ids)
        np.testing.assert_allclose(out_y, want[0], rtol=RTOL, atol=ATOL)
        got = binding.copy_outputs_to_cpu()
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(got[1], want[2])
    other = np.array([1, 2], np.int64)
    binding.bind_cpu_input("ids", other)        # a new binding: prepared again
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[1], _expected(sess, x, other)[2])


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph,on_device,own_graph", [(False, False, False), (True, False, True),
                                                            (True, True, True), (True, True, False)])
def test_cuda_binding_repeats_with_device_buffers(cuda_graph, on_device, own_graph, monkeypatch):
    """A bound CuPy input and output, and either a host input and a fresh-array output or every
    input and output on the device, run ten times with the inputs rewritten in place between
    runs, with cuda_graph through copies into the session's graph or (`own_graph`, from the
    fourth run) a graph of the binding's own buffers; then an out-of-range index in the bound
    ids raises a DataError on the repeated path, and a valid one runs again."""
    import cupy
    from powerfusion.backends.cuda import bound
    if not own_graph:
        monkeypatch.setattr(bound, "DIRECT_AFTER", 10 ** 9)
    cpu = powerfusion.InferenceSession(mlp_model())
    sess = powerfusion.InferenceSession(mlp_model(), target="cuda", options={"cuda_graph": cuda_graph})
    f = feeds()
    x_gpu, ids = cupy.asarray(f["x"]), f["ids"].copy()
    ids_gpu = cupy.asarray(ids)
    y_gpu, e_gpu = cupy.empty((2, 8), np.float32), cupy.empty((2, 3), np.float32)
    binding = sess.io_binding()
    binding.bind_input("x", "cuda", 0, np.float32, x_gpu.shape, x_gpu.data.ptr)
    binding.bind_output("y", "cuda", 0, np.float32, y_gpu.shape, y_gpu.data.ptr)
    if on_device:
        binding.bind_array("ids", ids_gpu)
        binding.bind_ortvalue_output("e", powerfusion.OrtValue.from_dlpack(e_gpu))
    else:
        binding.bind_cpu_input("ids", ids)
        binding.bind_output("e", "cuda")

    def set_ids(values):
        ids[...] = values
        ids_gpu.set(ids)

    held = []
    for k in range(10):
        x = (f["x"] * (k + 1) - k).astype(np.float32)
        x_gpu.set(x)
        set_ids([k % 5, (k + 2) % 5])
        sess.run_with_iobinding(binding)
        want = _expected(cpu, x, ids)
        outs = binding.get_outputs()
        assert [o.device_name() for o in outs] == ["cuda", "cuda"]
        assert outs[0].data_ptr() == y_gpu.data.ptr
        np.testing.assert_allclose(cupy.asnumpy(y_gpu), want[0], rtol=RTOL, atol=ATOL)
        held.append((outs[1].numpy(), outs[1].array, want[2]))
    for first, array, want in held:
        np.testing.assert_array_equal(first, want)
        if not on_device:   # each run's fresh output is its own: later runs left it alone
            np.testing.assert_array_equal(cupy.asnumpy(array), first)
    set_ids([7, 0])
    with pytest.raises(DataError, match="out of range"):
        sess.run_with_iobinding(binding)
    set_ids([3, 1])
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.get_outputs()[1].numpy(), _expected(cpu, x, ids)[2])
    assert len(sess._executor._bound_graphs) == (1 if cuda_graph and own_graph else 0)


@pytest.mark.gpu
def test_cuda_bindings_on_threads_share_one_session():
    """Four threads, each with its own binding and buffers, repeat runs on one cuda_graph
    session; the session's lock keeps its arena to one run at a time."""
    import cupy
    cpu = powerfusion.InferenceSession(mlp_model())
    sess = powerfusion.InferenceSession(mlp_model(), target="cuda", options={"cuda_graph": True})
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            with cupy.cuda.Stream(non_blocking=True):
                x_gpu, ids_gpu = cupy.empty((2, 4), np.float32), cupy.empty(2, np.int64)
                outs = {n: cupy.empty(s, np.float32) for n, s in (("y", (2, 8)), ("z", (2, 8)), ("e", (2, 3)))}
                binding = sess.io_binding()
                binding.bind_array("x", x_gpu)
                binding.bind_array("ids", ids_gpu)
                for n, a in outs.items():
                    binding.bind_ortvalue_output(n, powerfusion.OrtValue.from_dlpack(a))
                for _ in range(20):
                    x = rng.standard_normal((2, 4)).astype(np.float32)
                    ids = np.array([seed % 5, 4], np.int64)
                    x_gpu.set(x)
                    ids_gpu.set(ids)
                    sess.run_with_iobinding(binding)
                    for got, want in zip(binding.copy_outputs_to_cpu(), _expected(cpu, x, ids)):
                        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        except Exception as e:   # surfaced below: a thread's exception would vanish otherwise
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
