/* Library ops of the cpu target's whole-model driver (backends/cpu/driver.py): GEMMs through
   the CBLAS entry points of numpy's own OpenBLAS (bound at load time by address), 2-D Conv as
   an implicit GEMM over phase planes (one group, KxK), directly over phase planes (depthwise
   and other thin ones), a plain GEMM (1x1) or im2col + GEMM (the rest). Large GEMMs are split
   by rows (or columns) over the OpenMP threads, each calling a single-threaded BLAS: the
   driver sets the BLAS to one thread for the run, as the per-step path does. */
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifndef PF_BLASINT
#define PF_BLASINT long long
#endif
typedef PF_BLASINT pf_blasint;
enum { PF_ROW_MAJOR = 101, PF_NO_TRANS = 111, PF_TRANS = 112 };
typedef void (*pf_sgemm_fn)(int, int, int, pf_blasint, pf_blasint, pf_blasint, float, const float *, pf_blasint,
                            const float *, pf_blasint, float, float *, pf_blasint);
typedef void (*pf_dgemm_fn)(int, int, int, pf_blasint, pf_blasint, pf_blasint, double, const double *, pf_blasint,
                            const double *, pf_blasint, double, double *, pf_blasint);
typedef int (*pf_get_threads_fn)(void);
typedef void (*pf_set_threads_fn)(int);
typedef void (*pf_entry_fn)(void **);

static pf_sgemm_fn pf_sgemm;
static pf_dgemm_fn pf_dgemm;
static pf_get_threads_fn pf_blas_get_threads;
static pf_set_threads_fn pf_blas_set_threads;

/* below this many flops a GEMM runs on the calling thread alone (a fork-join costs microseconds) */
#define PF_SPLIT_FLOPS 8.0e6
/* below this many output elements an elementwise loop runs on one thread */
#define PF_PARALLEL_ELEMENTS 131072

static inline double pf_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int pf_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/* One GEMM, C[M,N] = op(A) op(B) + beta C (row-major), split over threads when large: by rows
   of C when M >= N, else by columns. */
#define PF_DEFINE_GEMM(NAME, T, FN)                                                                  \
static void NAME(int ta, int tb, long long M, long long N, long long K, const T *A, long long lda,    \
                 const T *B, long long ldb, T beta, T *C, long long ldc, int may_split) {            \
  int nt = pf_threads();                                                                             \
  if (!may_split || nt < 2 || 2.0 * M * N * K < PF_SPLIT_FLOPS || (M < 2 && N < 2)) {                \
    FN(PF_ROW_MAJOR, ta ? PF_TRANS : PF_NO_TRANS, tb ? PF_TRANS : PF_NO_TRANS, M, N, K, (T)1, A, lda,  \
       B, ldb, beta, C, ldc);                                                                        \
    return;                                                                                          \
  }                                                                                                  \
  _Pragma("omp parallel num_threads(nt)")                                                            \
  {                                                                                                  \
    int t = 0, n = 1;                                                                                \
    PF_THREAD_ID(t, n);                                                                              \
    int rows = M >= N;                                                                               \
    long long len = rows ? M : N, lo = len * t / n, hi = len * (t + 1) / n;                          \
    if (hi > lo) {                                                                                   \
      if (rows)                                                                                      \
        FN(PF_ROW_MAJOR, ta ? PF_TRANS : PF_NO_TRANS, tb ? PF_TRANS : PF_NO_TRANS, hi - lo, N, K,    \
           (T)1, ta ? A + lo : A + lo * lda, lda, B, ldb, beta, C + lo * ldc, ldc);                  \
      else                                                                                           \
        FN(PF_ROW_MAJOR, ta ? PF_TRANS : PF_NO_TRANS, tb ? PF_TRANS : PF_NO_TRANS, M, hi - lo, K,    \
           (T)1, A, lda, tb ? B + lo * ldb : B + lo, ldb, beta, C + lo, ldc);                        \
    }                                                                                                \
  }                                                                                                  \
}
#ifdef _OPENMP
#define PF_THREAD_ID(t, n) do { t = omp_get_thread_num(); n = omp_get_num_threads(); } while (0)
#else
#define PF_THREAD_ID(t, n) do { t = 0; n = 1; } while (0)
#endif
PF_DEFINE_GEMM(pf_gemm_f32, float, pf_sgemm)
PF_DEFINE_GEMM(pf_gemm_f64, double, pf_dgemm)

/* A batched MatMul: item i multiplies A + a_off[i] by B + b_off[i] into C + i*M*N (broadcast
   batch dimensions are repeated offsets). Many small items: one item per thread. */
#define PF_DEFINE_BATCHED(NAME, T, GEMM)                                                             \
static void NAME(long long items, const long long *a_off, const long long *b_off, int ta, int tb,    \
                 long long M, long long N, long long K, const T *A, const T *B, T *C) {              \
  long long lda = ta ? M : K, ldb = tb ? K : N;                                                      \
  double flops = 2.0 * M * N * K;                                                                    \
  if (items == 1 || flops >= PF_SPLIT_FLOPS) {                                                       \
    for (long long i = 0; i < items; ++i)                                                            \
      GEMM(ta, tb, M, N, K, A + a_off[i], lda, B + b_off[i], ldb, (T)0, C + i * M * N, N, 1);        \
    return;                                                                                          \
  }                                                                                                  \
  _Pragma("omp parallel for schedule(static) if(flops * items >= PF_SPLIT_FLOPS)")                   \
  for (long long i = 0; i < items; ++i)                                                              \
    GEMM(ta, tb, M, N, K, A + a_off[i], lda, B + b_off[i], ldb, (T)0, C + i * M * N, N, 0);          \
}
PF_DEFINE_BATCHED(pf_matmul_f32, float, pf_gemm_f32)
PF_DEFINE_BATCHED(pf_matmul_f64, double, pf_gemm_f64)

/* 2-D Conv (NCHW, grouped, strided, dilated, padded) as im2col + GEMM, tiled: the output
   plane is cut into blocks of `rows` output rows, and each thread makes the im2col matrix of
   its blocks ([C/G*KH*KW][rows*OW] per group, in its own `cols` buffer of `nbuf`) and
   multiplies it at once, while it is still in cache (a whole-plane im2col matrix is megabytes:
   a 16-channel 64x64 3x3 convolution took 0.59 ms untiled). 1x1 stride-1 unpadded
   convolutions are one GEMM over the input itself (cols NULL). Convolutions with one input
   channel a group (depthwise ones) or few output channels a group (a GEMM of a few rows runs
   far below the BLAS's speed) are computed directly over phase planes (NAME_plane; cols: their
   buffers). One-group KxK convolutions do not come here but to the implicit GEMMs below. */
/* An activation applied to a convolution's outputs while they are in cache, in place of the
   memory-bound subgraph that followed it (driver.py, conv_activation): y = clamp(x * a + b, lo, hi)
   (x itself where not `affine`), or sigmoid(x) where `sigmoid`; times x where `mul` (hard-swish,
   SiLU). NaN passes through, as in the kernels it replaces; float32's exp is the generated
   kernels' inline pf_expf (renderer.py's C_HELPERS, which the driver's source starts with). */
typedef struct { int affine, mul, sigmoid; double a, b, lo, hi; } pf_act;
#define PF_DEFINE_ACT(NAME, T, EXP)                                                                  \
static void NAME(const pf_act *e, T *restrict y, long long count) {                                  \
  if (!e) return;                                                                                    \
  T a = (T)e->a, b = (T)e->b, lo = (T)e->lo, hi = (T)e->hi;                                          \
  if (e->sigmoid && e->mul)                                                                          \
    for (long long i = 0; i < count; ++i) { T x = y[i]; y[i] = x * ((T)1 / ((T)1 + EXP(-x))); }     \
  else if (e->sigmoid)                                                                               \
    for (long long i = 0; i < count; ++i) y[i] = (T)1 / ((T)1 + EXP(-y[i]));                         \
  else if (e->mul)                                                                                   \
    for (long long i = 0; i < count; ++i) {                                                          \
      T x = y[i], t = x * a + b;                                                                     \
      y[i] = x * (t < lo ? lo : (t > hi ? hi : t));                                                  \
    }                                                                                                \
  else if (e->affine)                                                                                \
    for (long long i = 0; i < count; ++i) { T t = y[i] * a + b; y[i] = t < lo ? lo : (t > hi ? hi : t); } \
  else                                                                                               \
    for (long long i = 0; i < count; ++i) { T t = y[i]; y[i] = t < lo ? lo : (t > hi ? hi : t); }   \
}
PF_DEFINE_ACT(pf_act_f32, float, pf_expf)
PF_DEFINE_ACT(pf_act_f64, double, exp)

/* a short copy as whole 64-byte moves, then one move of each smaller power of two that the rest
   holds (a 14-float row: 3 moves). A libc memcpy call a row was 15-25% of a depthwise conv over
   14x14 or 56x56 planes; the empty asm hides the loop from gcc's rewriting it as that call. */
typedef char pf_bytes64 __attribute__((vector_size(64), aligned(1)));
static inline void pf_copy(void *restrict dst, const void *restrict src, long long bytes) {
  char *d = (char *)dst;
  const char *q = (const char *)src;
  for (; bytes >= 64; bytes -= 64, d += 64, q += 64) {
    *(pf_bytes64 *)d = *(const pf_bytes64 *)q;
    __asm__("" : "+r"(d));
  }
  if (bytes & 32) { __builtin_memcpy(d, q, 32); d += 32; q += 32; }
  if (bytes & 16) { __builtin_memcpy(d, q, 16); d += 16; q += 16; }
  if (bytes & 8) { __builtin_memcpy(d, q, 8); d += 8; q += 8; }
  if (bytes & 4) { __builtin_memcpy(d, q, 4); d += 4; q += 4; }
  if (bytes & 2) { __builtin_memcpy(d, q, 2); d += 2; q += 2; }
  if (bytes & 1) *d = *q;
}

#define PF_DIRECT_MAX_OUTPUTS 4
typedef struct {
  long long n, c, h, w, m, g, kh, kw, oh, ow, sh, sw, dh, dw, ph, pw, rows, nbuf;
} pf_conv_shape;

/* each tap column kj's valid output columns [los[kj], his[kj]) of a row, 0 <= los <= his <= ow,
   computed once a row (two divisions a tap and output row cost more than the row's
   multiply-adds). A tap wholly right of the input (jo >= w: a dilation wider than the input,
   DeepLabV3's rate-36 ASPP on 14x14) has an empty range at 0: a negative bound made im2col
   zero the entries before its row, another tap's values or another thread's block. */
static void pf_tap_ranges(const pf_conv_shape *s, long long *los, long long *his) {
  for (long long kj = 0; kj < s->kw; ++kj) {
    long long jo = kj * s->dw - s->pw;
    los[kj] = jo >= 0 ? 0 : (-jo + s->sw - 1) / s->sw;
    his[kj] = jo >= s->w ? 0 : (s->w - jo + s->sw - 1) / s->sw;
    if (his[kj] > s->ow) his[kj] = s->ow;
    if (los[kj] > his[kj]) los[kj] = his[kj];
  }
}

/* the phase-plane geometry of a convolution (PF_DEFINE_CONV's comment says what the planes are):
   the padded rows hp and columns wp its windows cover, each of the sh * sw phase planes `pitch`
   wide and `phase` elements long, and in off[tap] each tap's offset from an output's position */
typedef struct { long long hp, wp, pitch, phase; } pf_phases;
static pf_phases pf_phase_geometry(const pf_conv_shape *s, long long *off) {
  pf_phases p;
  p.hp = (s->oh - 1) * s->sh + (s->kh - 1) * s->dh + 1;
  p.wp = (s->ow - 1) * s->sw + (s->kw - 1) * s->dw + 1;
  p.pitch = (p.wp + s->sw - 1) / s->sw;
  p.phase = (p.hp + s->sh - 1) / s->sh * p.pitch;
  for (long long ki = 0; ki < s->kh; ++ki)
    for (long long kj = 0; kj < s->kw; ++kj) {
      long long r = ki * s->dh, c = kj * s->dw;
      off[ki * s->kw + kj] = ((r % s->sh) * s->sw + c % s->sw) * p.phase + (r / s->sh) * p.pitch + c / s->sw;
    }
  return p;
}

#define PF_DEFINE_CONV(NAME, T, GEMM, ACT)                                                          \
/* direct over phase planes, for convolutions whose im2col GEMM would be thin (driver.py: one input \
   channel a group -- depthwise, depth multipliers, a one-channel input -- or at most                \
   PF_DIRECT_MAX_OUTPUTS outputs a group). A job is one output channel. Each of its input channels  \
   is copied, zero-padded, into s->sh * s->sw phase planes (phase (pr, pc) holds padded rows pr,     \
   pr + sh, ... and columns pc, pc + sw, ..., all `pitch` wide), so that every tap reads its phase   \
   plane at a constant offset from the output's position: output (oi, oj) is position              \
   oi * pitch + oj, and the whole plane is one contiguous run of positions (the pitch - ow columns   \
   past each row are computed and dropped). Every tap is then whole unaligned vectors along that   \
   run, whatever the plane's width, stride or dilation. With one input channel a group, consecutive \
   output channels of a group reuse the planes. The earlier depthwise form gathered blocks of       \
   channels into vectors and scattered them back, which took most of its time (one thread: 576     \
   channels 14x14 3x3 0.15 -> 0.075 ms, 144 channels 56x56 3x3 0.55 -> 0.24 ms, 96 channels         \
   112x112 3x3 stride 2 0.65 -> 0.41 ms), and the direct row loops ran a 1 -> 16 channel 64x64 3x3  \
   convolution at 9 GFLOP/s. `scratch` holds s->nbuf threads' buffers, each driver.py's             \
   plane_scratch elements.                                                                          */ \
/* one input plane xp into the zeroed phase planes at xb (`phase` elements each, `pitch` wide) */   \
static void NAME##_fill_planes(const pf_conv_shape *s, const T *restrict xp, T *restrict xb,        \
                               long long hp, long long wp, long long pitch, long long phase) {      \
  long long sh = s->sh, sw = s->sw, jn = s->w + s->pw < wp ? s->w : wp - s->pw;                     \
  if (jn <= 0) return;   /* only padding is read */                                                 \
  /* padded row ip = ri * sh + pr is input row ip - ph, in phase row pr's plane row ri */           \
  for (long long pr = 0; pr < sh; ++pr)                                                             \
    for (long long ri = 0, ip = pr; ip < hp; ++ri, ip += sh) {                                      \
      long long i = ip - s->ph;                                                                     \
      if (i < 0 || i >= s->h) continue;                                                             \
      T *dst = xb + pr * sw * phase + ri * pitch;                                                   \
      const T *src = xp + i * s->w;                                                                 \
      if (sw == 1)                                                                                  \
        pf_copy(dst + s->pw, src, jn * sizeof(T));                                                  \
      else if (sw == 2) {   /* even and odd padded columns, pairwise (the compiler's permutes) */   \
        long long j = s->pw % 2, k = (j + s->pw) / 2, pairs = (jn - j) / 2;                         \
        T *d0 = dst + k, *d1 = dst + phase + k;                                                     \
        if (j) dst[phase + s->pw / 2] = src[0];                                                     \
        for (long long q = 0; q < pairs; ++q) { d0[q] = src[j + 2 * q]; d1[q] = src[j + 2 * q + 1]; } \
        if (j + 2 * pairs < jn) d0[pairs] = src[jn - 1];                                            \
      } else   /* phase pc takes the columns j with (j + pw) % sw == pc, one after another */       \
        for (long long pc = 0; pc < sw; ++pc) {                                                     \
          long long j = ((pc - s->pw) % sw + sw) % sw;                                              \
          T *d = dst + pc * phase + (j + s->pw) / sw;                                               \
          for (; j < jn; j += sw) *d++ = src[j];                                                    \
        }                                                                                           \
    }                                                                                               \
}                                                                                                   \
/* acc[0, runs) (+)= the taps of wk over the phase planes xb: U vectors of positions at a time,     \
   even and odd taps in separate accumulators (2U independent chains of multiply-adds; a 7x7        \
   plane is 4 + 1 vectors), then one vector at a time. `first`: start from the bias b0. */          \
static void NAME##_taps(const T *restrict xb, const long long *off, long long taps, const T *restrict wk, \
                        long long runs, T b0s, int first, T *restrict accs) {                       \
  enum { V = 64 / sizeof(T), U = 4 };                                                               \
  typedef T vec __attribute__((vector_size(64)));                                                   \
  typedef T uvec __attribute__((vector_size(64), aligned(sizeof(T))));                              \
  vec *acc = (vec *)accs, b0 = {0};                                                                 \
  b0 += b0s;                                                                                        \
  long long p = 0;                                                                                  \
  for (; p + U * V <= runs; p += U * V) {                                                           \
    vec a[U], e[U];                                                                                 \
    for (int u = 0; u < U; ++u) { a[u] = first ? b0 : acc[p / V + u]; e[u] = (vec){0}; }            \
    long long k = 0;                                                                                \
    for (; k + 1 < taps; k += 2) {                                                                  \
      const T *q = xb + off[k] + p, *q1 = xb + off[k + 1] + p;                                      \
      T w0 = wk[k], w1 = wk[k + 1];                                                                 \
      for (int u = 0; u < U; ++u) {                                                                 \
        a[u] += w0 * *(const uvec *)(q + u * V);                                                    \
        e[u] += w1 * *(const uvec *)(q1 + u * V);                                                   \
      }                                                                                             \
    }                                                                                               \
    if (k < taps)                                                                                   \
      for (int u = 0; u < U; ++u) a[u] += wk[k] * *(const uvec *)(xb + off[k] + p + u * V);         \
    for (int u = 0; u < U; ++u) acc[p / V + u] = a[u] + e[u];                                       \
  }                                                                                                 \
  for (; p < runs; p += V) {                                                                        \
    vec a = first ? b0 : acc[p / V], e = {0};                                                       \
    long long k = 0;                                                                                \
    for (; k + 1 < taps; k += 2) {                                                                  \
      a += wk[k] * *(const uvec *)(xb + off[k] + p);                                                \
      e += wk[k + 1] * *(const uvec *)(xb + off[k + 1] + p);                                        \
    }                                                                                               \
    if (k < taps) a += wk[k] * *(const uvec *)(xb + off[k] + p);                                    \
    acc[p / V] = a + e;                                                                             \
  }                                                                                                 \
}                                                                                                   \
static void NAME##_plane(const pf_conv_shape *s, const T *restrict x, const T *restrict wt,         \
                         const T *restrict bias, T *restrict y, T *scratch, const pf_act *act) {    \
  enum { V = 64 / sizeof(T) };                                                                      \
  long long sh = s->sh, sw = s->sw, taps = s->kh * s->kw, cg = s->c / s->g, mg = s->m / s->g;       \
  long long off[taps];                                                                                \
  pf_phases pg = pf_phase_geometry(s, off);                                                           \
  long long hp = pg.hp, wp = pg.wp, pitch = pg.pitch, phase = pg.phase;                               \
  long long runs = (s->oh * pitch + V - 1) / V * V;                                                 \
  long long planes = (sh * sw * phase + V - 1) / V * V;   /* whole vectors: the results align */    \
  long long per = planes + 2 * runs + V;   /* phase planes, the over-read, the results, alignment */ \
  int big = s->n * s->m * s->oh * s->ow * taps * cg >= PF_PARALLEL_ELEMENTS;                        \
  _Pragma("omp parallel num_threads(s->nbuf) if(big)")                                              \
  {                                                                                                 \
    int t = 0, nt = 1;                                                                              \
    PF_THREAD_ID(t, nt);                                                                            \
    long long held = -1;   /* the input channel (of all images) whose planes xb holds */            \
    T *xb = (T *)(((uintptr_t)(scratch + t * per) + 63) & ~(uintptr_t)63), *acc = xb + planes + runs; \
    memset(xb + planes, 0, runs * sizeof(T));   /* read past the planes only by dropped positions */ \
    _Pragma("omp for schedule(static)")                                                             \
    for (long long job = 0; job < s->n * s->m; ++job) {                                             \
      long long o = job % s->m, img = job / s->m;                                                   \
      for (long long ci = 0; ci < cg; ++ci) {                                                       \
        long long ch = img * s->c + (o / mg) * cg + ci;                                             \
        if (ch != held) {                                                                           \
          memset(xb, 0, planes * sizeof(T));                                                        \
          NAME##_fill_planes(s, x + ch * s->h * s->w, xb, hp, wp, pitch, phase);                    \
          held = ch;                                                                                \
        }                                                                                           \
        NAME##_taps(xb, off, taps, wt + (o * cg + ci) * taps, runs, bias ? bias[o] : (T)0, ci == 0, acc); \
      }                                                                                             \
      T *yp = y + job * s->oh * s->ow;                                                              \
      for (long long oi = 0; oi < s->oh; ++oi)                                                      \
        pf_copy(yp + oi * s->ow, acc + oi * pitch, s->ow * sizeof(T));                              \
      ACT(act, yp, s->oh * s->ow);                                                                  \
    }                                                                                               \
  }                                                                                                 \
}                                                                                                   \
/* output row oi's part of the im2col matrix: cols[ch*taps + tap][(oi-r0)*ow + oj], `width`    \
   columns a row of the matrix (r0: the first output row the matrix holds) */                        \
static void NAME##_im2col_row(const pf_conv_shape *s, const T *xi, long long oi, long long r0,      \
                              T *cols, long long width) {                                           \
  /* each tap column's valid output range once, and the rows as nested loops: three divisions       \
     a matrix row made an 8-output 7x7 stride-2 convolution over 64x64 mostly division */           \
  long long los[s->kw], his[s->kw];                                                                 \
  pf_tap_ranges(s, los, his);                                                                       \
  T *orow = cols + (oi - r0) * s->ow;                                                               \
  for (long long ch = 0; ch < s->c; ++ch)                                                           \
    for (long long ki = 0; ki < s->kh; ++ki) {                                                      \
      long long ii = oi * s->sh - s->ph + ki * s->dh;                                               \
      if (ii < 0 || ii >= s->h) {                                                                   \
        for (long long kj = 0; kj < s->kw; ++kj, orow += width) memset(orow, 0, sizeof(T) * s->ow); \
        continue;                                                                                   \
      }                                                                                             \
      const T *xr = xi + ch * s->h * s->w + ii * s->w;                                              \
      for (long long kj = 0; kj < s->kw; ++kj, orow += width) {                                     \
        long long jo = kj * s->dw - s->pw, lo = los[kj], hi = his[kj];                              \
        for (long long oj = 0; oj < lo; ++oj) orow[oj] = (T)0;                                      \
        if (s->sw == 1) { for (long long oj = lo; oj < hi; ++oj) orow[oj] = xr[oj + jo]; }          \
        else { for (long long oj = lo; oj < hi; ++oj) orow[oj] = xr[oj * s->sw + jo]; }             \
        for (long long oj = hi; oj < s->ow; ++oj) orow[oj] = (T)0;                                  \
      }                                                                                             \
    }                                                                                               \
}                                                                                                   \
static void NAME##_im2col_rows(const pf_conv_shape *s, const T *xi, long long oi, T *cols,           \
                               long long plane) {                                                    \
  NAME##_im2col_row(s, xi, oi, 0, cols, plane);                                                      \
}                                                                                                    \
static void NAME(const pf_conv_shape *s, const T *x, const T *wt, const T *bias, T *y, T *cols,     \
                 const pf_act *act) {                                                               \
  if (s->c == s->g || s->m / s->g <= PF_DIRECT_MAX_OUTPUTS) { NAME##_plane(s, x, wt, bias, y, cols, act); return; } \
  long long cg = s->c / s->g, mg = s->m / s->g, taps = s->kh * s->kw, plane = s->oh * s->ow;         \
  long long k = cg * taps, blocks = (s->oh + s->rows - 1) / s->rows;                                 \
  int big = 2.0 * s->n * s->m * plane * k >= PF_SPLIT_FLOPS;                                         \
  if (!cols) { /* 1x1: the input is the column matrix */                                             \
    for (long long img = 0; img < s->n; ++img) {                                                     \
      const T *xi = x + img * s->c * s->h * s->w;                                                    \
      T *yi = y + img * s->m * plane;                                                                \
      if (bias)                                                                                      \
        for (long long o = 0; o < s->m; ++o)                                                         \
          for (long long i = 0; i < plane; ++i) yi[o * plane + i] = bias[o];                         \
      for (long long gi = 0; gi < s->g; ++gi)                                                        \
        GEMM(0, 0, mg, plane, k, wt + gi * mg * k, k, xi + gi * k * plane, plane, bias ? (T)1 : (T)0, \
             yi + gi * mg * plane, plane, 1);                                                       \
      ACT(act, yi, s->m * plane);                                                                   \
    }                                                                                                \
    return;                                                                                          \
  }                                                                                                  \
  if (!big || s->n * blocks < 2 * s->nbuf) { /* few blocks: the whole plane, the GEMM split */      \
    for (long long img = 0; img < s->n; ++img) {                                                     \
      T *yi = y + img * s->m * plane;                                                                \
      const T *xi = x + img * s->c * s->h * s->w;                                                    \
      _Pragma("omp parallel for schedule(static) if(big)")                                           \
      for (long long oi = 0; oi < s->oh; ++oi)                                                       \
        NAME##_im2col_rows(s, xi, oi, cols, plane);                                                  \
      if (bias)                                                                                      \
        for (long long o = 0; o < s->m; ++o)                                                         \
          for (long long i = 0; i < plane; ++i) yi[o * plane + i] = bias[o];                         \
      for (long long gi = 0; gi < s->g; ++gi)                                                        \
        GEMM(0, 0, mg, plane, k, wt + gi * mg * k, k, cols + gi * k * plane, plane,                 \
             bias ? (T)1 : (T)0, yi + gi * mg * plane, plane, 1);                                   \
      ACT(act, yi, s->m * plane);                                                                   \
    }                                                                                                \
    return;                                                                                          \
  }                                                                                                  \
  _Pragma("omp parallel num_threads(s->nbuf)")                                                       \
  {                                                                                                  \
    int t = 0, nt = 1;                                                                               \
    PF_THREAD_ID(t, nt);                                                                             \
    T *mine = cols + (long long)t * s->c * taps * s->rows * s->ow;                                   \
    _Pragma("omp for schedule(static)")                                                              \
    for (long long job = 0; job < s->n * blocks; ++job) {                                            \
      long long img = job / blocks, r0 = (job % blocks) * s->rows;                                   \
      long long r1 = r0 + s->rows < s->oh ? r0 + s->rows : s->oh, width = (r1 - r0) * s->ow;        \
      T *yi = y + img * s->m * plane + r0 * s->ow;                                                   \
      for (long long oi = r0; oi < r1; ++oi)                                                         \
        NAME##_im2col_row(s, x + img * s->c * s->h * s->w, oi, r0, mine, width);                     \
      if (bias)                                                                                      \
        for (long long o = 0; o < s->m; ++o)                                                         \
          for (long long i = 0; i < width; ++i) yi[o * plane + i] = bias[o];                         \
      for (long long gi = 0; gi < s->g; ++gi)                                                        \
        GEMM(0, 0, mg, width, k, wt + gi * mg * k, k, mine + gi * k * width, width,                 \
             bias ? (T)1 : (T)0, yi + gi * mg * plane, plane, 0);                                   \
      if (act)   /* the block, while it is in cache */                                              \
        for (long long o = 0; o < s->m; ++o) ACT(act, yi + o * plane, width);                       \
    }                                                                                                \
  }                                                                                                  \
}
PF_DEFINE_CONV(pf_conv2d_f32, float, pf_gemm_f32, pf_act_f32)
PF_DEFINE_CONV(pf_conv2d_f64, double, pf_gemm_f64, pf_act_f64)

/* 2-D Conv (one group) as an implicit GEMM over phase planes: out[o][p] = bias[o] + sum over input
   channels ci and taps of w[o][ci][tap] * planes[ci][off[tap] + p], where p is the position
   oi * pitch + oj of the padded phase planes (see NAME##_plane above). No im2col matrix is made:
   each input channel is copied once into its phase planes (all of them stay in a core's L2), and
   the rows of the GEMM's second operand are read from them at constant offsets. The weights come
   packed once, at session creation (driver.py, pack_weights): panels of PF_IG_MR output channels,
   [panel][ci * taps + tap][PF_IG_MR], zero past m. A job is a panel over a strip of PF_IG_NR
   vectors of positions: PF_IG_MR x PF_IG_NR accumulators in registers, every tap one load of each
   vector and one broadcast weight a row. OpenBLAS after im2col ran ResNet-18's 3x3 layers at
   70-80 GFLOP/s in the model (its sgemm packs the whole weight matrix every call; 80-100 on a hot
   cache), onnxruntime's NCHWc convolutions at 110-116 (one thread). */
#define PF_IG_MR 8
#define PF_IG_NR 3
#define PF_DEFINE_IGEMM(NAME, CONV, T, ACT)                                                           \
static void NAME##_strip(const T *restrict xb, long long cs, const long long *off, long long c,       \
                         long long taps, const T *restrict wp, const T *restrict b, long long p,      \
                         T *restrict tile) {                                                          \
  enum { V = 64 / sizeof(T) };                                                                        \
  typedef T vec __attribute__((vector_size(64)));                                                     \
  typedef T uvec __attribute__((vector_size(64), aligned(sizeof(T))));                                \
  vec acc[PF_IG_MR][PF_IG_NR];                                                                        \
  for (int r = 0; r < PF_IG_MR; ++r)                                                                  \
    for (int u = 0; u < PF_IG_NR; ++u) { acc[r][u] = (vec){0}; acc[r][u] += b[r]; }                  \
  for (long long ci = 0; ci < c; ++ci) {                                                              \
    const T *base = xb + ci * cs + p;                                                                 \
    for (long long k = 0; k < taps; ++k, wp += PF_IG_MR) {                                            \
      const T *q = base + off[k];                                                                     \
      vec x0 = *(const uvec *)q, x1 = *(const uvec *)(q + V), x2 = *(const uvec *)(q + 2 * V);        \
      for (int r = 0; r < PF_IG_MR; ++r) {                                                            \
        acc[r][0] += wp[r] * x0; acc[r][1] += wp[r] * x1; acc[r][2] += wp[r] * x2;                    \
      }                                                                                               \
    }                                                                                                 \
  }                                                                                                   \
  for (int r = 0; r < PF_IG_MR; ++r)                                                                  \
    for (int u = 0; u < PF_IG_NR; ++u) *(uvec *)(tile + (r * PF_IG_NR + u) * V) = acc[r][u];          \
}                                                                                                     \
static void NAME(const pf_conv_shape *s, const T *x, const T *wp, const T *bias, T *y, T *scratch,    \
                 const pf_act *act) {                                                                 \
  enum { V = 64 / sizeof(T), W = PF_IG_NR * (64 / sizeof(T)) };                                       \
  long long sh = s->sh, sw = s->sw, taps = s->kh * s->kw;                                             \
  long long off[taps];                                                                                \
  pf_phases pg = pf_phase_geometry(s, off);                                                           \
  long long hp = pg.hp, wdp = pg.wp, pitch = pg.pitch, phase = pg.phase;                              \
  long long cs = (sh * sw * phase + V - 1) / V * V, npos = s->oh * pitch;                             \
  long long strips = (npos + W - 1) / W, panels = (s->m + PF_IG_MR - 1) / PF_IG_MR;                   \
  T *xb = (T *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);                                          \
  int big = 2.0 * s->m * s->c * taps * npos >= PF_SPLIT_FLOPS;                                        \
  memset(xb + s->c * cs, 0, (strips * W + V) * sizeof(T));   /* read only by dropped positions */     \
  for (long long img = 0; img < s->n; ++img) {                                                        \
    const T *xi = x + img * s->c * s->h * s->w;                                                       \
    T *yi = y + img * s->m * s->oh * s->ow;                                                           \
    _Pragma("omp parallel num_threads(s->nbuf) if(big)")                                              \
    {                                                                                                 \
      _Pragma("omp for schedule(static)")                                                             \
      for (long long ci = 0; ci < s->c; ++ci) {                                                       \
        memset(xb + ci * cs, 0, cs * sizeof(T));                                                      \
        CONV##_fill_planes(s, xi + ci * s->h * s->w, xb + ci * cs, hp, wdp, pitch, phase);            \
      }                                                                                               \
      T tile[PF_IG_MR * W] __attribute__((aligned(64)));                                              \
      _Pragma("omp for schedule(static)")                                                             \
      for (long long job = 0; job < panels * strips; ++job) {                                         \
        long long panel = job / strips, p0 = (job % strips) * W, o0 = panel * PF_IG_MR;              \
        T b[PF_IG_MR];                                                                                \
        for (int r = 0; r < PF_IG_MR; ++r) b[r] = bias && o0 + r < s->m ? bias[o0 + r] : (T)0;       \
        NAME##_strip(xb, cs, off, s->c, taps, wp + panel * s->c * taps * PF_IG_MR, b, p0, tile);      \
        long long p1 = p0 + W < npos ? p0 + W : npos;                                                 \
        for (int r = 0; r < PF_IG_MR && o0 + r < s->m; ++r) {                                         \
          T *t = tile + r * W, *yo = yi + (o0 + r) * s->oh * s->ow;                                   \
          ACT(act, t, W);                                                                             \
          /* the strip's positions row by row; the columns past ow are dropped */                     \
          for (long long p = p0, oi = p0 / pitch, oj = p0 % pitch; p < p1; ++oi, oj = 0) {            \
            long long end = (oi + 1) * pitch < p1 ? (oi + 1) * pitch : p1;                            \
            long long n = (oi * pitch + s->ow < end ? oi * pitch + s->ow : end) - p;                  \
            if (n > 0) pf_copy(yo + oi * s->ow + oj, t + (p - p0), n * sizeof(T));                    \
            p = end;                                                                                  \
          }                                                                                           \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
  }                                                                                                   \
}
PF_DEFINE_IGEMM(pf_igemm_f32, pf_conv2d_f32, float, pf_act_f32)
PF_DEFINE_IGEMM(pf_igemm_f64, pf_conv2d_f64, double, pf_act_f64)

/* The same implicit GEMM turned over, for small planes, where a strip of positions would be
   mostly dropped columns (a 7x7 plane: 49 outputs of 96 positions computed): vectors run along
   output channels, PF_IGC_NC vectors of them a panel (weights packed [panel][ci * taps + tap]
   [PF_IGC_NC * vector], zero past m), and PF_IGC_R output positions a job, each input value
   broadcast; only real outputs are computed, and their values go to NCHW one by one (a tile's
   R x PF_IGC_NC * vector stores against c * taps of its multiply-adds). ResNet-18's 512-channel 7x7
   3x3 convolutions: 3.3 ms through im2col and OpenBLAS in the model, one thread. */
#define PF_IGC_R 8
#define PF_IGC_NC 3
#define PF_DEFINE_IGEMMC(NAME, CONV, T, ACT)                                                          \
static void NAME##_tile(const T *restrict xb, long long cs, const long long *off, long long c,        \
                        long long taps, const T *restrict wp, const T *restrict b, const long long *pos, \
                        T *restrict tile) {                                                           \
  enum { V = 64 / sizeof(T) };                                                                        \
  typedef T vec __attribute__((vector_size(64)));                                                     \
  typedef T uvec __attribute__((vector_size(64), aligned(sizeof(T))));                                \
  vec acc[PF_IGC_R][PF_IGC_NC];                                                                       \
  for (int u = 0; u < PF_IGC_NC; ++u) {                                                               \
    vec bv = *(const uvec *)(b + u * V);                                                              \
    for (int r = 0; r < PF_IGC_R; ++r) acc[r][u] = bv;                                                \
  }                                                                                                   \
  for (long long ci = 0; ci < c; ++ci) {                                                              \
    const T *base = xb + ci * cs;                                                                     \
    for (long long k = 0; k < taps; ++k, wp += PF_IGC_NC * V) {                                       \
      const T *q = base + off[k];                                                                     \
      vec w0 = *(const uvec *)wp, w1 = *(const uvec *)(wp + V), w2 = *(const uvec *)(wp + 2 * V);     \
      for (int r = 0; r < PF_IGC_R; ++r) {                                                            \
        T xv = q[pos[r]];                                                                             \
        acc[r][0] += xv * w0; acc[r][1] += xv * w1; acc[r][2] += xv * w2;                             \
      }                                                                                               \
    }                                                                                                 \
  }                                                                                                   \
  for (int r = 0; r < PF_IGC_R; ++r)                                                                  \
    for (int u = 0; u < PF_IGC_NC; ++u) *(uvec *)(tile + (r * PF_IGC_NC + u) * V) = acc[r][u];        \
}                                                                                                     \
static void NAME(const pf_conv_shape *s, const T *x, const T *wp, const T *bias, T *y, T *scratch,    \
                 const pf_act *act) {                                                                 \
  enum { V = 64 / sizeof(T), NCV = PF_IGC_NC * (64 / sizeof(T)) };                                    \
  long long sh = s->sh, sw = s->sw, taps = s->kh * s->kw, plane = s->oh * s->ow;                      \
  long long off[taps];                                                                                \
  pf_phases pg = pf_phase_geometry(s, off);                                                           \
  long long hp = pg.hp, wdp = pg.wp, pitch = pg.pitch, phase = pg.phase;                              \
  long long cs = sh * sw * phase, groups = (plane + PF_IGC_R - 1) / PF_IGC_R;                         \
  long long panels = (s->m + NCV - 1) / NCV;                                                          \
  T *xb = scratch;                                                                                    \
  int big = 2.0 * s->m * s->c * taps * plane >= PF_SPLIT_FLOPS;                                       \
  for (long long img = 0; img < s->n; ++img) {                                                        \
    const T *xi = x + img * s->c * s->h * s->w;                                                       \
    T *yi = y + img * s->m * plane;                                                                   \
    _Pragma("omp parallel num_threads(s->nbuf) if(big)")                                              \
    {                                                                                                 \
      _Pragma("omp for schedule(static)")                                                             \
      for (long long ci = 0; ci < s->c; ++ci) {                                                       \
        memset(xb + ci * cs, 0, cs * sizeof(T));                                                      \
        CONV##_fill_planes(s, xi + ci * s->h * s->w, xb + ci * cs, hp, wdp, pitch, phase);            \
      }                                                                                               \
      T tile[PF_IGC_R * NCV] __attribute__((aligned(64))), b[NCV];                                    \
      long long pos[PF_IGC_R];                                                                        \
      _Pragma("omp for schedule(static)")                                                             \
      for (long long job = 0; job < panels * groups; ++job) {                                         \
        long long panel = job / groups, p0 = (job % groups) * PF_IGC_R, o0 = panel * NCV;             \
        long long n = plane - p0 < PF_IGC_R ? plane - p0 : PF_IGC_R;                                  \
        for (int r = 0; r < PF_IGC_R; ++r) {   /* past the plane: its last output again */            \
          long long p = p0 + (r < n ? r : n - 1);                                                     \
          pos[r] = (p / s->ow) * pitch + p % s->ow;                                                   \
        }                                                                                             \
        for (int j = 0; j < NCV; ++j) b[j] = bias && o0 + j < s->m ? bias[o0 + j] : (T)0;             \
        NAME##_tile(xb, cs, off, s->c, taps, wp + panel * s->c * taps * NCV, b, pos, tile);           \
        ACT(act, tile, PF_IGC_R * NCV);                                                               \
        long long mo = s->m - o0 < NCV ? s->m - o0 : NCV;                                             \
        for (long long j = 0; j < mo; ++j)                                                            \
          for (long long r = 0; r < n; ++r) yi[(o0 + j) * plane + p0 + r] = tile[r * NCV + j];       \
      }                                                                                               \
    }                                                                                                 \
  }                                                                                                   \
}
PF_DEFINE_IGEMMC(pf_igemmc_f32, pf_conv2d_f32, float, pf_act_f32)
PF_DEFINE_IGEMMC(pf_igemmc_f64, pf_conv2d_f64, double, pf_act_f64)

/* The BLAS on one thread for the run (its own threads would wait for each other at every
   step); the previous count is restored after. */
static inline int pf_blas_enter(void) {
  int prev = pf_blas_get_threads ? pf_blas_get_threads() : 1;
  if (prev != 1 && pf_blas_set_threads) pf_blas_set_threads(1);
  return prev;
}

static inline void pf_blas_leave(int prev) {
  if (prev != 1 && pf_blas_set_threads) pf_blas_set_threads(prev);
}
