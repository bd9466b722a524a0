// bang_emu_runtime.h - copies, pipeline waits, barriers, task scheduler and the
// host API (cnrt*, PF_LAUNCH) of the BANG C emulator. Included by bang_emu.h.
#pragma once

namespace pf_bang {

// ---- hazards against this task's pending asynchronous copies ---------------
// A read may not touch a pending copy's destination; a write may not touch its
// destination or its source (the copy may still be reading it).
inline void check_hazard(const char* what, const char* role, const Span& s, bool write) {
  for (const Copy& c : cur().pending) {
    const char* clash = nullptr;
    if (overlap(s, c.dst)) clash = "destination";
    else if (write && overlap(s, c.src)) clash = "source";
    if (!clash) continue;
    fail(std::string(what) + ": " + role + " " + loc_json(s) + (write ? " writes" : " reads") + " the " + clash +
         " of pending async copy #" + std::to_string(c.id) + " (" + dir_info(c.dir).name + ", issued at seq " +
         std::to_string(c.issue_seq) + ") before " + (c.io ? "__sync_io()" : "__sync_move()") + " or __sync()");
  }
}

inline void do_copy(const Copy& c) {
  for (size_t i = 0; i < c.dst.count; ++i)
    std::memmove((void*)(c.dst.base + i * c.dst.stride), (const void*)(c.src.base + i * c.src.stride), c.dst.seg);
  if (space_of(c.dst) == GDRAM) mark_written(c.dst, cur().id);
}

inline Copy make_copy(const char* what, void* dst, const void* src, int size, int dir, int dst_stride,
                      int src_stride, int segnum) {
  if (dir < GDRAM2NRAM || dir > GDRAM2GDRAM) fail(std::string(what) + ": unknown direction " + std::to_string(dir));
  if (size < 0 || segnum < 0) fail(std::string(what) + ": negative size or segment count");
  if (segnum > 0 && (dst_stride < size || src_stride < size) && dir != NRAM2NRAM)
    fail(std::string(what) + ": stride smaller than the segment size");
  DirInfo d = dir_info(dir);
  Copy c{g().next_copy++, 0, dir, {(uintptr_t)dst, (size_t)size, (size_t)dst_stride, (size_t)segnum + 1},
         {(uintptr_t)src, (size_t)size, (size_t)src_stride, (size_t)segnum + 1}, d.io};
  if (size == 0) return c;
  Space ds = space_of(c.dst), ss = space_of(c.src);
  if (ds != d.dst || ss != d.src)
    fail(std::string(what) + "(" + d.name + "): destination lies in " + space_name(ds) + " and source in " +
         space_name(ss) + ", but the direction needs " + space_name(d.dst) + " <- " + space_name(d.src) +
         " (dst " + loc_json(c.dst) + ", src " + loc_json(c.src) + ")");
  if ((ds == SRAM || ss == SRAM) && g().launch->type == 1)
    fail(std::string(what) + ": SRAM used by a CNRT_FUNC_TYPE_BLOCK task (BLOCK tasks have no shared SRAM)");
  check_hazard(what, "source", c.src, false);
  check_hazard(what, "destination", c.dst, true);
  return c;
}

inline void memcpy_sync(void* dst, const void* src, int size, int dir, int ds, int ss, int segnum) {
  Copy c = make_copy("__memcpy", dst, src, size, dir, ds, ss, segnum);
  do_copy(c);
  log_event("memcpy", dir_info(dir).name, &c.dst, {c.src}, (long long)c.id);
}
inline void memcpy_async(void* dst, const void* src, int size, int dir, int ds, int ss, int segnum) {
  Copy c = make_copy("__memcpy_async", dst, src, size, dir, ds, ss, segnum);
  c.issue_seq = log_event("memcpy_issue", dir_info(dir).name, &c.dst, {c.src}, (long long)c.id);
  cur().pending.push_back(c);
}
// Complete the pending copies of the IO pipe (io) and/or the move pipe (move).
inline void wait_copies(const char* name, bool io, bool move) {
  std::vector<Copy> keep;
  for (const Copy& c : cur().pending) {
    if ((c.io && io) || (!c.io && move)) {
      do_copy(c);
      log_event("memcpy_complete", dir_info(c.dir).name, &c.dst, {c.src}, (long long)c.id);
    } else {
      keep.push_back(c);
    }
  }
  cur().pending = keep;
  log_event("wait", name, nullptr, {});
}

// ---- tasks and barriers --------------------------------------------------
inline void switch_to_scheduler() {
  Launch* l = g().launch;
  swapcontext(&l->tasks[l->current].ctx, &l->sched);
}
inline void barrier(int kind) {
  Launch* l = g().launch;
  const char* name = kind == 1 ? "__sync_cluster" : "__sync_all";
  if (l->type == 1) fail(std::string(name) + "() in a CNRT_FUNC_TYPE_BLOCK kernel (BLOCK tasks do not form a cluster)");
  if (!cur().pending.empty())
    fail(std::string(name) + "() with " + std::to_string(cur().pending.size()) +
         " async copies not yet waited for (call __sync_io()/__sync_move()/__sync() first)");
  log_event("barrier_arrive", name, nullptr, {});
  cur().state = Task::AT_BARRIER;
  cur().barrier = kind;
  switch_to_scheduler();
  log_event("barrier_leave", name, nullptr, {});
}

inline void task_entry() {
  Launch* l = g().launch;
  log_event("task_begin", l->kernel, nullptr, {});
  l->body();
  if (!cur().pending.empty())
    fail("kernel returned with " + std::to_string(cur().pending.size()) +
         " async copies never waited for (the emulator requires an explicit __sync*)");
  log_event("task_end", l->kernel, nullptr, {});
  cur().state = Task::DONE;
  switch_to_scheduler();
}

inline void load_task(Launch& l, int t) {
  size_t n = nram_used(), s = sram_used();
  if (l.loaded_task >= 0 && n) std::memcpy(l.tasks[l.loaded_task].nram.data(), __start_pf_nram, n);
  if (n && l.loaded_task != t) std::memcpy(__start_pf_nram, l.tasks[t].nram.data(), n);
  int c = l.tasks[t].cluster;
  if (s && l.loaded_cluster != c) {
    if (l.loaded_cluster >= 0) std::memcpy(l.sram[l.loaded_cluster].data(), __start_pf_sram, s);
    std::memcpy(__start_pf_sram, l.sram[c].data(), s);
  }
  l.loaded_task = t;
  l.loaded_cluster = c;
}

// Release a barrier group when all its members have arrived at the same kind.
inline bool release_barriers(Launch& l) {
  bool any = false;
  for (Task& t : l.tasks) {
    if (t.state != Task::AT_BARRIER) continue;
    bool all = true;
    for (Task& u : l.tasks) {
      bool member = t.barrier == 1 ? u.cluster == t.cluster : u.union_block == t.union_block;
      if (member && !(u.state == Task::AT_BARRIER && u.barrier == t.barrier)) all = false;
    }
    if (!all) continue;
    for (Task& u : l.tasks) {
      bool member = t.barrier == 1 ? u.cluster == t.cluster : u.union_block == t.union_block;
      if (member) u.state = Task::READY;
    }
    any = true;
  }
  return any;
}

inline void run_launch(Launch& l) {
  const size_t stack_bytes = 1 << 20;
  for (Task& t : l.tasks) {
    t.nram.assign(nram_used(), (char)0xFF);
    t.stack.resize(stack_bytes);
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.data();
    t.ctx.uc_stack.ss_size = stack_bytes;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, (void (*)())task_entry, 0);
  }
  for (;;) {
    int next = -1;
    for (Task& t : l.tasks) if (t.state == Task::READY) { next = t.id; break; }
    if (next < 0) {
      if (release_barriers(l)) continue;
      std::string waiting;
      for (Task& t : l.tasks)
        if (t.state == Task::AT_BARRIER) waiting += " " + std::to_string(t.id) + (t.barrier == 1 ? "(cluster)" : "(all)");
      if (waiting.empty()) break;
      l.current = -1;
      fail(l.kernel + ": deadlock - tasks" + waiting +
           " wait at a barrier that some task of their cluster/union never reaches");
    }
    load_task(l, next);
    l.current = next;
    swapcontext(&l.sched, &l.tasks[next].ctx);
    l.current = -1;
  }
}

}  // namespace pf_bang

// ---- device-side API -------------------------------------------------------
inline void __memcpy(void* dst, const void* src, int size, mluMemcpyDirection_t dir) {
  pf_bang::memcpy_sync(dst, src, size, dir, size, size, 0);
}
inline void __memcpy(void* dst, const void* src, int size, mluMemcpyDirection_t dir, int dst_stride,
                     int src_stride, int segnum) {
  pf_bang::memcpy_sync(dst, src, size, dir, dst_stride, src_stride, segnum);
}
inline void __memcpy_async(void* dst, const void* src, int size, mluMemcpyDirection_t dir) {
  pf_bang::memcpy_async(dst, src, size, dir, size, size, 0);
}
inline void __memcpy_async(void* dst, const void* src, int size, mluMemcpyDirection_t dir, int dst_stride,
                           int src_stride, int segnum) {
  pf_bang::memcpy_async(dst, src, size, dir, dst_stride, src_stride, segnum);
}
inline void __sync_io() { pf_bang::wait_copies("__sync_io", true, false); }
inline void __sync_move() { pf_bang::wait_copies("__sync_move", false, true); }
inline void __sync_compute() { pf_bang::wait_copies("__sync_compute", false, false); }
inline void __sync() { pf_bang::wait_copies("__sync", true, true); }
inline void __sync_io_move_compute() { pf_bang::wait_copies("__sync_io_move_compute", true, true); }
inline void __sync_cluster() { pf_bang::barrier(1); }
inline void __sync_all() { pf_bang::barrier(2); }
#define __bang_printf printf

#define taskId (::pf_bang::cur().id)
#define taskIdX (::pf_bang::cur().x)
#define taskIdY (::pf_bang::cur().y)
#define taskIdZ (::pf_bang::cur().z)
#define taskDimX ((int)::pf_bang::g().launch->dx)
#define taskDimY ((int)::pf_bang::g().launch->dy)
#define taskDimZ ((int)::pf_bang::g().launch->dz)
#define taskDim ((int)::pf_bang::g().launch->tasks.size())
#define coreId (::pf_bang::cur().core)
#define coreDim (::pf_bang::g().launch->core_dim)
#define clusterId (::pf_bang::cur().cluster)
#define clusterDim ((int)::pf_bang::g().launch->sram.size())

// ---- host-side API (the subset emitted launchers and the harness use) --------
typedef struct { unsigned int x, y, z; } cnrtDim3_t;
// Values are the number of cores a task type asks for (assumption, see docs/bang.md).
typedef enum {
  CNRT_FUNC_TYPE_BLOCK = 1, CNRT_FUNC_TYPE_UNION1 = 4, CNRT_FUNC_TYPE_UNION2 = 8,
  CNRT_FUNC_TYPE_UNION4 = 16, CNRT_FUNC_TYPE_UNION8 = 32,
} cnrtFunctionType_t;
#define cnrtFuncTypeBlock CNRT_FUNC_TYPE_BLOCK
#define cnrtFuncTypeUnion1 CNRT_FUNC_TYPE_UNION1
#define cnrtFuncTypeUnion2 CNRT_FUNC_TYPE_UNION2
#define cnrtFuncTypeUnion4 CNRT_FUNC_TYPE_UNION4
#define cnrtFuncTypeUnion8 CNRT_FUNC_TYPE_UNION8
typedef int cnrtRet_t;
#define CNRT_RET_SUCCESS 0
struct pf_bang_queue { int unused; };
typedef pf_bang_queue* cnrtQueue_t;
typedef enum { cnrtMemcpyHostToDev = 1, cnrtMemcpyDevToHost = 2, cnrtMemcpyDevToDev = 3 } cnrtMemTransDir_t;

inline cnrtRet_t cnrtQueueCreate(cnrtQueue_t* q) { *q = new pf_bang_queue{0}; return 0; }
inline cnrtRet_t cnrtQueueDestroy(cnrtQueue_t q) { delete q; return 0; }
inline cnrtRet_t cnrtQueueSync(cnrtQueue_t) { return 0; }  // launches run to completion
inline cnrtRet_t cnrtMalloc(void** p, size_t bytes) {
  size_t n = (bytes + 63) / 64 * 64 + 64;  // pad so neighbouring buffers never touch
  *p = std::aligned_alloc(64, n);
  auto lo = (uintptr_t)*p;
  std::string name = "gdram" + std::to_string(pf_bang::g().regions.size());
  pf_bang::g().regions.push_back({lo, lo + bytes, name, false, std::vector<int>(bytes, -1), std::vector<uint8_t>(bytes, 0)});
  return 0;
}
inline cnrtRet_t cnrtFree(void* p) {
  auto& rs = pf_bang::g().regions;
  for (size_t i = 0; i < rs.size(); ++i)
    if (rs[i].lo == (uintptr_t)p) { rs.erase(rs.begin() + i); break; }
  std::free(p);
  return 0;
}
inline cnrtRet_t cnrtMemcpy(void* dst, void* src, size_t bytes, cnrtMemTransDir_t) {
  std::memcpy(dst, src, bytes);
  return 0;
}

namespace pf_bang {
// Harness: name a cnrtMalloc'ed buffer for the log; outputs are tracked for coverage.
inline void name_gdram(void* p, const std::string& name, bool output) {
  Region* r = region_of((uintptr_t)p);
  if (!r || r->lo != (uintptr_t)p) fail("name_gdram: pointer does not start a cnrtMalloc buffer");
  r->name = name;
  r->output = output;
}

inline void launch(const char* kernel, cnrtDim3_t dim, cnrtFunctionType_t type, cnrtQueue_t,
                   std::function<void()> body) {
  Launch l;
  l.kernel = kernel;
  l.dx = dim.x; l.dy = dim.y; l.dz = dim.z;
  l.type = (int)type;
  l.union_n = type == CNRT_FUNC_TYPE_BLOCK ? 0 : (int)type / 4;
  l.core_dim = type == CNRT_FUNC_TYPE_BLOCK ? 1 : 4;
  l.body = std::move(body);
  g().launch = &l;
  size_t ntask = (size_t)dim.x * dim.y * dim.z;
  if (ntask == 0) fail(l.kernel + ": empty launch dimension");
  if (type != CNRT_FUNC_TYPE_BLOCK && (l.union_n <= 0 || dim.x % (4 * l.union_n) != 0))
    fail(l.kernel + ": UNION" + std::to_string(l.union_n) + " needs dim.x divisible by " +
         std::to_string(4 * l.union_n) + " (4 cores per cluster), got dim.x = " + std::to_string(dim.x));
  if (nram_used() > (size_t)PF_BANG_NRAM_BYTES)
    fail(l.kernel + ": NRAM over capacity: __nram__ buffers take " + std::to_string(nram_used()) +
         " bytes, the MLU370 limit is " + std::to_string(PF_BANG_NRAM_BYTES) + " bytes per core");
  if (sram_used() > (size_t)PF_BANG_SRAM_BYTES)
    fail(l.kernel + ": SRAM over capacity: __mlu_shared__ buffers take " + std::to_string(sram_used()) +
         " bytes, the MLU370 limit is " + std::to_string(PF_BANG_SRAM_BYTES) + " bytes per cluster");
  if (sram_used() && type == CNRT_FUNC_TYPE_BLOCK)
    fail(l.kernel + ": __mlu_shared__ buffers in a CNRT_FUNC_TYPE_BLOCK kernel (BLOCK tasks have no shared SRAM)");
  l.tasks.resize(ntask);
  for (size_t i = 0; i < ntask; ++i) {
    Task& t = l.tasks[i];
    t.id = (int)i;
    t.x = (int)(i % dim.x); t.y = (int)(i / dim.x % dim.y); t.z = (int)(i / (dim.x * dim.y));
    t.core = (int)i % l.core_dim;
    t.cluster = (int)i / l.core_dim;
    t.union_block = type == CNRT_FUNC_TYPE_BLOCK ? (int)i : (int)i / (4 * l.union_n);
  }
  l.sram.assign(ntask / l.core_dim, std::vector<char>(sram_used(), (char)0xFF));
  log_event("launch", l.kernel, nullptr, {});
  run_launch(l);
  log_event("launch_end", l.kernel, nullptr, {});
  g().launch = nullptr;
}
}  // namespace pf_bang

// Emitted host launchers call PF_LAUNCH; under cncc it is defined as
// kernel<<<dim, type, queue>>>(args...) (see docs/bang.md).
#define PF_LAUNCH(kernel, dim, type, queue, ...) \
  ::pf_bang::launch(#kernel, (dim), (type), (queue), [&]() { kernel(__VA_ARGS__); })
