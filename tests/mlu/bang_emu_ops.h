// bang_emu_ops.h - the __bang_* vector instructions of the BANG C emulator, for
// float and half. Semantics and constraints follow the table in docs/bang.md;
// every op checks its operands (NRAM, alignment, pending async copies), reads
// all sources before writing (so any aliasing is fine) and logs one event.
#pragma once
#include <type_traits>

namespace pf_bang {

constexpr size_t kVecAddrAlign = 64;   // NRAM operand address alignment (bytes)
constexpr size_t kVecGranule = 128;    // vector length granule (bytes): one VFU cycle

template <class T>
constexpr bool is_vec_type = std::is_same<T, float>::value || std::is_same<T, half>::value;

struct Operand { const void* p; size_t bytes; bool write; const char* role; };

// Shared checks for one vector instruction; `granule` asks n*sizeof(T) % 128 == 0.
inline void check_vec(const char* op, std::initializer_list<Operand> ops, size_t granule_bytes) {
  if (granule_bytes % kVecGranule != 0)
    fail(std::string(op) + ": " + std::to_string(granule_bytes) + " bytes is not a multiple of " +
         std::to_string(kVecGranule) + " (pad the element count)");
  std::vector<Span> srcs;
  const Span* dst = nullptr;
  Span dspan;
  for (const Operand& o : ops) {
    Span s{(uintptr_t)o.p, o.bytes, o.bytes, 1};
    if (o.bytes && space_of(s) != NRAM)
      fail(std::string(op) + ": " + o.role + " " + loc_json(s) + " is not in NRAM");
    if ((uintptr_t)o.p % kVecAddrAlign != 0)
      fail(std::string(op) + ": " + o.role + " address is not " + std::to_string(kVecAddrAlign) + "-byte aligned " +
           loc_json(s));
    check_hazard(op, o.role, s, o.write);
    if (o.write) { dspan = s; dst = &dspan; } else { srcs.push_back(s); }
  }
  log_event("compute", op, dst, srcs);
}

template <class T> inline std::vector<float> load(const T* p, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (float)p[i];
  return v;
}
template <class T> inline void store(T* p, const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) p[i] = (T)v[i];
}

template <class T, class F> inline void unary(const char* op, T* dst, const T* src, int n, F f) {
  static_assert(is_vec_type<T>, "emulated __bang_* ops take float or half");
  size_t b = (size_t)n * sizeof(T);
  check_vec(op, {{src, b, false, "src"}, {dst, b, true, "dst"}}, b);
  std::vector<float> v = load(src, n);
  for (float& x : v) x = f(x);
  store(dst, v);
}
template <class T, class F> inline void binary(const char* op, T* dst, const T* a, const T* b, int n, F f) {
  static_assert(is_vec_type<T>, "emulated __bang_* ops take float or half");
  size_t nb = (size_t)n * sizeof(T);
  check_vec(op, {{a, nb, false, "src0"}, {b, nb, false, "src1"}, {dst, nb, true, "dst"}}, nb);
  std::vector<float> x = load(a, n), y = load(b, n);
  for (int i = 0; i < n; ++i) x[i] = f(x[i], y[i]);
  store(dst, x);
}
// dst[i] = f(src[i], seg[i % seg_n]): the __bang_cycle_* broadcast family.
template <class T, class F>
inline void cycle(const char* op, T* dst, const T* src, const T* seg, int n, int seg_n, F f) {
  static_assert(is_vec_type<T>, "emulated __bang_* ops take float or half");
  if (seg_n <= 0 || n % seg_n != 0) fail(std::string(op) + ": element count is not a multiple of the segment count");
  size_t nb = (size_t)n * sizeof(T), sb = (size_t)seg_n * sizeof(T);
  if (sb % kVecGranule != 0) fail(std::string(op) + ": segment bytes not a multiple of 128");
  check_vec(op, {{src, nb, false, "src"}, {seg, sb, false, "seg"}, {dst, nb, true, "dst"}}, nb);
  std::vector<float> x = load(src, n), s = load(seg, seg_n);
  for (int i = 0; i < n; ++i) x[i] = f(x[i], s[i % seg_n]);
  store(dst, x);
}

// HWC pooling shared by sumpool / maxpool / minpool (channel fastest).
template <class T, class F>
inline void pool(const char* op, T* dst, const T* src, int c, int h, int w, int kh, int kw, int sh, int sw,
                 float init, F f) {
  static_assert(is_vec_type<T>, "emulated __bang_* ops take float or half");
  if (c <= 0 || kh <= 0 || kw <= 0 || sh <= 0 || sw <= 0 || kh > h || kw > w)
    fail(std::string(op) + ": bad pooling shape");
  int oh = (h - kh) / sh + 1, ow = (w - kw) / sw + 1;
  size_t ib = (size_t)c * h * w * sizeof(T), ob = (size_t)c * oh * ow * sizeof(T);
  if ((size_t)c * sizeof(T) % kVecGranule != 0) fail(std::string(op) + ": channel bytes not a multiple of 128");
  check_vec(op, {{src, ib, false, "src"}, {dst, ob, true, "dst"}}, ob);
  std::vector<float> in = load(src, (size_t)c * h * w), out((size_t)c * oh * ow, init);
  for (int y = 0; y < oh; ++y)
    for (int x = 0; x < ow; ++x)
      for (int i = 0; i < kh; ++i)
        for (int j = 0; j < kw; ++j)
          for (int k = 0; k < c; ++k) {
            float& o = out[((size_t)y * ow + x) * c + k];
            o = f(o, in[(((size_t)(y * sh + i)) * w + (x * sw + j)) * c + k]);
          }
  store(dst, out);
}

// dst[0] = extreme value, then its index as uint32 in the bytes right after it.
template <class T, class Better> inline void arg_extreme(const char* op, T* dst, const T* src, int n, Better better) {
  static_assert(is_vec_type<T>, "emulated __bang_* ops take float or half");
  size_t b = (size_t)n * sizeof(T);
  check_vec(op, {{src, b, false, "src"}, {dst, sizeof(T) + 4, true, "dst"}}, b);
  std::vector<float> v = load(src, n);
  uint32_t best = 0;
  for (int i = 1; i < n; ++i) if (better(v[i], v[best])) best = (uint32_t)i;  // first on ties
  dst[0] = (T)v[best];
  std::memcpy((char*)dst + sizeof(T), &best, 4);
}

}  // namespace pf_bang

#define PF_BANG_UNARY(name, expr)                                      \
  template <class T> inline void name(T* dst, T* src, int n) {         \
    ::pf_bang::unary(#name, dst, src, n, [](float x) { return expr; }); \
  }
PF_BANG_UNARY(__bang_active_relu, x > 0.f ? x : 0.f)
PF_BANG_UNARY(__bang_relu, x > 0.f ? x : 0.f)
PF_BANG_UNARY(__bang_active_exp, std::exp(x))
PF_BANG_UNARY(__bang_active_exphp, std::exp(x))
PF_BANG_UNARY(__bang_active_sigmoid, 1.f / (1.f + std::exp(-x)))
PF_BANG_UNARY(__bang_active_reciphp, 1.f / x)
PF_BANG_UNARY(__bang_recip, 1.f / x)
PF_BANG_UNARY(__bang_active_sqrthp, std::sqrt(x))
PF_BANG_UNARY(__bang_sqrt, std::sqrt(x))
PF_BANG_UNARY(__bang_active_rsqrthp, 1.f / std::sqrt(x))
PF_BANG_UNARY(__bang_square, x * x)
PF_BANG_UNARY(__bang_abs, std::fabs(x))
PF_BANG_UNARY(__bang_active_abs, std::fabs(x))
PF_BANG_UNARY(__bang_pow2, std::exp2(x))
PF_BANG_UNARY(__bang_log2, std::log2(x))
#undef PF_BANG_UNARY

#define PF_BANG_BINARY(name, expr)                                                \
  template <class T> inline void name(T* dst, T* a, T* b, int n) {               \
    ::pf_bang::binary(#name, dst, a, b, n, [](float x, float y) { return expr; }); \
  }
PF_BANG_BINARY(__bang_add, x + y)
PF_BANG_BINARY(__bang_sub, x - y)
PF_BANG_BINARY(__bang_mul, x * y)
PF_BANG_BINARY(__bang_maximum, x > y ? x : y)
PF_BANG_BINARY(__bang_minimum, x < y ? x : y)
PF_BANG_BINARY(__bang_maxequal, x > y ? x : y)
PF_BANG_BINARY(__bang_minequal, x < y ? x : y)
#undef PF_BANG_BINARY

#define PF_BANG_SCALAR(name, expr)                                                            \
  template <class T, class S> inline void name(T* dst, T* src, S value, int n) {             \
    float v = (float)(T)value;                                                                \
    ::pf_bang::unary(#name, dst, src, n, [v](float x) { return expr; });                      \
  }
PF_BANG_SCALAR(__bang_add_scalar, x + v)
PF_BANG_SCALAR(__bang_sub_scalar, x - v)
PF_BANG_SCALAR(__bang_mul_scalar, x * v)
#undef PF_BANG_SCALAR

#define PF_BANG_CYCLE(name, expr)                                                            \
  template <class T> inline void name(T* dst, T* src, T* seg, int n, int seg_n) {            \
    ::pf_bang::cycle(#name, dst, src, seg, n, seg_n, [](float x, float y) { return expr; }); \
  }
PF_BANG_CYCLE(__bang_cycle_add, x + y)
PF_BANG_CYCLE(__bang_cycle_sub, x - y)
PF_BANG_CYCLE(__bang_cycle_mul, x * y)
PF_BANG_CYCLE(__bang_cycle_maxequal, x > y ? x : y)
#undef PF_BANG_CYCLE

// Note the argument order: destination, element count, value.
template <class T, class S> inline void __bang_write_value(T* dst, int n, S value) {
  static_assert(pf_bang::is_vec_type<T>, "emulated __bang_* ops take float or half");
  size_t b = (size_t)n * sizeof(T);
  pf_bang::check_vec("__bang_write_value", {{dst, b, true, "dst"}}, b);
  for (int i = 0; i < n; ++i) dst[i] = (T)value;
}

inline void __bang_half2float(float* dst, half* src, int n) {
  pf_bang::check_vec("__bang_half2float", {{src, n * 2u, false, "src"}, {dst, n * 4u, true, "dst"}}, n * 2u);
  pf_bang::store(dst, pf_bang::load(src, n));
}
inline void __bang_float2half_rn(half* dst, float* src, int n) {
  pf_bang::check_vec("__bang_float2half_rn", {{src, n * 4u, false, "src"}, {dst, n * 2u, true, "dst"}}, n * 2u);
  pf_bang::store(dst, pf_bang::load(src, n));  // _Float16 conversion rounds to nearest even
}

// Sum of each 128-byte group of src written to the first element of that group
// in dst; the group's other dst elements are left undefined (NaN here).
template <class T> inline void __bang_reduce_sum(T* dst, T* src, int n) {
  static_assert(pf_bang::is_vec_type<T>, "emulated __bang_* ops take float or half");
  size_t b = (size_t)n * sizeof(T), group = pf_bang::kVecGranule / sizeof(T);
  pf_bang::check_vec("__bang_reduce_sum", {{src, b, false, "src"}, {dst, b, true, "dst"}}, b);
  std::vector<float> v = pf_bang::load(src, n), out(n, NAN);
  for (size_t k = 0; k < n / group; ++k) {
    float s = 0.f;
    for (size_t i = 0; i < group; ++i) s += v[k * group + i];
    out[k * group] = s;
  }
  pf_bang::store(dst, out);
}
template <class T>
inline void __bang_sumpool(T* dst, T* src, int c, int h, int w, int kh, int kw, int sh, int sw) {
  pf_bang::pool("__bang_sumpool", dst, src, c, h, w, kh, kw, sh, sw, 0.f, [](float a, float b) { return a + b; });
}
template <class T>
inline void __bang_maxpool(T* dst, T* src, int c, int h, int w, int kh, int kw, int sh, int sw) {
  pf_bang::pool("__bang_maxpool", dst, src, c, h, w, kh, kw, sh, sw, -INFINITY,
                [](float a, float b) { return b > a ? b : a; });
}
template <class T>
inline void __bang_minpool(T* dst, T* src, int c, int h, int w, int kh, int kw, int sh, int sw) {
  pf_bang::pool("__bang_minpool", dst, src, c, h, w, kh, kw, sh, sw, INFINITY,
                [](float a, float b) { return b < a ? b : a; });
}
template <class T> inline void __bang_argmax(T* dst, T* src, int n) {
  pf_bang::arg_extreme("__bang_argmax", dst, src, n, [](float a, float b) { return a > b; });
}
template <class T> inline void __bang_argmin(T* dst, T* src, int n) {
  pf_bang::arg_extreme("__bang_argmin", dst, src, n, [](float a, float b) { return a < b; });
}
