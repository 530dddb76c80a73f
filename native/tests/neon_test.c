/* Standalone test of the NEON kernels (native/src/isa_neon.c), for aarch64 (native or qemu-user).
 * Links isa_neon.c and isa_scalar.c; checks exp, softmax and rms_norm against double references
 * written here (SPEC 1, 2, 5.1), the neon results against the scalar ones, and that no kernel
 * writes past a row (guard elements) or reads past an array (guard page).
 * Build and run: native/tests/run_neon_qemu.sh. Exit status 0 when every case passes. */
#define _DEFAULT_SOURCE /* mmap / mprotect for the guard page */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "../kernels/common.h"

#if !defined(__aarch64__)
#error "neon_test.c is an aarch64 program (it uses __fp16 and the neon kernels)"
#endif

/* prototypes: native/cdef.h with @ISA@ = neon and scalar */
#define CF_DECL(isa)                                                                              \
  void cf_exp_f32__##isa(int64_t n, const float *x, float *y);                                   \
  void cf_softmax_f32__##isa(const int64_t *d, const float *x, const void *mask,                 \
                             const float *slopes, const float *sinks, float scale, float *y);    \
  void cf_softmax_unfused_f32__##isa(const int64_t *d, const float *x, const void *mask,         \
                                     const float *slopes, const float *sinks, float scale,       \
                                     float *y);                                                  \
  void cf_rms_norm_rows_f32__##isa(int64_t rows, int64_t n, const float *x, const float *w,      \
                                   float eps, float *y);                                         \
  void cf_rms_norm_f32__##isa(const int64_t *d, const float *x, const float *r, const float *w,  \
                              const float *b, float eps, float *h, float *y);                    \
  void cf_rms_norm_unfused_f32__##isa(const int64_t *d, const float *x, const float *r,          \
                                      const float *w, const float *b, float eps, float *h,       \
                                      float *y);                                                 \
  const char *cf_build_info__##isa(void);
CF_DECL(neon)
CF_DECL(scalar)

typedef void (*exp_fn)(int64_t, const float *, float *);
typedef void (*sm_fn)(const int64_t *, const float *, const void *, const float *, const float *,
                      float, float *);
typedef void (*rn_fn)(const int64_t *, const float *, const float *, const float *, const float *,
                      float, float *, float *);

/* ---------------------------------------------------------------------------------------------
 * bookkeeping: a case passes when no CHECK inside it failed; the first few failures are printed */
static int g_pass, g_fail, c_fail;
static char c_name[160];
static void begin(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void begin(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c_name, sizeof c_name, fmt, ap);
  va_end(ap);
  c_fail = 0;
}
static void end(void) {
  if (c_fail) g_fail++, printf("FAIL %s (%d failed checks)\n", c_name, c_fail);
  else g_pass++;
}
#define CHECK(cond, ...)                                                                          \
  do {                                                                                            \
    if (!(cond) && c_fail++ < 4) {                                                                \
      printf("  [%s] check failed: %s: ", c_name, #cond);                                         \
      printf(__VA_ARGS__);                                                                        \
      printf("\n");                                                                               \
    }                                                                                             \
  } while (0)

/* deterministic data */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [0, 1) */
  g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) * 0x1.0p-53;
}
static float uni(float lo, float hi) { return (float)(lo + (hi - lo) * urand()); }

static const float GUARD = -12345.5f; /* sentinel in every padding element */
static int is_guard(float v) { return memcmp(&v, &GUARD, sizeof v) == 0; }

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) { printf("out of memory\n"); exit(1); }
  return p;
}
static float *fbuf(int64_t n) { /* filled with GUARD */
  float *p = xmalloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) p[i] = GUARD;
  return p;
}

/* n floats that end exactly at an inaccessible page: a read past the end faults */
static float *edge_buf(int64_t n, void **base, size_t *len) {
  const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  const size_t bytes = ((size_t)n * sizeof(float) + pg - 1) / pg * pg;
  *len = bytes + pg;
  char *p = mmap(NULL, *len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED || mprotect(p + bytes, pg, PROT_NONE)) { printf("mmap failed\n"); exit(1); }
  *base = p;
  return (float *)(p + bytes) - n;
}

static uint16_t f2h(float f) { __fp16 h = (__fp16)f; uint16_t u; memcpy(&u, &h, 2); return u; }
static float h2f(uint16_t u) { __fp16 h; memcpy(&h, &u, 2); return (float)h; }

/* ---------------------------------------------------------------------------------------------
 * exp (SPEC 5.1): <= 2 ulp on [-104, 88.7], ulp of the float nearest the true value */
static double ulp_err(float y, double ref) {
  const float f = (float)ref;
  const double ulp = (double)nextafterf(fabsf(f), INFINITY) - (double)fabsf(f);
  return fabs((double)y - ref) / ulp;
}

static void test_exp(const char *isa, exp_fn fn) {
  const int64_t N = 1 << 21;
  float *x = xmalloc(N * sizeof(float)), *y = fbuf(N + 1);
  const double lo = -104.0, hi = 88.7;
  for (int64_t i = 0; i < N; i++) x[i] = (float)(lo + (hi - lo) * (double)i / (double)(N - 1));
  fn(N, x, y);
  begin("%s exp sweep [-104, 88.7], %lld points", isa, (long long)N);
  double worst = 0.0;
  float worst_x = 0.0f;
  for (int64_t i = 0; i < N; i++) {
    const double e = ulp_err(y[i], exp((double)x[i]));
    if (e > worst || isnan(e)) worst = e, worst_x = x[i];
  }
  CHECK(worst <= 2.0, "max %.3f ulp at x=%.9g", worst, worst_x);
  CHECK(is_guard(y[N]), "guard after the array overwritten");
  end();
  printf("  %s exp: max error %.3f ulp (at x=%.9g)\n", isa, worst, worst_x);

  begin("%s exp special values", isa);
  const float sx[] = {-INFINITY, NAN, INFINITY, -104.0001f, -105.0f, -1000.0f, -FLT_MAX, 0.0f, -0.0f,
                      1.0f, -1.0f, 88.7f, -103.0f, -87.0f, 1e-30f, -1e-30f};
  const int ns = (int)(sizeof sx / sizeof sx[0]);
  float sy[sizeof sx / sizeof sx[0]];
  fn(ns, sx, sy);
  CHECK(sy[0] == 0.0f && !signbit(sy[0]), "exp(-inf) = %a", sy[0]);
  CHECK(isnan(sy[1]), "exp(nan) = %a", sy[1]);
  CHECK(isinf(sy[2]) && sy[2] > 0, "exp(+inf) = %a", sy[2]);
  for (int i = 3; i < 7; i++) CHECK(sy[i] == 0.0f, "exp(%g) = %a", sx[i], sy[i]);
  CHECK(sy[7] == 1.0f && sy[8] == 1.0f, "exp(+-0) = %a %a", sy[7], sy[8]);
  for (int i = 9; i < ns; i++)
    CHECK(ulp_err(sy[i], exp((double)sx[i])) <= 2.0, "exp(%.9g) = %a", sx[i], sy[i]);
  end();

  begin("%s exp tails n=1..67 (guard page after x, guard element after y)", isa);
  for (int64_t n = 1; n <= 67; n++) {
    void *base;
    size_t len;
    float *xe = edge_buf(n, &base, &len), *ye = fbuf(n + 16); /* 16 guards */
    for (int64_t i = 0; i < n; i++) xe[i] = uni(-104.0f, 88.7f);
    if (n > 2) xe[n - 1] = NAN, xe[n - 2] = -INFINITY;
    fn(n, xe, ye);
    for (int64_t i = 0; i < n; i++) {
      if (isnan(xe[i])) CHECK(isnan(ye[i]), "n=%lld i=%lld", (long long)n, (long long)i);
      else CHECK(ulp_err(ye[i], exp((double)xe[i])) <= 2.0, "n=%lld i=%lld x=%.9g y=%a",
                 (long long)n, (long long)i, xe[i], ye[i]);
    }
    for (int64_t i = n; i < n + 16; i++) CHECK(is_guard(ye[i]), "n=%lld: y[%lld] past the end overwritten", (long long)n, (long long)i);
    munmap(base, len);
    free(ye);
  }
  end();
  free(x);
  free(y);
}

static void test_exp_vs_scalar(void) {
  const int64_t N = 1 << 18;
  float *x = xmalloc(N * sizeof(float)), *a = xmalloc(N * sizeof(float)), *b = xmalloc(N * sizeof(float));
  for (int64_t i = 0; i < N; i++) x[i] = uni(-104.0f, 88.7f);
  cf_exp_f32__neon(N, x, a);
  cf_exp_f32__scalar(N, x, b);
  begin("exp neon vs scalar, %lld random points", (long long)N);
  double worst = 0.0;
  for (int64_t i = 0; i < N; i++) {
    const double e = ulp_err(a[i], (double)b[i]);
    if (e > worst || isnan(e)) worst = e;
  }
  CHECK(worst <= 2.0, "max difference %.3f ulp", worst);
  end();
  free(x), free(a), free(b);
}

/* ---------------------------------------------------------------------------------------------
 * softmax (SPEC 1.3): double reference of one row. mf/mh: mask row or NULL. */
static void ref_softmax_row(int64_t C, const float *x, const float *mf, const uint16_t *mh,
                            float slope, float scale, const float *sink, double *out) {
  double M = -INFINITY;
  int nan = 0;
  for (int64_t c = 0; c < C; c++) {
    double z = (double)x[c] * scale;
    if (mf) z += (double)slope * mf[c];
    if (mh) z += (double)slope * h2f(mh[c]);
    out[c] = z;
    if (isnan(z)) nan = 1;
    else if (z > M) M = z;
  }
  if (sink && *sink > M) M = *sink;
  double sum = 0.0;
  for (int64_t c = 0; c < C; c++) sum += out[c] = exp(out[c] - M);
  if (sink) sum += exp(*sink - M);
  for (int64_t c = 0; c < C; c++) out[c] = nan ? NAN : out[c] / sum;
}

/* element check shared by every softmax comparison; returns the relative error */
static double sm_check(float v, double r, const char *what, long long row, long long c) {
  double rel = 0.0;
  if (isnan(r)) CHECK(isnan(v), "%s row %lld col %lld: %a, expected NaN", what, row, c, v);
  else if (r == 0.0) CHECK(v == 0.0f, "%s row %lld col %lld: %a, expected 0", what, row, c, v);
  else if (r >= 1e-30) {
    rel = fabs((double)v - r) / r;
    CHECK(rel <= 4e-6, "%s row %lld col %lld: %.9g vs %.9g (rel %.3g)", what, row, c, v, r, rel);
  } else CHECK(fabs((double)v - r) <= 1e-30, "%s row %lld col %lld: %a vs %a", what, row, c, v, r);
  return rel;
}

/* SP_LARGE: x and mask on a 1/64 grid, |z| up to 128 (scale 32): z and z - M are exact in f32,
 * and exp(z - M') overflows for any M' below the true max */
enum { SP_NONE, SP_MASKED_ROW, SP_NAN_X, SP_LARGE };
typedef struct {
  int64_t S, H, R, mS, mH;
  int mkind;  /* 0 none, 1 f32, 2 f16 */
  int slopes, sinks, inplace, special;
  float scale;
} sm_case;

static void test_softmax(int64_t C, sm_case k) {
  const int64_t S = k.S, H = k.H, R = k.R, mR = R + 1; /* mask rows >= R are ignored */
  int64_t d[SM_LEN];
  d[SM_S] = S, d[SM_H] = H, d[SM_R] = R, d[SM_C] = C;
  d[SM_XS2] = C + 1, d[SM_XS1] = R * d[SM_XS2], d[SM_XS0] = H * d[SM_XS1];
  if (k.inplace) d[SM_YS2] = d[SM_XS2], d[SM_YS1] = d[SM_XS1], d[SM_YS0] = d[SM_XS0];
  else d[SM_YS2] = C + 3, d[SM_YS1] = R * d[SM_YS2] + 2, d[SM_YS0] = H * d[SM_YS1];
  d[SM_MS] = k.mkind ? k.mS : 1, d[SM_MH] = k.mkind ? k.mH : 1;
  d[SM_MS2] = C + 2, d[SM_MS1] = mR * d[SM_MS2], d[SM_MS0] = d[SM_MH] * d[SM_MS1];
  d[SM_MKIND] = k.mkind;
  const int64_t nx = S * d[SM_XS0], ny = S * d[SM_YS0], nm = d[SM_MS] * d[SM_MS0];

  float *x = fbuf(nx), *mf = fbuf(nm), *slopes = fbuf(H), *sinks = fbuf(H);
  uint16_t *mh = xmalloc((size_t)nm * sizeof(uint16_t));
  for (int64_t s = 0; s < S; s++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) x[s * d[SM_XS0] + h * d[SM_XS1] + r * d[SM_XS2] + c] = uni(-4, 4);
  for (int64_t i = 0; i < nm; i++) {
    mf[i] = urand() < 0.125 ? -INFINITY : uni(-1, 1);
    mh[i] = f2h(mf[i]);
  }
  if (k.special == SP_LARGE) {
    for (int64_t i = 0; i < nx; i++) x[i] = is_guard(x[i]) ? x[i] : roundf(x[i] * 64) / 64;
    for (int64_t i = 0; i < nm; i++) mf[i] = is_guard(mf[i]) ? mf[i] : roundf(mf[i] * 64) / 64;
    for (int64_t i = 0; i < nm; i++) mh[i] = f2h(mf[i]);
  }
  if (k.special == SP_MASKED_ROW) /* mask (0, 0, 0) fully masked: every x row that uses it */
    for (int64_t c = 0; c < C; c++) mf[c] = -INFINITY, mh[c] = f2h(-INFINITY);
  if (k.special == SP_NAN_X) x[(R - 1) * d[SM_XS2] + C / 2] = NAN; /* row (0, 0, R-1) */
  for (int64_t h = 0; h < H; h++) {
    slopes[h] = ldexpf(1.0f, -(int)h - 1) * 3.0f;
    sinks[h] = h == 1 ? 5.0f : uni(-1, 1); /* head 1: the sink is the max */
  }
  const void *mask = k.mkind == 1 ? (const void *)mf : k.mkind == 2 ? (const void *)mh : NULL;
  const float *sl = k.slopes ? slopes : NULL, *sk = k.sinks ? sinks : NULL;

  /* run neon fused, neon unfused, scalar fused, each on a fresh copy of x */
  const char *names[3] = {"neon", "neon-unfused", "scalar"};
  const sm_fn fns[3] = {cf_softmax_f32__neon, cf_softmax_unfused_f32__neon, cf_softmax_f32__scalar};
  float *ys[3];
  for (int v = 0; v < 3; v++) {
    float *xin = fbuf(nx);
    memcpy(xin, x, (size_t)nx * sizeof(float));
    ys[v] = k.inplace ? xin : fbuf(ny);
    fns[v](d, xin, mask, sl, sk, k.scale, ys[v]);
    if (!k.inplace) {
      CHECK(memcmp(xin, x, (size_t)nx * sizeof(float)) == 0, "%s modified x", names[v]);
      free(xin);
    }
  }

  double *ref = xmalloc((size_t)(C ? C : 1) * sizeof(double));
  for (int64_t s = 0; s < S; s++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t r = 0; r < R; r++) {
        const long long row = (long long)((s * H + h) * R + r);
        const int64_t moff = (s % d[SM_MS]) * d[SM_MS0] + (h % d[SM_MH]) * d[SM_MS1] + r * d[SM_MS2];
        const float *xr = x + s * d[SM_XS0] + h * d[SM_XS1] + r * d[SM_XS2];
        ref_softmax_row(C, xr, k.mkind == 1 ? mf + moff : NULL, k.mkind == 2 ? mh + moff : NULL,
                        k.slopes ? slopes[h] : 1.0f, k.scale, sk ? sk + h : NULL, ref);
        const int masked = k.special == SP_MASKED_ROW && k.mkind && moff == 0;
        const int nanrow = k.special == SP_NAN_X && s == 0 && h == 0 && r == R - 1;
        for (int v = 0; v < 3; v++) {
          const float *yr = ys[v] + s * d[SM_YS0] + h * d[SM_YS1] + r * d[SM_YS2];
          for (int64_t c = 0; c < C; c++) {
            sm_check(yr[c], ref[c], names[v], row, (long long)c);
            if (masked && !sk) CHECK(isnan(yr[c]), "%s fully masked row %lld not NaN", names[v], row);
            if (masked && sk) CHECK(yr[c] == 0.0f, "%s fully masked row %lld with sink not 0", names[v], row);
            if (nanrow) CHECK(isnan(yr[c]), "%s NaN-x row %lld col %lld not NaN", names[v], row, (long long)c);
            if (v == 0) /* neon vs scalar, same tolerance (scalar itself is checked at v == 2) */
              sm_check(yr[c], (double)(ys[2] + s * d[SM_YS0] + h * d[SM_YS1] + r * d[SM_YS2])[c],
                       "neon-vs-scalar", row, (long long)c);
          }
          CHECK(is_guard(yr[C]), "%s row %lld: guard after the row overwritten", names[v], row);
        }
      }
  for (int v = 0; v < 3; v++) free(ys[v]);
  free(ref), free(x), free(mf), free(mh), free(slopes), free(sinks);
}

static void test_softmax_all(void) {
  static const int64_t Cs[] = {1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1023, 4097};
  /* S, H, R, mS, mH, mkind, slopes, sinks, inplace, special, scale */
  static const sm_case cases[] = {
      {1, 2, 3, 1, 1, 0, 0, 0, 0, SP_NONE, 1.0f},
      {2, 4, 2, 1, 2, 1, 1, 1, 0, SP_MASKED_ROW, 0.1f}, /* head modulo, slopes, sinks */
      {2, 3, 2, 2, 1, 2, 0, 0, 0, SP_MASKED_ROW, 0.5f}, /* f16, sequence modulo */
      {2, 2, 2, 1, 1, 1, 0, 1, 1, SP_NAN_X, 0.7f},      /* in place */
      {3, 4, 2, 3, 2, 2, 1, 1, 1, SP_MASKED_ROW, 1.0f}, /* f16, in place, sinks: zeros */
      {1, 3, 2, 1, 1, 0, 0, 1, 0, SP_NAN_X, 2.0f},
      {1, 2, 2, 1, 2, 2, 1, 0, 0, SP_NAN_X, 0.25f},
      {1, 3, 2, 1, 1, 0, 0, 1, 0, SP_LARGE, 32.0f},
      {2, 2, 2, 1, 2, 1, 0, 0, 1, SP_LARGE, 32.0f},
      {1, 2, 3, 1, 1, 2, 0, 1, 0, SP_LARGE, 32.0f},
  };
  const int nc = (int)(sizeof cases / sizeof cases[0]);
  for (size_t i = 0; i < sizeof Cs / sizeof Cs[0]; i++)
    for (int j = 0; j < nc; j++) {
      const sm_case k = cases[j];
      begin("softmax C=%lld S=%lld H=%lld R=%lld mask=%s(%lld,%lld)%s%s%s%s scale=%g", (long long)Cs[i],
            (long long)k.S, (long long)k.H, (long long)k.R,
            k.mkind == 0 ? "none" : k.mkind == 1 ? "f32" : "f16", (long long)k.mS, (long long)k.mH,
            k.slopes ? " slopes" : "", k.sinks ? " sinks" : "", k.inplace ? " in-place" : "",
            k.special == SP_MASKED_ROW ? " fully-masked-row" : k.special == SP_NAN_X ? " nan-x"
            : k.special == SP_LARGE ? " large-logits" : "",
            k.scale);
      test_softmax(Cs[i], k);
      end();
    }
}

/* ---------------------------------------------------------------------------------------------
 * rms_norm (SPEC 2.2): double reference of one row, NMSE per row */
static void ref_rms_row(int64_t n, const float *x, const float *w, const float *b, float eps,
                        double *out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
  const double s = 1.0 / sqrt(ss / (double)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * s * (w ? w[i] : 1.0) + (b ? b[i] : 0.0);
}
static double nmse(int64_t n, const float *y, const double *ref) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i++) num += (y[i] - ref[i]) * (y[i] - ref[i]), den += ref[i] * ref[i];
  return den > 0 ? num / den : num;
}

static void test_rms_rows(int64_t n) {
  const int64_t rows = 3;
  void *base;
  size_t len;
  float *x = edge_buf(rows * n, &base, &len), *w = xmalloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < rows * n; i++) x[i] = uni(-10, 10);
  for (int64_t i = 0; i < n; i++) w[i] = uni(-10, 10);
  double *ref = xmalloc((size_t)n * sizeof(double));
  for (int wi = 0; wi < 2; wi++) {
    const float *wp = wi ? w : NULL;
    begin("rms_norm_rows n=%lld%s (guard page after x)", (long long)n, wi ? " weight" : "");
    float *y = fbuf(rows * n + 1), *ys = fbuf(rows * n + 1), *yd = fbuf(rows * n + 1);
    cf_rms_norm_rows_f32__neon(rows, n, x, wp, 1e-6f, y);
    cf_rms_norm_rows_f32__scalar(rows, n, x, wp, 1e-6f, ys);
    for (int64_t k = 0; k < rows; k++) {
      ref_rms_row(n, x + k * n, wp, NULL, 1e-6f, ref);
      const double e = nmse(n, y + k * n, ref), es = nmse(n, ys + k * n, ref);
      CHECK(e <= 1e-12, "neon row %lld nmse %.3g", (long long)k, e);
      CHECK(es <= 1e-12, "scalar row %lld nmse %.3g", (long long)k, es);
      for (int64_t i = 0; i < n; i++) ref[i] = ys[k * n + i];
      CHECK(nmse(n, y + k * n, ref) <= 1e-12, "neon vs scalar row %lld", (long long)k);
    }
    CHECK(is_guard(y[rows * n]), "guard after y overwritten");
    /* the descriptor entry on the same contiguous rows computes the same bits */
    const int64_t dd[RN_LEN] = {[RN_N3] = 1, [RN_N2] = 1, [RN_N1] = rows, [RN_N0] = n,
                                [RN_XS3] = rows * n, [RN_XS2] = rows * n, [RN_XS1] = n,
                                [RN_YS3] = rows * n, [RN_YS2] = rows * n, [RN_YS1] = n,
                                [RN_W3] = 1, [RN_W2] = 1, [RN_W1] = 1};
    cf_rms_norm_f32__neon(dd, x, NULL, wp, NULL, 1e-6f, NULL, yd);
    CHECK(memcmp(y, yd, (size_t)rows * n * sizeof(float)) == 0, "rows entry != descriptor entry");
    end();
    free(y), free(ys), free(yd);
  }
  munmap(base, len);
  free(w), free(ref);
}

/* 4-D rms_norm with strided x/y/h (guards in the padding) and operands tiled by modulo:
 * x (2, 2, 4, n); weight (1, 2, 2); bias (2, 1, 1); residual (1, 1, 4) */
static void test_rms_desc(int64_t n, int use_r, int use_w, int use_b, int inplace, float eps) {
  const int64_t N3 = 2, N2 = 2, N1 = 4;
  int64_t d[RN_LEN];
  d[RN_N3] = N3, d[RN_N2] = N2, d[RN_N1] = N1, d[RN_N0] = n;
  d[RN_XS1] = n + 1, d[RN_XS2] = N1 * d[RN_XS1] + 1, d[RN_XS3] = N2 * d[RN_XS2];
  if (inplace) d[RN_YS1] = d[RN_XS1], d[RN_YS2] = d[RN_XS2], d[RN_YS3] = d[RN_XS3];
  else d[RN_YS1] = n + 2, d[RN_YS2] = N1 * d[RN_YS1], d[RN_YS3] = N2 * d[RN_YS2] + 3;
  d[RN_HS1] = n + 3, d[RN_HS2] = N1 * d[RN_HS1], d[RN_HS3] = N2 * d[RN_HS2];
  d[RN_R3] = 1, d[RN_R2] = 1, d[RN_R1] = 4, d[RN_RS1] = n, d[RN_RS2] = 4 * n, d[RN_RS3] = 4 * n;
  d[RN_W3] = 1, d[RN_W2] = 2, d[RN_W1] = 2, d[RN_WS1] = n, d[RN_WS2] = 2 * n, d[RN_WS3] = 4 * n;
  d[RN_B3] = 2, d[RN_B2] = 1, d[RN_B1] = 1, d[RN_BS1] = n, d[RN_BS2] = n, d[RN_BS3] = n;
  const int64_t nx = N3 * d[RN_XS3], ny = N3 * d[RN_YS3], nh = N3 * d[RN_HS3];
  float *x = fbuf(nx), *r = xmalloc(4 * n * sizeof(float)), *w = xmalloc(4 * n * sizeof(float));
  float *b = xmalloc(2 * n * sizeof(float)), *hrow = xmalloc(n * sizeof(float));
  for (int64_t i3 = 0; i3 < N3; i3++)
    for (int64_t i2 = 0; i2 < N2; i2++)
      for (int64_t i1 = 0; i1 < N1; i1++)
        for (int64_t i = 0; i < n; i++) x[i3 * d[RN_XS3] + i2 * d[RN_XS2] + i1 * d[RN_XS1] + i] = uni(-10, 10);
  for (int64_t i = 0; i < 4 * n; i++) r[i] = uni(-10, 10), w[i] = uni(-10, 10);
  for (int64_t i = 0; i < 2 * n; i++) b[i] = uni(-10, 10);
  const float *rp = use_r ? r : NULL, *wp = use_w ? w : NULL, *bp = use_b ? b : NULL;

  const char *names[3] = {"neon", "neon-unfused", "scalar"};
  const rn_fn fns[3] = {cf_rms_norm_f32__neon, cf_rms_norm_unfused_f32__neon, cf_rms_norm_f32__scalar};
  float *ys[3], *hs[3];
  for (int v = 0; v < 3; v++) {
    float *xin = fbuf(nx);
    memcpy(xin, x, (size_t)nx * sizeof(float));
    ys[v] = inplace ? xin : fbuf(ny);
    hs[v] = fbuf(nh);
    fns[v](d, xin, rp, wp, bp, eps, use_r ? hs[v] : NULL, ys[v]);
    if (!inplace) free(xin);
  }
  double *ref = xmalloc((size_t)n * sizeof(double));
  for (int64_t i3 = 0; i3 < N3; i3++)
    for (int64_t i2 = 0; i2 < N2; i2++)
      for (int64_t i1 = 0; i1 < N1; i1++) {
        const long long row = (long long)((i3 * N2 + i2) * N1 + i1);
        const float *xr = x + i3 * d[RN_XS3] + i2 * d[RN_XS2] + i1 * d[RN_XS1];
        const float *rr = r + (i1 % 4) * d[RN_RS1];
        const float *wr = w + (i2 % 2) * d[RN_WS2] + (i1 % 2) * d[RN_WS1];
        const float *br = b + (i3 % 2) * d[RN_BS3];
        for (int64_t i = 0; i < n; i++) hrow[i] = use_r ? xr[i] + rr[i] : xr[i];
        ref_rms_row(n, hrow, wp ? wr : NULL, bp ? br : NULL, eps, ref);
        const int64_t yo = i3 * d[RN_YS3] + i2 * d[RN_YS2] + i1 * d[RN_YS1];
        const int64_t ho = i3 * d[RN_HS3] + i2 * d[RN_HS2] + i1 * d[RN_HS1];
        for (int v = 0; v < 3; v++) {
          const double e = nmse(n, ys[v] + yo, ref);
          CHECK(e <= 1e-12, "%s row %lld nmse %.3g", names[v], row, e);
          CHECK(is_guard(ys[v][yo + n]), "%s row %lld: guard after y row overwritten", names[v], row);
          if (use_r) {
            CHECK(memcmp(hs[v] + ho, hrow, (size_t)n * sizeof(float)) == 0, "%s row %lld: h != x + r", names[v], row);
            CHECK(is_guard(hs[v][ho + n]), "%s row %lld: guard after h row overwritten", names[v], row);
          }
        }
        for (int64_t i = 0; i < n; i++) ref[i] = ys[2][yo + i];
        CHECK(nmse(n, ys[0] + yo, ref) <= 1e-12, "neon vs scalar row %lld", row);
      }
  /* fused and unfused compute the same bits (SPEC 4.3), padding included */
  CHECK(memcmp(ys[0], ys[1], (size_t)ny * sizeof(float)) == 0, "neon fused != unfused (y)");
  if (use_r) CHECK(memcmp(hs[0], hs[1], (size_t)nh * sizeof(float)) == 0, "neon fused != unfused (h)");
  if (!use_r) for (int v = 0; v < 3; v++) CHECK(is_guard(hs[v][0]), "%s wrote h without residual", names[v]);
  for (int v = 0; v < 3; v++) free(ys[v]), free(hs[v]);
  free(x), free(r), free(w), free(b), free(hrow), free(ref);
}

static void test_rms_all(void) {
  static const int64_t ns[] = {1, 3, 4, 5, 7, 8, 9, 33, 132, 260, 511, 1025, 4097};
  /* residual, weight, bias, in-place, eps */
  static const struct { int r, w, b, inplace; float eps; } v[] = {
      {0, 0, 0, 0, 1e-6f}, {0, 0, 0, 1, 1e-5f}, {0, 1, 0, 0, 1e-6f}, {0, 1, 1, 0, 1e-5f},
      {1, 0, 0, 0, 1e-6f}, {1, 1, 0, 0, 0.0f},  {1, 1, 1, 0, 1e-6f},
  };
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    test_rms_rows(ns[i]);
    for (size_t j = 0; j < sizeof v / sizeof v[0]; j++) {
      begin("rms_norm n=%lld x(2,2,4)%s%s%s%s eps=%g", (long long)ns[i], v[j].r ? " residual(1,1,4)" : "",
            v[j].w ? " weight(1,2,2)" : "", v[j].b ? " bias(2,1,1)" : "", v[j].inplace ? " in-place" : "",
            v[j].eps);
      test_rms_desc(ns[i], v[j].r, v[j].w, v[j].b, v[j].inplace, v[j].eps);
      end();
    }
  }
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  printf("neon build: %s\n", cf_build_info__neon());
  begin("neon build info reports NEON");
  CHECK(strstr(cf_build_info__neon(), "NEON") != NULL, "%s", cf_build_info__neon());
  end();
  test_exp("neon", cf_exp_f32__neon);
  test_exp("scalar", cf_exp_f32__scalar);
  test_exp_vs_scalar();
  test_softmax_all();
  test_rms_all();
  printf("neon: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
