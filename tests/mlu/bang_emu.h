// bang_emu.h - run Cambricon BANG C kernels with g++ on the CPU, with checks.
//
// What it models (see docs/bang.md for sources and assumptions):
//   * memory spaces: __nram__ (per core), __mlu_shared__ (SRAM, per cluster),
//     GDRAM buffers allocated with cnrtMalloc; every __memcpy / __bang_* checks
//     that its operands lie in the space its direction or kind requires;
//   * capacities: total __nram__ / __mlu_shared__ bytes, checked at launch;
//   * asynchronous copies: __memcpy_async is performed when waited for
//     (__sync_io / __sync_move / __sync / __sync_io_move_compute); touching a
//     pending copy's bytes before that wait is reported as an error;
//   * tasks: one fiber per task, run in taskId order and switched only at
//     __sync_cluster / __sync_all / task end, so runs are deterministic and
//     the barriers have their real meaning;
//   * an event log (JSON lines) and GDRAM output coverage for the test harness.
//
// Scheme for __nram__ / __mlu_shared__: the qualifiers put the variable in the
// linker sections "pf_nram" / "pf_sram", whose bounds (__start_/__stop_ symbols)
// define the NRAM and SRAM address ranges. Only one task runs at a time; on a
// task switch the emulator saves that task's NRAM image (and its cluster's SRAM
// image) and loads the next one's, so each task sees private NRAM and each
// cluster a shared SRAM. Fresh NRAM/SRAM is filled with 0xFF bytes (NaN as
// float or half) so that reading never-written on-chip data is visible.
#pragma once
#ifdef __BANG__
#error "bang_emu.h emulates BANG C on the host; compile real kernels with cncc instead"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>
#include <ucontext.h>

#ifndef PF_BANG_NRAM_BYTES
#define PF_BANG_NRAM_BYTES (768 * 1024 - 128 * 1024)  // MLU370: 768 KB, 128 KB kept for the stack
#endif
#ifndef PF_BANG_SRAM_BYTES
#define PF_BANG_SRAM_BYTES (4096 * 1024 - 128 * 1024)  // MLU370: 4 MB per cluster, 128 KB reserved
#endif

#define __mlu_entry__
#define __mlu_global__
#define __mlu_func__ inline
#define __nram__ static __attribute__((section("pf_nram"), aligned(64)))
#define __mlu_shared__ static __attribute__((section("pf_sram"), aligned(64)))
#define __mlu_device__ __attribute__((section("pf_gdram"), aligned(64)))  // variables only

typedef _Float16 half;
inline half __float2half_rn(float x) { return (half)x; }
inline float __half2float(half x) { return (float)x; }

enum mluMemcpyDirection_t {
  GDRAM2NRAM, NRAM2GDRAM, NRAM2NRAM, SRAM2NRAM, NRAM2SRAM,
  GDRAM2SRAM, SRAM2GDRAM, SRAM2SRAM, GDRAM2GDRAM,
};

namespace pf_bang {

enum Space { GDRAM = 0, NRAM = 1, SRAM = 2, NOWHERE = 3 };
inline const char* space_name(int s) {
  static const char* names[] = {"GDRAM", "NRAM", "SRAM", "none"};
  return names[s];
}
struct DirInfo { const char* name; Space dst, src; bool io; };  // io: IO pipe, else move pipe
inline DirInfo dir_info(int d) {
  static const DirInfo t[] = {
      {"GDRAM2NRAM", NRAM, GDRAM, true},  {"NRAM2GDRAM", GDRAM, NRAM, true},
      {"NRAM2NRAM", NRAM, NRAM, false},   {"SRAM2NRAM", NRAM, SRAM, false},
      {"NRAM2SRAM", SRAM, NRAM, false},   {"GDRAM2SRAM", SRAM, GDRAM, true},
      {"SRAM2GDRAM", GDRAM, SRAM, true},  {"SRAM2SRAM", SRAM, SRAM, false},
      {"GDRAM2GDRAM", GDRAM, GDRAM, true}};
  return t[d];
}

// Byte set touched by one operand: count segments of seg bytes, stride apart.
struct Span {
  uintptr_t base = 0; size_t seg = 0; size_t stride = 0; size_t count = 1;
  uintptr_t lo() const { return base; }
  uintptr_t hi() const { return base + (count - 1) * stride + seg; }
};
inline bool overlap(const Span& a, const Span& b) {
  if (a.seg == 0 || b.seg == 0 || a.hi() <= b.lo() || b.hi() <= a.lo()) return false;
  for (size_t i = 0; i < a.count; ++i) {
    uintptr_t alo = a.base + i * a.stride, ahi = alo + a.seg;
    for (size_t j = 0; j < b.count; ++j) {
      uintptr_t blo = b.base + j * b.stride;
      if (alo < blo + b.seg && blo < ahi) return true;
    }
  }
  return false;
}

struct Region {  // one GDRAM allocation
  uintptr_t lo, hi; std::string name; bool output;
  std::vector<int> writer;   // per byte: last writing task, -1 none
  std::vector<uint8_t> multi;  // per byte: written by more than one task
};
struct Copy {
  uint64_t id, issue_seq; int dir; Span dst, src; bool io;
};
struct Task {
  int id, x, y, z, cluster, core, union_block;
  ucontext_t ctx;
  std::vector<char> stack, nram;
  std::vector<Copy> pending;
  enum State { READY, AT_BARRIER, DONE } state = READY;
  int barrier = 0;  // 1: __sync_cluster, 2: __sync_all
};
struct Launch {
  std::string kernel;
  unsigned dx = 1, dy = 1, dz = 1;
  int type = 0, union_n = 0, core_dim = 1;
  std::vector<Task> tasks;
  std::vector<std::vector<char>> sram;  // per cluster
  int current = -1, loaded_task = -1, loaded_cluster = -1;
  ucontext_t sched;
  std::function<void()> body;
};
struct State {
  std::vector<Region> regions;
  std::string out_dir;
  FILE* log = nullptr;
  uint64_t seq = 0, next_copy = 0;
  Launch* launch = nullptr;
};
inline State& g() { static State s; return s; }
inline Task& cur() {
  Launch* l = g().launch;
  if (!l || l->current < 0) { std::fprintf(stderr, "BANG-EMU ERROR: task variable used outside a kernel\n"); std::exit(3); }
  return l->tasks[l->current];
}

}  // namespace pf_bang

extern "C" {
extern char __start_pf_nram[] __attribute__((weak)), __stop_pf_nram[] __attribute__((weak));
extern char __start_pf_sram[] __attribute__((weak)), __stop_pf_sram[] __attribute__((weak));
extern char __start_pf_gdram[] __attribute__((weak)), __stop_pf_gdram[] __attribute__((weak));
}

namespace pf_bang {

inline size_t nram_used() { return (size_t)(__stop_pf_nram - __start_pf_nram); }
inline size_t sram_used() { return (size_t)(__stop_pf_sram - __start_pf_sram); }

inline void close_log();
[[noreturn]] inline void fail(const std::string& msg) {
  Launch* l = g().launch;
  std::string who = (l && l->current >= 0) ? "task " + std::to_string(l->current) + " of " + l->kernel + ": " : "";
  std::fprintf(stderr, "BANG-EMU ERROR: %s%s\n", who.c_str(), msg.c_str());
  close_log();
  std::exit(3);
}

inline Region* region_of(uintptr_t p) {
  for (auto& r : g().regions) if (p >= r.lo && p < r.hi) return &r;
  return nullptr;
}
// Which space holds all of s; NOWHERE if it is outside every space or straddles two.
inline Space space_of(const Span& s) {
  uintptr_t lo = s.lo(), hi = s.hi();
  auto in = [&](const char* a, const char* b) { return a && lo >= (uintptr_t)a && hi <= (uintptr_t)b; };
  if (in(__start_pf_nram, __stop_pf_nram)) return NRAM;
  if (in(__start_pf_sram, __stop_pf_sram)) return SRAM;
  if (in(__start_pf_gdram, __stop_pf_gdram)) return GDRAM;
  Region* r = region_of(lo);
  if (r && hi <= r->hi) return GDRAM;
  return NOWHERE;
}

// ---- event log -----------------------------------------------------------
inline std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) { if (c == '"' || c == '\\') o += '\\'; if ((unsigned char)c >= 0x20) o += c; }
  return o + "\"";
}
inline std::string loc_json(const Span& s) {
  Space sp = space_of(s);
  std::string buf; uintptr_t off = s.lo();
  if (sp == NRAM) off -= (uintptr_t)__start_pf_nram;
  else if (sp == SRAM) off -= (uintptr_t)__start_pf_sram;
  else if (sp == GDRAM) {
    if (Region* r = region_of(s.lo())) { buf = r->name; off -= r->lo; }
    else { buf = "__mlu_device__"; off -= (uintptr_t)__start_pf_gdram; }
  }
  char tmp[256];
  std::snprintf(tmp, sizeof tmp, "{\"space\":\"%s\",\"buffer\":%s,\"offset\":%zu,\"bytes\":%zu,\"seg\":%zu,\"stride\":%zu,\"count\":%zu}",
                space_name(sp), json_str(buf).c_str(), (size_t)off, (size_t)(s.hi() - s.lo()), s.seg, s.stride, s.count);
  return tmp;
}
inline uint64_t log_event(const char* kind, const std::string& op, const Span* dst,
                          const std::vector<Span>& srcs, long long copy = -1) {
  State& st = g();
  uint64_t seq = st.seq++;
  if (!st.log) return seq;
  Launch* l = st.launch;
  std::string line = "{\"seq\":" + std::to_string(seq) + ",\"task\":" +
                     std::to_string(l && l->current >= 0 ? l->current : -1) + ",\"kind\":" + json_str(kind) +
                     ",\"op\":" + json_str(op);
  if (copy >= 0) line += ",\"copy\":" + std::to_string(copy);
  if (dst) line += ",\"dst\":" + loc_json(*dst);
  line += ",\"srcs\":[";
  for (size_t i = 0; i < srcs.size(); ++i) line += (i ? "," : "") + loc_json(srcs[i]);
  line += "]}\n";
  std::fputs(line.c_str(), st.log);
  return seq;
}

// ---- GDRAM coverage ------------------------------------------------------
inline void mark_written(const Span& s, int task) {
  for (size_t i = 0; i < s.count; ++i) {
    uintptr_t lo = s.base + i * s.stride;
    Region* r = region_of(lo);
    if (!r) continue;
    for (uintptr_t p = lo; p < lo + s.seg; ++p) {
      int& w = r->writer[p - r->lo];
      if (w >= 0 && w != task) r->multi[p - r->lo] = 1;
      w = task;
    }
  }
}
inline void write_coverage() {
  State& st = g();
  if (st.out_dir.empty()) return;
  FILE* f = std::fopen((st.out_dir + "/coverage.json").c_str(), "w");
  if (!f) return;
  std::fputs("{", f);
  bool first = true;
  for (auto& r : st.regions) {
    if (!r.output) continue;
    size_t n = r.hi - r.lo, written = 0, multi = 0;
    std::string gaps;
    for (size_t i = 0; i < n; ++i) {
      written += r.writer[i] >= 0; multi += r.multi[i];
      if (r.writer[i] < 0 && (i == 0 || r.writer[i - 1] >= 0)) {
        size_t j = i; while (j < n && r.writer[j] < 0) ++j;
        gaps += (gaps.empty() ? "" : ",") + std::string("[") + std::to_string(i) + "," + std::to_string(j) + "]";
      }
    }
    std::fprintf(f, "%s%s:{\"bytes\":%zu,\"written\":%zu,\"multi_task_bytes\":%zu,\"unwritten\":[%s]}",
                 first ? "" : ",", json_str(r.name).c_str(), n, written, multi, gaps.c_str());
    first = false;
  }
  std::fputs("}\n", f);
  std::fclose(f);
}
inline void close_log() {
  State& st = g();
  if (st.log) { std::fclose(st.log); st.log = nullptr; }
  write_coverage();
}
// Harness entry: events go to <dir>/events.jsonl, coverage to <dir>/coverage.json.
inline void set_output_dir(const std::string& dir) {
  State& st = g();
  st.out_dir = dir;
  st.log = std::fopen((dir + "/events.jsonl").c_str(), "w");
}
inline void finish() { close_log(); }

}  // namespace pf_bang

#include "bang_emu_runtime.h"
#include "bang_emu_ops.h"
