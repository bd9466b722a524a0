"""The BANG C emulator: numerics against numpy, the event log, and the checks it
must report (capacity, memory spaces, alignment, pending async copies, barriers,
output coverage). Kernels are hand-written BANG C as the MLU backend will emit.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mlu"))   # harness.py
from harness import BangEmulationError, CoverageError, run_bang  # noqa: E402

pytestmark = pytest.mark.usefixtures("gxx")   # conftest.require_tool: skips, or fails where required
RNG = np.random.default_rng(7)
TILE = 256

ADD = """
#define TILE 256
__mlu_entry__ void add_kernel(float* out, float* a, float* b, int tiles_per_task) {
  __nram__ float xa[TILE];
  __nram__ float xb[TILE];
  for (int t = 0; t < tiles_per_task; ++t) {
    int off = (taskId * tiles_per_task + t) * TILE;
    __memcpy(xa, a + off, TILE * sizeof(float), GDRAM2NRAM);
    __memcpy(xb, b + off, TILE * sizeof(float), GDRAM2NRAM);
    __bang_add(xa, xa, xb, TILE);
    __memcpy(out + off, xa, TILE * sizeof(float), NRAM2GDRAM);
  }
}
void launch_add(cnrtQueue_t queue, float* a, float* b, float* out, int tiles_per_task) {
  cnrtDim3_t dim = {4, 1, 1};
  PF_LAUNCH(add_kernel, dim, CNRT_FUNC_TYPE_UNION1, queue, out, a, b, tiles_per_task);
}
"""


def _add(task_dim=4, tiles=3, source=ADD, **kw):
    n = task_dim * tiles * TILE
    a, b = RNG.standard_normal(n, dtype=np.float32), RNG.standard_normal(n, dtype=np.float32)
    outs, log = run_bang(source, "add_kernel", {"a": a, "b": b}, {"out": ((n,), np.float32)}, task_dim,
                         args=["out", "a", "b", "tiles"], scalars={"tiles": tiles}, **kw)
    return a, b, outs, log


def test_elementwise_add_over_four_tasks_matches_numpy():
    a, b, outs, log = _add()
    np.testing.assert_array_equal(outs["out"], a + b)  # fp32 add is exact: tolerance 0
    quarter = 3 * TILE * 4
    for task in range(4):
        stores = [e for e in log.of_task(task, "memcpy") if e.op == "NRAM2GDRAM"]
        assert len(stores) == 3 and len(log.of_task(task, "compute")) == 3
        assert all(e.dst.buffer == "out" and task * quarter <= e.dst.offset < (task + 1) * quarter for e in stores)
    assert log.coverage["out"].complete and log.coverage["out"].multi_task_bytes == 0


def test_emitted_host_launcher_runs_through_pf_launch():
    n = 4 * 2 * TILE
    a, b = RNG.standard_normal(n, dtype=np.float32), RNG.standard_normal(n, dtype=np.float32)
    outs, log = run_bang(ADD, "add_kernel", {"a": a, "b": b}, {"out": ((n,), np.float32)}, 4,
                         args=["a", "b", "out", "tiles"], scalars={"tiles": 2}, launcher="launch_add")
    np.testing.assert_array_equal(outs["out"], a + b)
    assert [e.op for e in log.events if e.kind == "launch"] == ["add_kernel"]


def test_half_chain_matches_numpy():
    src = """
    __mlu_entry__ void chain(half* out, half* x, half* y) {
      __nram__ half bx[128];
      __nram__ half by[128];
      int off = taskId * 128;
      __memcpy(bx, x + off, 128 * sizeof(half), GDRAM2NRAM);
      __memcpy(by, y + off, 128 * sizeof(half), GDRAM2NRAM);
      __bang_mul_scalar(bx, bx, (half)2.0f, 128);
      __bang_add(bx, bx, by, 128);
      __bang_active_relu(bx, bx, 128);
      __memcpy(out + off, bx, 128 * sizeof(half), NRAM2GDRAM);
    }"""
    x, y = (RNG.standard_normal(512).astype(np.float16) for _ in range(2))
    outs, _ = run_bang(src, "chain", {"x": x, "y": y}, {"out": ((512,), np.float16)}, 4, args=["out", "x", "y"])
    ref = np.maximum(2 * x.astype(np.float32) + y.astype(np.float32), 0)
    np.testing.assert_allclose(outs["out"].astype(np.float32), ref, rtol=1e-3, atol=1e-3)  # fp16: ~2 ulp


PIPELINE = """
#define TILE 256
__mlu_entry__ void affine(float* out, float* x, int tiles) {
  __nram__ float in_buf[2][TILE];
  __nram__ float out_buf[2][TILE];
  int base = taskId * tiles * TILE;
  __memcpy_async(in_buf[0], x + base, TILE * sizeof(float), GDRAM2NRAM);
  __sync_io();
  for (int i = 0; i < tiles; ++i) {
    int cur = i % 2;
    if (i + 1 < tiles)  // prefetch tile i+1 while tile i is computed
      __memcpy_async(in_buf[1 - cur], x + base + (i + 1) * TILE, TILE * sizeof(float), GDRAM2NRAM);
    __bang_mul_scalar(out_buf[cur], in_buf[cur], 3.0f, TILE);
    __bang_add_scalar(out_buf[cur], out_buf[cur], 1.0f, TILE);
    __memcpy_async(out + base + i * TILE, out_buf[cur], TILE * sizeof(float), NRAM2GDRAM);
    __sync_io();
  }
}
"""


def test_double_buffered_pipeline_overlaps_copy_and_compute():
    tiles, tasks = 4, 4
    x = RNG.standard_normal(tasks * tiles * TILE, dtype=np.float32)
    outs, log = run_bang(PIPELINE, "affine", {"x": x}, {"out": (x.shape, np.float32)}, tasks,
                         args=["out", "x", "tiles"], scalars={"tiles": tiles})
    np.testing.assert_allclose(outs["out"], 3 * x + 1, rtol=1e-6)  # fp32, two roundings
    for task in range(tasks):
        base = task * tiles * TILE * 4
        computes = [e for e in log.of_task(task, "compute") if e.op == "__bang_mul_scalar"]
        loads = {e.srcs[0].offset: e for e in log.of_task(task, "memcpy_issue") if e.op == "GDRAM2NRAM"}
        done = {e.copy: e for e in log.of_task(task, "memcpy_complete")}
        assert len(computes) == tiles
        for i in range(tiles - 1):
            prefetch = loads[base + (i + 1) * TILE * 4]
            # issued before tile i is computed and completed only after it
            assert prefetch.seq < computes[i].seq < done[prefetch.copy].seq


def test_nram_over_capacity_is_reported():
    src = """
    __mlu_entry__ void big(float* out) {
      __nram__ float huge[200 * 1024];
      __bang_write_value(huge, 32, 0.0f);
      __memcpy(out, huge, 128, NRAM2GDRAM);
    }"""
    with pytest.raises(BangEmulationError, match=r"NRAM over capacity: .* 819200 bytes, .*limit is 655360"):
        run_bang(src, "big", {}, {"out": ((32,), np.float32)}, 4)


def test_reading_async_copy_before_sync_io_is_reported():
    src = """
    __mlu_entry__ void early(float* out, float* x) {
      __nram__ float buf[64];
      __memcpy_async(buf, x, 64 * sizeof(float), GDRAM2NRAM);
      __bang_add(buf, buf, buf, 64);  // missing __sync_io()
      __sync_io();
      __memcpy(out, buf, 64 * sizeof(float), NRAM2GDRAM);
    }"""
    x = np.ones(64, np.float32)
    with pytest.raises(BangEmulationError, match=r"__bang_add: src0 .* reads the destination of pending async copy"
                                                 r" #0 \(GDRAM2NRAM.*before __sync_io\(\)") as err:
        run_bang(src, "early", {"x": x}, {"out": ((64,), np.float32)}, 1, "BLOCK", args=["out", "x"])
    assert [e.kind for e in err.value.log.events][-1] == "memcpy_issue"


def test_overwriting_source_of_pending_store_is_reported():
    src = """
    __mlu_entry__ void clobber(float* out) {
      __nram__ float buf[64];
      __bang_write_value(buf, 64, 1.0f);
      __memcpy_async(out, buf, 64 * sizeof(float), NRAM2GDRAM);
      __bang_write_value(buf, 64, 2.0f);  // the store may still be reading buf
      __sync_io();
    }"""
    with pytest.raises(BangEmulationError, match=r"dst .* writes the source of pending async copy"):
        run_bang(src, "clobber", {}, {"out": ((64,), np.float32)}, 1, "BLOCK")


def test_unwritten_output_is_reported_by_coverage():
    lazy = ADD.replace("for (int t = 0;", "if (taskId == taskDim - 1) return;\n  for (int t = 0;")
    quarter = 3 * TILE * 4
    with pytest.raises(CoverageError, match=rf"out: bytes \[\({3 * quarter}, {4 * quarter}\)\]"):
        _add(source=lazy)
    a, b, outs, log = _add(source=lazy, check_coverage=False)
    assert log.coverage["out"].unwritten == ((3 * quarter, 4 * quarter),)
    assert np.isnan(outs["out"][3 * quarter // 4:]).all()
    np.testing.assert_array_equal(outs["out"][: 3 * quarter // 4], (a + b)[: 3 * quarter // 4])


@pytest.mark.parametrize("body, message", [
    ("__memcpy(buf, x, 128, NRAM2GDRAM);", r"destination lies in NRAM and source in GDRAM, but the direction needs GDRAM <- NRAM"),
    ("__memcpy(buf, x, 128, GDRAM2NRAM); __bang_add(buf, buf, buf, 10);", r"40 bytes is not a multiple of 128"),
    ("__memcpy(buf, x, 128, GDRAM2NRAM); __bang_add(buf + 1, buf, buf, 32);", r"dst address is not 64-byte aligned"),
    ("__memcpy(buf, x, 128, GDRAM2NRAM); __bang_add(buf, x, buf, 32);", r"src0 .*GDRAM.* is not in NRAM"),
    ("__memcpy_async(buf, x, 128, GDRAM2NRAM);", r"kernel returned with 1 async copies never waited for"),
    ("__memcpy_async(buf, x, 128, GDRAM2NRAM); __sync_cluster();", r"__sync_cluster\(\) with 1 async copies not yet waited"),
    ("if (taskId != 0) __sync_all();", r"deadlock - tasks 1\(all\) 2\(all\) 3\(all\)"),
])
def test_misuse_is_reported(body, message):
    with pytest.raises(BangEmulationError, match=message):
        _misuse(body)


def _misuse(body, func_type="UNION1", task_dim=4):
    src = f"""
    __mlu_entry__ void misuse(float* out, float* x) {{
      __nram__ float buf[64];
      {body}
      __memcpy(out + taskId * 32, x, 128, GDRAM2GDRAM);
    }}"""
    x = np.zeros(128, np.float32)
    return run_bang(src, "misuse", {"x": x}, {"out": ((128,), np.float32)}, task_dim, func_type, args=["out", "x"])


def test_task_types_are_checked():
    with pytest.raises(BangEmulationError, match=r"__sync_cluster\(\) in a CNRT_FUNC_TYPE_BLOCK kernel"):
        _misuse("__sync_cluster();", "BLOCK")
    with pytest.raises(BangEmulationError, match=r"UNION1 needs dim.x divisible by 4 .*got dim.x = 6"):
        _misuse("", "UNION1", 6)
    _, log = _misuse("", "BLOCK", 4)  # the same kernel is fine as four BLOCK tasks
    assert {e.task for e in log.events if e.kind == "task_end"} == {0, 1, 2, 3}


REDUCE = """
__mlu_entry__ void reductions(float* sums, float* pooled, float* arg, half* harg, float* x, half* hx) {
  __nram__ float buf[64];
  __nram__ float red[64];
  __nram__ float pool[32];
  __nram__ float am[32];
  __nram__ half hbuf[64];
  __nram__ half ham[64];
  __memcpy(buf, x, 64 * sizeof(float), GDRAM2NRAM);
  __memcpy(hbuf, hx, 64 * sizeof(half), GDRAM2NRAM);
  __bang_reduce_sum(red, buf, 64);
  __bang_sumpool(pool, buf, 32, 1, 2, 1, 2, 1, 1);  // HWC: C=32, W=2 -> column sums
  __bang_argmax(am, buf, 64);
  __bang_argmax(ham, hbuf, 64);
  __memcpy(sums, red, 64 * sizeof(float), NRAM2GDRAM);
  __memcpy(pooled, pool, 32 * sizeof(float), NRAM2GDRAM);
  __memcpy(arg, am, 2 * sizeof(float), NRAM2GDRAM);
  __memcpy(harg, ham, 3 * sizeof(half), NRAM2GDRAM);
}
"""


def test_reductions_follow_documented_semantics():
    x = RNG.standard_normal(64, dtype=np.float32)
    hx = RNG.permutation(np.arange(64)).astype(np.float16)
    outs, _ = run_bang(REDUCE, "reductions", {"x": x, "hx": hx},
                       {"sums": ((64,), np.float32), "pooled": ((32,), np.float32), "arg": ((2,), np.float32),
                        "harg": ((3,), np.float16)}, 1, "BLOCK", args=["sums", "pooled", "arg", "harg", "x", "hx"])
    # __bang_reduce_sum: one sum per 128-byte group, at the group's first element
    np.testing.assert_allclose(outs["sums"][[0, 32]], x.reshape(2, 32).sum(axis=1), rtol=1e-5)
    assert np.isnan(np.delete(outs["sums"], [0, 32])).all()
    np.testing.assert_allclose(outs["pooled"], x.reshape(2, 32).sum(axis=0), rtol=1e-6)
    assert outs["arg"][0] == x.max() and outs["arg"].view(np.uint32)[1] == x.argmax()
    # half: value, then the uint32 index in the next 4 bytes
    assert outs["harg"][0] == 63 and int.from_bytes(outs["harg"].tobytes()[2:6], "little") == int(hx.argmax())


CLUSTER_SUM = """
__mlu_entry__ void cluster_sum(float* out, float* x) {
  __nram__ float buf[256];
  __nram__ float part[32];
  __nram__ float all[4][32];
  __mlu_shared__ float slots[4][32];
  __memcpy(buf, x + taskId * 256, 256 * sizeof(float), GDRAM2NRAM);
  __bang_sumpool(part, buf, 32, 1, 8, 1, 8, 1, 1);
  __memcpy(slots[coreId], part, 32 * sizeof(float), NRAM2SRAM);
  __sync_cluster();
  if (coreId == 0) {
    __memcpy(all, slots, 4 * 32 * sizeof(float), SRAM2NRAM);
    __bang_add(all[0], all[0], all[1], 32);
    __bang_add(all[2], all[2], all[3], 32);
    __bang_add(all[0], all[0], all[2], 32);
    __bang_reduce_sum(all[0], all[0], 32);
    __memcpy(out + clusterId * 32, all[0], 32 * sizeof(float), NRAM2GDRAM);
  }
}
"""


def test_sram_is_shared_per_cluster_across_sync_cluster():
    x = RNG.standard_normal(8 * 256, dtype=np.float32)
    outs, log = run_bang(CLUSTER_SUM, "cluster_sum", {"x": x}, {"out": ((2, 32), np.float32)}, 8, args=["out", "x"])
    np.testing.assert_allclose(outs["out"][:, 0], x.reshape(2, -1).sum(axis=1), rtol=1e-4)  # fp32 sum of 1024
    leaves = [e.seq for e in log.events if e.kind == "barrier_leave"]
    arrivals = [e.seq for e in log.events if e.kind == "barrier_arrive"]
    assert len(leaves) == len(arrivals) == 8
    first_cluster_last_arrival = max(e.seq for e in log.events if e.kind == "barrier_arrive" and e.task < 4)
    assert min(e.seq for e in log.events if e.kind == "barrier_leave" and e.task < 4) > first_cluster_last_arrival


STRIDED = """
__mlu_entry__ void column_halves(float* out, float* x) {
  __nram__ float block[8][32];
  // task t moves columns [32t, 32t+32) of an 8 x 64 matrix: 8 segments of 128 bytes
  __memcpy(block, x + taskId * 32, 32 * sizeof(float), GDRAM2NRAM, 32 * sizeof(float), 64 * sizeof(float), 7);
  __bang_mul_scalar((float*)block, (float*)block, 2.0f, 8 * 32);
  __memcpy_async(out + taskId * 32, block, 32 * sizeof(float), NRAM2GDRAM, 64 * sizeof(float), 32 * sizeof(float), 7);
  __sync_io();
}
"""


def test_strided_copies_move_2d_blocks():
    x = RNG.standard_normal((8, 64), dtype=np.float32)
    outs, log = run_bang(STRIDED, "column_halves", {"x": x}, {"out": ((8, 64), np.float32)}, 2, "BLOCK",
                         args=["out", "x"])
    np.testing.assert_array_equal(outs["out"], 2 * x)  # scaling by 2 is exact
    load = log.of_task(1, "memcpy")[0]
    assert (load.srcs[0].offset, load.srcs[0].seg, load.srcs[0].stride, load.srcs[0].count) == (128, 128, 256, 8)
    assert (load.dst.space, load.dst.bytes) == ("NRAM", 1024)
    store = log.of_task(1, "memcpy_complete")[0]
    assert (store.dst.buffer, store.dst.offset, store.dst.stride, store.dst.bytes) == ("out", 128, 256, 7 * 256 + 128)


def test_sync_io_does_not_wait_for_the_move_pipe():
    src = """
    __mlu_entry__ void stage(float* out, float* x) {
      __mlu_shared__ float shared[32];
      __nram__ float buf[32];
      if (coreId == 0) __memcpy(shared, x, 128, GDRAM2SRAM);
      __sync_cluster();
      __memcpy_async(buf, shared, 128, SRAM2NRAM);
      __sync_io();  // SRAM2NRAM runs on the move pipe: this does not wait for it
      __bang_add(buf, buf, buf, 32);
      __memcpy(out + taskId * 32, buf, 128, NRAM2GDRAM);
    }"""
    x = np.arange(32, dtype=np.float32)
    args = dict(inputs={"x": x}, outputs={"out": ((4, 32), np.float32)}, task_dim=4, args=["out", "x"])
    with pytest.raises(BangEmulationError, match=r"SRAM2NRAM.*before __sync_move\(\) or __sync\(\)"):
        run_bang(src, "stage", **args)
    outs, _ = run_bang(src.replace("__sync_io();", "__sync_move();"), "stage", **args)
    np.testing.assert_array_equal(outs["out"], np.tile(2 * x, (4, 1)))


TWO_KERNELS = """
__mlu_entry__ void partial(float* tmp, float* x) {
  __nram__ float buf[64];
  __memcpy(buf, x + taskId * 64, 256, GDRAM2NRAM);
  __bang_sumpool(buf, buf, 32, 1, 2, 1, 2, 1, 1);
  __memcpy(tmp + taskId * 32, buf, 128, NRAM2GDRAM);
}
__mlu_entry__ void combine(float* out, float* tmp) {
  __nram__ float buf[4][32];
  if (taskId != 0) return;
  __memcpy(buf, tmp, 4 * 128, GDRAM2NRAM);
  __bang_sumpool((float*)buf, (float*)buf, 32, 1, 4, 1, 4, 1, 1);
  __memcpy(out, buf, 128, NRAM2GDRAM);
}
void launch_sum(cnrtQueue_t queue, float* x, float* out) {  // a DEVICE-scope sync: two kernels
  float* tmp;
  cnrtMalloc((void**)&tmp, 4 * 128);
  cnrtDim3_t dim = {4, 1, 1};
  PF_LAUNCH(partial, dim, CNRT_FUNC_TYPE_UNION1, queue, tmp, x);
  PF_LAUNCH(combine, dim, CNRT_FUNC_TYPE_UNION1, queue, out, tmp);
  cnrtQueueSync(queue);
  cnrtFree(tmp);
}
"""


def test_launcher_may_chain_kernels_through_a_workspace():
    x = RNG.standard_normal(256, dtype=np.float32)
    outs, log = run_bang(TWO_KERNELS, "partial", {"x": x}, {"out": ((32,), np.float32)}, 4,
                         args=["x", "out"], launcher="launch_sum")
    np.testing.assert_allclose(outs["out"], x.reshape(8, 32).sum(axis=0), rtol=1e-5)  # fp32 sums of 8
    launches = [e for e in log.events if e.kind in ("launch", "launch_end")]
    assert [(e.kind, e.op) for e in launches] == [("launch", "partial"), ("launch_end", "partial"),
                                                 ("launch", "combine"), ("launch_end", "combine")]
    first_store = next(e for e in log.events if e.kind == "memcpy" and e.op == "NRAM2GDRAM")
    assert first_store.dst.buffer.startswith("gdram")  # the launcher's own cnrtMalloc workspace
