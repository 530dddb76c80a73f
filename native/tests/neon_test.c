/* Standalone test of the NEON kernels (native/src/isa_neon.c), for aarch64 (native or qemu-user).
 * Links isa_neon.c and isa_scalar.c; checks exp, softmax, rms_norm, flash attention and rope against
 * double references written here (docs/semantics.md §2, §3, §4, §6), the neon results against the scalar ones,
 * and that no kernel writes past a row (guard elements) or reads past an array (guard page).
 * The descriptor layouts (FA_*, RP_*, ...) come from native/kernels/layouts.h through common.h.
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

#include "cf_protos.h" /* native/cdef.h for neon and scalar */

typedef __typeof__(&cf_exp_f32__neon) exp_fn;
typedef __typeof__(&cf_softmax_f32__neon) sm_fn;
typedef __typeof__(&cf_rms_norm_f32__neon) rn_fn;
typedef __typeof__(&cf_flash_attn_f32__neon) fa_fn;

#include "test_util.h" /* begin/end/CHECK, g_rng/urand/uni */

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
 * exp (docs/semantics.md §6): <= 2.5 ulp on [-104, 88.7] (3 for scalar, which has no FMA; the degree-5
 * polynomial measures 2.25 / 2.62), ulp of the float nearest the true value */
static double exp_bound(const char *isa) { return strcmp(isa, "scalar") ? 2.5 : 3.0; }
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
  CHECK(worst <= exp_bound(isa), "max %.3f ulp at x=%.9g", worst, worst_x);
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
    CHECK(ulp_err(sy[i], exp((double)sx[i])) <= exp_bound(isa), "exp(%.9g) = %a", sx[i], sy[i]);
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
      else CHECK(ulp_err(ye[i], exp((double)xe[i])) <= exp_bound(isa), "n=%lld i=%lld x=%.9g y=%a",
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
  CHECK(worst <= 4.0, "max difference %.3f ulp", worst);
  end();
  free(x), free(a), free(b);
}

/* ---------------------------------------------------------------------------------------------
 * softmax (docs/semantics.md §2): double reference of one row. mf/mh: mask row or NULL. */
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
    fns[v](d, xin, mask, sl, sk, k.scale, ys[v], 1);
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
 * rms_norm (docs/semantics.md §3): double reference of one row, NMSE per row */
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
    cf_rms_norm_rows_f32__neon(rows, n, x, wp, 1e-6f, y, 1);
    cf_rms_norm_rows_f32__scalar(rows, n, x, wp, 1e-6f, ys, 1);
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
    cf_rms_norm_f32__neon(dd, x, NULL, wp, NULL, 1e-6f, NULL, yd, 1);
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
    fns[v](d, xin, rp, wp, bp, eps, use_r ? hs[v] : NULL, ys[v], 1);
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
  /* fused and unfused compute the same bits (docs/semantics.md §5), padding included */
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

/* ---------------------------------------------------------------------------------------------
 * flash attention (docs/semantics.md §4): double reference per (s, h, n), from the stored values (f16 K/V
 * widened exactly by __fp16). Excluded positions (fl(slope*mask) == -inf) are skipped before the
 * dot product; an empty row is zeros; the sink joins the max and the denominator only. */
enum { FA_SP_FULLROW = 1, FA_SP_BLOCK = 2, FA_SP_GARBAGE = 4, FA_SP_NANQ = 8 };
typedef struct {
  int64_t S, Hq, Hk, Hv, N, T, DK, DV, mS, mH;
  int kf16, vf16, mkind; /* mkind: 0 none, 1 f32, 2 f16 */
  int sinks, alibi, v_of_k, special;
  float softcap;
} fa_case;

static float alibi_slope(int64_t h, int64_t n_head, float max_bias) { /* docs/semantics.md §2, in f32 */
  int64_t l2 = 1;
  while (l2 * 2 <= n_head) l2 *= 2;
  const float m0 = powf(2.0f, -max_bias / (float)l2), m1 = powf(2.0f, -(max_bias / 2.0f) / (float)l2);
  return h < l2 ? powf(m0, (float)(h + 1)) : powf(m1, (float)(2 * (h - l2) + 1));
}

/* out[DV]; returns 1 when no position is included (the row is zeros); NaN rows come out NaN */
static int ref_fa_row(int64_t T, int64_t DK, int64_t DV, const float *q, const float *kf, int64_t ks,
                      const float *vf, int64_t vs, const float *mf, const uint16_t *mh, float slope,
                      float scale, float softcap, const float *sink, double *z, double *out) {
  int any = 0, nan = 0;
  double M = -INFINITY;
  for (int64_t t = 0; t < T; t++) {
    double a = 0.0;
    if (mf || mh) {
      const float af = slope * (mf ? mf[t] : h2f(mh[t])); /* f32 product, as upstream */
      if (af == -INFINITY) { z[t] = NAN; continue; }
      a = af;
    }
    double dot = 0.0;
    for (int64_t j = 0; j < DK; j++) dot += (double)q[j] * (double)kf[t * ks + j];
    double zt = softcap != 0.0f ? softcap * tanh(dot * scale / softcap) : dot * scale;
    z[t] = zt += a;
    any = 1;
    if (isnan(zt)) nan = 1;
    else if (zt > M) M = zt;
  }
  if (sink && *sink > M) M = *sink;
  for (int64_t c = 0; c < DV; c++) out[c] = nan ? NAN : 0.0;
  if (nan || M == -INFINITY) return !any;
  double den = sink ? exp(*sink - M) : 0.0;
  for (int64_t t = 0; t < T; t++) {
    if (isnan(z[t])) continue; /* excluded (a NaN z would have returned above) */
    const double e = exp(z[t] - M);
    den += e;
    for (int64_t c = 0; c < DV; c++) out[c] += e * (double)vf[t * vs + c];
  }
  for (int64_t c = 0; c < DV; c++) out[c] /= den;
  return !any;
}

typedef struct {
  const char *name;
  fa_fn fn;
  int strategy;
  int64_t chunk, qtile;
  int nth; /* threads (when the kernels take a thread count) */
} fa_path;

static void test_fa(const fa_case *c, int64_t chunk_a, int64_t chunk_b) {
  const int64_t S = c->S, Hq = c->Hq, Hk = c->Hk, Hv = c->v_of_k ? c->Hk : c->Hv, N = c->N, T = c->T;
  const int64_t DK = c->DK, DV = c->DV;
  const int kf16 = c->kf16, vf16 = c->v_of_k ? c->kf16 : c->vf16;
  int64_t d[FA_LEN];
  memset(d, 0, sizeof d);
  d[FA_S] = S, d[FA_HQ] = Hq, d[FA_N] = N, d[FA_DK] = DK, d[FA_HK] = Hk, d[FA_HV] = Hv, d[FA_T] = T;
  d[FA_DV] = DV, d[FA_KF16] = kf16, d[FA_VF16] = vf16;
  /* q rows padded with guards; K/V a KV cache of 2T rows per head, rows >= T hold NaN */
  d[FA_QS2] = DK + 3, d[FA_QS1] = N * d[FA_QS2], d[FA_QS0] = Hq * d[FA_QS1];
  d[FA_KS2] = DK + 1, d[FA_KS1] = 2 * T * d[FA_KS2], d[FA_KS0] = Hk * d[FA_KS1];
  if (c->v_of_k) d[FA_VS2] = d[FA_KS2], d[FA_VS1] = d[FA_KS1], d[FA_VS0] = d[FA_KS0];
  else d[FA_VS2] = DV + 2, d[FA_VS1] = 2 * T * d[FA_VS2], d[FA_VS0] = Hv * d[FA_VS1];
  /* mask (mS, mH, N + 1, T + 3): extra rows and columns are never used */
  const int64_t mS = c->mkind ? c->mS : 1, mH = c->mkind ? c->mH : 1, mN = N + 1, Tm = T + 3;
  d[FA_MS] = mS, d[FA_MH] = mH, d[FA_MKIND] = c->mkind;
  d[FA_MS2] = Tm, d[FA_MS1] = mN * Tm, d[FA_MS0] = mH * mN * Tm;
  d[FA_OS2] = DV + 1, d[FA_OS1] = Hq * d[FA_OS2] + 2, d[FA_OS0] = N * d[FA_OS1] + 3;
  const int64_t nq = S * d[FA_QS0], nk = S * d[FA_KS0], nv = S * d[FA_VS0], nm = mS * d[FA_MS0];
  const int64_t no = S * d[FA_OS0] + 1;

  float *q = fbuf(nq), *kf = fbuf(nk), *vf = c->v_of_k ? kf : fbuf(nv), *mf = fbuf(nm);
  uint16_t *kh = xmalloc((size_t)nk * 2), *vh = c->v_of_k ? kh : xmalloc((size_t)nv * 2);
  uint16_t *mh = xmalloc((size_t)nm * 2);
  for (int64_t i = 0; i < nq; i++) if (i % d[FA_QS2] < DK) q[i] = uni(-1, 1);
  for (int64_t s = 0; s < S; s++)
    for (int64_t h = 0; h < Hk; h++)
      for (int64_t t = 0; t < 2 * T; t++)
        for (int64_t j = 0; j < DK; j++) {
          float *p = kf + s * d[FA_KS0] + h * d[FA_KS1] + t * d[FA_KS2] + j;
          *p = t < T ? uni(-1, 1) : NAN;
          if (kf16) *p = h2f(f2h(*p)); /* the value the kernel sees */
        }
  if (!c->v_of_k)
    for (int64_t s = 0; s < S; s++)
      for (int64_t h = 0; h < Hv; h++)
        for (int64_t t = 0; t < 2 * T; t++)
          for (int64_t j = 0; j < DV; j++) {
            float *p = vf + s * d[FA_VS0] + h * d[FA_VS1] + t * d[FA_VS2] + j;
            *p = t < T ? uni(-1, 1) : NAN;
            if (vf16) *p = h2f(f2h(*p));
          }
  for (int64_t i = 0; i < nm; i++) mf[i] = urand() < 0.1 ? -INFINITY : uni(-1, 1);
  if (c->special & FA_SP_BLOCK) /* a whole 64-wide KV block (or its partial tail) for every row */
    for (int64_t i = 0; i < nm; i++) if (i % Tm >= 64 && i % Tm < 128) mf[i] = -INFINITY;
  if (c->special & FA_SP_FULLROW) { /* mask rows (0, 0, 0) and (last, last, N - 1) */
    for (int64_t t = 0; t < Tm; t++) mf[t] = -INFINITY;
    for (int64_t t = 0; t < Tm; t++) mf[(mS - 1) * d[FA_MS0] + (mH - 1) * d[FA_MS1] + (N - 1) * Tm + t] = -INFINITY;
  }
  if (c->special & FA_SP_GARBAGE) {
    /* columns masked for every row hold NaN / +inf / -inf in K and V: they must not be read */
    for (int64_t t = 0; t < T; t++) {
      int dead = t % 37 == 5 || ((c->special & FA_SP_BLOCK) && t >= 64 && t < 128 && t % 5 == 0);
      if (!dead) continue;
      for (int64_t i = 0; i < nm; i += Tm) mf[i + t] = -INFINITY;
      const float g[3] = {NAN, INFINITY, -INFINITY};
      for (int64_t s = 0; s < S; s++) {
        for (int64_t h = 0; h < Hk; h++)
          for (int64_t j = 0; j < DK; j++) kf[s * d[FA_KS0] + h * d[FA_KS1] + t * d[FA_KS2] + j] = g[(t / 37) % 3];
        if (!c->v_of_k)
          for (int64_t h = 0; h < Hv; h++)
            for (int64_t j = 0; j < DV; j++) vf[s * d[FA_VS0] + h * d[FA_VS1] + t * d[FA_VS2] + j] = g[(t / 37 + 1) % 3];
      }
    }
    /* columns masked for some rows only (even query rows; mask head 0): NaN in K (K head 0) and
     * V (V head 0) there reaches exactly the rows that include the column */
    if (T >= 3) {
      const int64_t t1 = T - 2, t2 = T / 3;
      for (int64_t s = 0; s < mS; s++)
        for (int64_t h = 0; h < mH; h++)
          for (int64_t n = 0; n < N; n++) {
            if (n % 2 == 0) mf[s * d[FA_MS0] + h * d[FA_MS1] + n * Tm + t1] = -INFINITY;
            if (h == 0) mf[s * d[FA_MS0] + h * d[FA_MS1] + n * Tm + t2] = -INFINITY;
          }
      for (int64_t s = 0; s < S; s++) { /* whole rows, so an including row is NaN throughout */
        for (int64_t j = 0; j < DK; j++) kf[s * d[FA_KS0] + t1 * d[FA_KS2] + j] = NAN;
        for (int64_t j = 0; j < DV; j++) vf[s * d[FA_VS0] + t2 * d[FA_VS2] + j] = NAN;
      }
    }
  }
  if (c->special & FA_SP_NANQ) q[DK / 3] = NAN; /* row (0, 0, 0): an included NaN */
  for (int64_t i = 0; i < nk; i++) kh[i] = f2h(kf[i]);
  if (!c->v_of_k) for (int64_t i = 0; i < nv; i++) vh[i] = f2h(vf[i]);
  for (int64_t i = 0; i < nm; i++) mh[i] = f2h(mf[i]);
  if (c->mkind == 2) for (int64_t i = 0; i < nm; i++) mf[i] = h2f(mh[i]); /* what the reference reads */

  float *slopes = fbuf(Hq), *sinks = fbuf(Hq);
  for (int64_t h = 0; h < Hq; h++) slopes[h] = alibi_slope(h, Hq, 8.0f), sinks[h] = uni(-10, 10);
  const void *kp = kf16 ? (const void *)kh : (const void *)kf;
  const void *vp = vf16 ? (const void *)vh : (const void *)vf;
  const void *mp = c->mkind == 1 ? (const void *)mf : c->mkind == 2 ? (const void *)mh : NULL;
  const float *sl = c->alibi && c->mkind ? slopes : NULL, *sk = c->sinks ? sinks : NULL;
  const float scale = (float)(1.0 / sqrt((double)DK));

  /* the reference, row by row: ref[(s, n, h) * DV + c]; kind: 0 ordinary, 1 empty, 2 NaN */
  const int64_t nrows = S * N * Hq;
  double *ref = xmalloc((size_t)(nrows * DV + 1) * sizeof(double)), *z = xmalloc((size_t)(T + 1) * sizeof(double));
  unsigned char *kind = xmalloc((size_t)nrows + 1);
  for (int64_t s = 0; s < S; s++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t h = 0; h < Hq; h++) {
        const int64_t r = (s * N + n) * Hq + h;
        const int64_t mo = (s % mS) * d[FA_MS0] + (h % mH) * d[FA_MS1] + n * d[FA_MS2];
        const int empty = ref_fa_row(
            T, DK, DV, q + s * d[FA_QS0] + h * d[FA_QS1] + n * d[FA_QS2],
            kf + s * d[FA_KS0] + (h / (Hq / Hk)) * d[FA_KS1], d[FA_KS2],
            vf + s * d[FA_VS0] + (h / (Hq / Hv)) * d[FA_VS1], d[FA_VS2],
            c->mkind ? mf + mo : NULL, NULL, sl ? sl[h] : 1.0f, scale, c->softcap, sk ? sk + h : NULL,
            z, ref + r * DV);
        kind[r] = empty ? 1 : (DV > 0 && isnan(ref[r * DV])) ? 2 : 0;
      }

  /* copies of the inputs: no kernel may modify them */
  float *q0 = xmalloc((size_t)nq * 4), *kf0 = xmalloc((size_t)nk * 4), *m0 = xmalloc((size_t)nm * 4);
  uint16_t *kh0 = xmalloc((size_t)nk * 2), *mh0 = xmalloc((size_t)nm * 2);
  memcpy(q0, q, (size_t)nq * 4), memcpy(kf0, kf, (size_t)nk * 4), memcpy(m0, mf, (size_t)nm * 4);
  memcpy(kh0, kh, (size_t)nk * 2), memcpy(mh0, mh, (size_t)nm * 2);

  const fa_path paths[] = {
      {"rows", cf_flash_attn_f32__neon, FA_ROWS, 0, 64, 1},
      {"tiled", cf_flash_attn_f32__neon, FA_TILED, 0, 64, 1},
      {"tiled q_tile=5 (3 threads)", cf_flash_attn_f32__neon, FA_TILED, 0, 5, 3},
      {"split chunk A", cf_flash_attn_f32__neon, FA_SPLIT, chunk_a, 64, 1},
      {"split chunk B (2 threads)", cf_flash_attn_f32__neon, FA_SPLIT, chunk_b, 64, 2},
      {"unfused", cf_flash_attn_unfused_f32__neon, 0, 0, 0, 1},
  };
  const int np = (int)(sizeof paths / sizeof paths[0]);
  float *outs[6];
  for (int p = 0; p < np; p++) {
    d[FA_STRATEGY] = paths[p].strategy, d[FA_CHUNK] = paths[p].chunk, d[FA_QTILE] = paths[p].qtile;
    outs[p] = fbuf(no);
    float *o = fbuf(no);
    const int rc = paths[p].fn(d, q, kp, vp, mp, sl, sk, scale, c->softcap, o, paths[p].nth);
    CHECK(rc == 0, "%s returned %d", paths[p].name, rc);
    double num = 0.0, den = 0.0;
    int zero_bad = 0, nan_bad = 0, guard_bad = 0;
    for (int64_t s = 0; s < S; s++)
      for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < Hq; h++) {
          const int64_t r = (s * N + n) * Hq + h;
          float *orow = o + s * d[FA_OS0] + n * d[FA_OS1] + h * d[FA_OS2];
          for (int64_t cc = 0; cc < DV; cc++) {
            const double rv = ref[r * DV + cc], ov = orow[cc];
            if (kind[r] == 1) zero_bad += !(orow[cc] == 0.0f);
            else if (kind[r] == 2) nan_bad += !isnan(orow[cc]);
            else num += (ov - rv) * (ov - rv), den += rv * rv;
          }
          memcpy(outs[p] + (orow - o), orow, (size_t)DV * sizeof(float)); /* kept for below */
          for (int64_t cc = 0; cc < DV; cc++) orow[cc] = GUARD; /* for the padding check below */
        }
    for (int64_t i = 0; i < no; i++) guard_bad += !is_guard(o[i]);
    const double e = den > 0 ? num / den : num;
    CHECK(e <= 1e-10, "%s: NMSE %.3g vs the f64 reference", paths[p].name, e);
    CHECK(zero_bad == 0, "%s: %d elements of empty (fully masked) rows are not 0", paths[p].name, zero_bad);
    CHECK(nan_bad == 0, "%s: %d elements of rows with an included NaN are not NaN", paths[p].name, nan_bad);
    CHECK(guard_bad == 0, "%s: %d elements outside the output rows were written", paths[p].name, guard_bad);
    CHECK(memcmp(q, q0, (size_t)nq * 4) == 0 && memcmp(kf, kf0, (size_t)nk * 4) == 0 &&
          memcmp(kh, kh0, (size_t)nk * 2) == 0 && memcmp(mf, m0, (size_t)nm * 4) == 0 &&
          memcmp(mh, mh0, (size_t)nm * 2) == 0, "%s modified an input", paths[p].name);
    free(o);
  }
  /* every path within 1e-12 of the rows strategy (blocking, chunking and fusion invariance) */
  for (int p = 1; p < np; p++) {
    double num = 0.0, den = 0.0;
    for (int64_t s = 0; s < S; s++)
      for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < Hq; h++) {
          if (kind[(s * N + n) * Hq + h] != 0) continue;
          const int64_t off = s * d[FA_OS0] + n * d[FA_OS1] + h * d[FA_OS2];
          for (int64_t cc = 0; cc < DV; cc++) {
            const double a = outs[0][off + cc], b = outs[p][off + cc];
            num += (a - b) * (a - b), den += a * a;
          }
        }
    const double e = den > 0 ? num / den : num;
    CHECK(e <= 1e-12, "%s vs rows: NMSE %.3g", paths[p].name, e);
  }
  /* the thread count never changes a bit (fixed chunking, docs/semantics.md §1): rows and split chunk A
   * again on 3 threads, tiled q_tile=5 again on 1 */
  const int again[3][2] = {{0, 3}, {3, 3}, {2, 1}};
  for (int a = 0; a < 3; a++) {
    const fa_path *pp = &paths[again[a][0]];
    d[FA_STRATEGY] = pp->strategy, d[FA_CHUNK] = pp->chunk, d[FA_QTILE] = pp->qtile;
    d[FA_COLD] = a == 0; /* the rows path once more with its cold-cache prefetch (no bit changes) */
    float *o = fbuf(no);
    pp->fn(d, q, kp, vp, mp, sl, sk, scale, c->softcap, o, again[a][1]);
    CHECK(memcmp(o, outs[again[a][0]], (size_t)no * sizeof(float)) == 0,
          "%s: %d threads give different bits than %d", pp->name, again[a][1], pp->nth);
    free(o);
  }
  for (int p = 0; p < np; p++) free(outs[p]);
  free(q), free(kf), free(kh), free(mf), free(mh), free(slopes), free(sinks), free(ref), free(z), free(kind);
  if (!c->v_of_k) free(vf), free(vh);
  free(q0), free(kf0), free(m0), free(kh0), free(mh0);
}

static void test_fa_all(void) {
  static const int64_t dims[][2] = {{40, 40}, {64, 64}, {72, 72}, {128, 128}, {576, 512}};
  static const int64_t Ts[] = {1, 113, 200}, Ns[] = {1, 3, 70};
  /* (Hq, Hk, Hv): MHA, GQA 2, GQA 8 (MQA), K and V with different head counts, GQA 4 */
  static const int64_t heads[][3] = {{2, 2, 2}, {4, 2, 2}, {8, 1, 1}, {6, 3, 1}, {4, 1, 1}};
  static const int kv[][2] = {{1, 1}, {0, 0}, {1, 0}, {0, 1}}; /* (K f16, V f16) */
  static const int specials[] = {0, FA_SP_FULLROW, FA_SP_GARBAGE, FA_SP_BLOCK | FA_SP_GARBAGE,
                                 FA_SP_FULLROW | FA_SP_BLOCK, FA_SP_FULLROW | FA_SP_GARBAGE};
  static const int64_t chunks[] = {1, 7, 64, 100, 33};
  int i = 0;
  for (size_t a = 0; a < sizeof dims / sizeof dims[0]; a++)
    for (size_t b = 0; b < sizeof Ts / sizeof Ts[0]; b++)
      for (size_t e = 0; e < sizeof Ns / sizeof Ns[0]; e++, i++) {
        fa_case c;
        memset(&c, 0, sizeof c);
        c.DK = dims[a][0], c.DV = dims[a][1], c.T = Ts[b], c.N = Ns[e];
        const int64_t *hd = heads[i % 5];
        c.Hq = hd[0], c.Hk = hd[1], c.Hv = hd[2];
        c.v_of_k = c.DK == 576;
        if (c.v_of_k) c.Hq = c.N == 70 ? 1 : 4, c.Hk = c.Hv = 1; /* keep MLA cheap under qemu */
        c.kf16 = kv[i % 4][0], c.vf16 = kv[i % 4][1];
        c.S = i % 3 == 2 && c.N < 70 ? 2 : 1; /* (qemu time) */
        c.mkind = i % 7 == 0 ? 0 : 1 + (i % 2);
        c.mS = c.S == 2 && i % 2 ? 2 : 1;
        c.mH = c.Hq % 2 == 0 && (i / 2) % 2 ? 2 : 1;
        c.special = c.mkind ? specials[i % 6] : 0;
        if (i % 11 == 4) c.special |= FA_SP_NANQ;
        c.sinks = (i / 3) % 2 == 0;
        c.alibi = i % 5 != 1;
        c.softcap = c.DK == 128 || i % 9 == 0 ? 10.0f : 0.0f;
        const int64_t ca = chunks[i % 5], cb = chunks[(i + 2) % 5];
        begin("flash_attn DK=%lld DV=%lld T=%lld N=%lld S=%lld heads(%lld,%lld,%lld) K %s V %s%s mask=%s(%lld,%lld)%s%s%s%s%s%s%s chunks %lld,%lld",
              (long long)c.DK, (long long)c.DV, (long long)c.T, (long long)c.N, (long long)c.S,
              (long long)c.Hq, (long long)c.Hk, (long long)c.Hv, c.kf16 ? "f16" : "f32",
              (c.v_of_k ? c.kf16 : c.vf16) ? "f16" : "f32", c.v_of_k ? " (V view of K)" : "",
              c.mkind == 0 ? "none" : c.mkind == 1 ? "f32" : "f16", (long long)c.mS, (long long)c.mH,
              c.sinks ? " sinks" : "", c.alibi && c.mkind ? " alibi" : "", c.softcap != 0.0f ? " softcap=10" : "",
              c.special & FA_SP_FULLROW ? " full-rows" : "", c.special & FA_SP_BLOCK ? " masked-block" : "",
              c.special & FA_SP_GARBAGE ? " nan/inf-at-masked" : "", c.special & FA_SP_NANQ ? " nan-q" : "",
              (long long)ca, (long long)cb);
        test_fa(&c, ca, cb);
        end();
      }
  /* a NaN q row over one partial block (T = 40 < 64): the NaN must survive the block max even
   * though every SIMD lane ends on a padding column */
  for (int sinks = 0; sinks < 2; sinks++) {
    fa_case c = {.S = 1, .Hq = 4, .Hk = 1, .Hv = 1, .N = 3, .T = 40, .DK = 64, .DV = 64, .mS = 1, .mH = 1,
                 .kf16 = 1, .vf16 = 1, .mkind = 0, .sinks = sinks, .special = FA_SP_NANQ};
    begin("flash_attn nan-q T=40 (one partial block)%s", sinks ? " sinks" : "");
    test_fa(&c, 7, 48);
    end();
  }
}

/* ---------------------------------------------------------------------------------------------
 * rope (docs/semantics.md §7): accurate mode vs a double reference (NMSE <= 1e-12); ggml_compat mode vs
 * ggml's f32 chain written here (libm powf/cosf/sinf/logf, fmaf where GCC contracts), bit for bit
 * on neon and without the FMA of the rotation on scalar; f16 output = f2h(f32 output); in place;
 * thread counts 1 and 3 identical; guards after every row untouched. */
typedef struct {
  int64_t T, H, D, nd;
  int mode, compat, ext, ff;
  double base, fs;
} rp_case;

static void rp_params(const rp_case *c, double *fp) {
  fp[RPF_BASE] = c->base, fp[RPF_SCALE] = c->fs, fp[RPF_EXT] = c->ext ? 1.0 : 0.0;
  fp[RPF_ATTN] = c->ext ? 0.9 : 1.0, fp[RPF_BETA_FAST] = 32.0, fp[RPF_BETA_SLOW] = 1.0;
}

/* the rotation pairs of pair k */
static void rp_pair(const rp_case *c, int64_t k, int64_t *ia, int64_t *ib) {
  if (c->mode == 0) *ia = 2 * k, *ib = 2 * k + 1;
  else *ia = k, *ib = k + c->nd / 2;
}

/* per-token tables: double (accurate reference) and ggml's float chain */
static void rp_ref_tables(const rp_case *c, const double *fp, const int32_t *pos, const float *ff,
                          int64_t nco, double *Cd, double *Sd, float *Cf, float *Sf) {
  const int64_t half = c->nd / 2;
  /* double */
  double lo = 0, hi = 0, m = fp[RPF_ATTN];
  if (c->ext) {
    const double cf = (double)c->nd * log((double)nco / (fp[RPF_BETA_FAST] * 2 * 3.14159265358979323846)) / (2 * log(fp[RPF_BASE]));
    const double cs = (double)c->nd * log((double)nco / (fp[RPF_BETA_SLOW] * 2 * 3.14159265358979323846)) / (2 * log(fp[RPF_BASE]));
    lo = fmax(0.0, floor(cf)), hi = fmin((double)(c->nd - 1), ceil(cs));
    m *= 1.0 + 0.1 * log(1.0 / fp[RPF_SCALE]);
  }
  for (int64_t t = 0; t < c->T; t++)
    for (int64_t k = 0; k < half; k++) {
      const double te = pos[t] * pow(fp[RPF_BASE], -2.0 * (double)k / (double)c->nd) / (ff ? ff[k] : 1.0);
      double phi = fp[RPF_SCALE] * te;
      if (c->ext) {
        double y = ((double)k - lo) / fmax(0.001, hi - lo);
        y = y < 0 ? 0 : y > 1 ? 1 : y;
        const double r = (1 - y) * fp[RPF_EXT];
        phi = phi * (1 - r) + te * r;
      }
      Cd[t * half + k] = cos(phi) * m, Sd[t * half + k] = sin(phi) * m;
    }
  /* float, ggml's order of operations */
  const float base = (float)fp[RPF_BASE], fs = (float)fp[RPF_SCALE], ef = (float)fp[RPF_EXT];
  const float ts = powf(base, -2.0f / (float)c->nd);
  float mf = (float)fp[RPF_ATTN], lof = 0, hif = 0;
  if (c->ext) {
    const float cf = (float)c->nd * logf((float)nco / ((float)fp[RPF_BETA_FAST] * 2.0f * (float)3.14159265358979323846)) / (2.0f * logf(base));
    const float cs = (float)c->nd * logf((float)nco / ((float)fp[RPF_BETA_SLOW] * 2.0f * (float)3.14159265358979323846)) / (2.0f * logf(base));
    lof = fmaxf(0.0f, floorf(cf)), hif = fminf((float)(c->nd - 1), ceilf(cs));
    mf = mf * (1.0f + 0.1f * logf(1.0f / fs));
  }
  for (int64_t t = 0; t < c->T; t++) {
    float theta = (float)pos[t];
    for (int64_t k = 0; k < half; k++) {
      const float te = ff ? theta / ff[k] : theta, ti = fs * te;
      float phi = ti;
      if (c->ext) {
        float y = ((float)k - lof) / fmaxf(0.001f, hif - lof);
        y = y < 0 ? 0 : y > 1 ? 1 : y;
        const float r = (1.0f - y) * ef;
        phi = fmaf(ti, 1.0f - r, te * r);
      }
      Cf[t * half + k] = cosf(phi) * mf, Sf[t * half + k] = sinf(phi) * mf;
      theta = theta * ts;
    }
  }
}

static void test_rope(const rp_case *c) {
  const int64_t T = c->T, H = c->H, D = c->D, nd = c->nd, half = nd / 2, XS1 = D + 3, XS0 = H * XS1 + 5;
  const int64_t YS1 = D + 1, YS0 = H * YS1 + 2, nco = 4096;
  double fp[RPF_LEN];
  rp_params(c, fp);
  int32_t *pos = xmalloc((size_t)T * sizeof(int32_t));
  static const int32_t P[] = {0, 1, 131072, 65535, 8192, 7, 131071};
  for (int64_t t = 0; t < T; t++) pos[t] = t < 7 ? P[t] : (int32_t)(urand() * 131072);
  float *ff = NULL;
  if (c->ff) {
    ff = xmalloc((size_t)half * sizeof(float));
    for (int64_t k = 0; k < half; k++) ff[k] = uni(0.5f, 8.0f);
  }
  float *x = fbuf(T * XS0);
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < D; i++) x[t * XS0 + h * XS1 + i] = uni(-4, 4);
  double *Cd = xmalloc((size_t)(T * half) * sizeof(double)), *Sd = xmalloc((size_t)(T * half) * sizeof(double));
  float *Cf = xmalloc((size_t)(T * half) * sizeof(float)), *Sf = xmalloc((size_t)(T * half) * sizeof(float));
  rp_ref_tables(c, fp, pos, ff, nco, Cd, Sd, Cf, Sf);
  int64_t d[RP_LEN] = {[RP_T] = T, [RP_H] = H, [RP_D] = D, [RP_NDIMS] = nd, [RP_MODE] = c->mode,
                       [RP_COMPAT] = c->compat, [RP_YF16] = 0, [RP_XS0] = XS0, [RP_XS1] = XS1,
                       [RP_YS0] = YS0, [RP_YS1] = YS1, [RP_NCTX_ORIG] = nco};
  float *y = fbuf(T * YS0), *y3 = fbuf(T * YS0), *ys = fbuf(T * YS0);
  CHECK(cf_rope_f32__neon(d, x, pos, ff, fp, y, 1) == 0, "neon rc");
  CHECK(cf_rope_f32__neon(d, x, pos, ff, fp, y3, 3) == 0, "neon rc (3 threads)");
  CHECK(cf_rope_f32__scalar(d, x, pos, ff, fp, ys, 1) == 0, "scalar rc");
  CHECK(memcmp(y, y3, (size_t)(T * YS0) * sizeof(float)) == 0, "1 vs 3 threads differ");
  double num = 0, den = 0;
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      const float *xr = x + t * XS0 + h * XS1, *yr = y + t * YS0 + h * YS1, *sr = ys + t * YS0 + h * YS1;
      for (int64_t k = 0; k < half; k++) {
        int64_t ia, ib;
        rp_pair(c, k, &ia, &ib);
        const double a = xr[ia], b = xr[ib], C = Cd[t * half + k], S = Sd[t * half + k];
        const double ra = a * C - b * S, rb = a * S + b * C;
        num += (yr[ia] - ra) * (yr[ia] - ra) + (yr[ib] - rb) * (yr[ib] - rb), den += ra * ra + rb * rb;
        if (c->compat) { /* ggml's f32 chain: FMA form on neon, separate products on scalar */
          const float Cg = Cf[t * half + k], Sg = Sf[t * half + k], fa = xr[ia], fb = xr[ib];
          const float ga = fmaf(fa, Cg, -(fb * Sg)), gb = fmaf(fa, Sg, fb * Cg);
          const float pa1 = fa * Cg, pa2 = fb * Sg, pb1 = fa * Sg, pb2 = fb * Cg;
          CHECK(yr[ia] == ga && yr[ib] == gb, "neon vs ggml chain t=%lld h=%lld k=%lld: %.9g %.9g vs %.9g %.9g",
                (long long)t, (long long)h, (long long)k, yr[ia], yr[ib], ga, gb);
          CHECK(sr[ia] == pa1 - pa2 && sr[ib] == pb1 + pb2, "scalar vs ggml chain (no FMA) t=%lld k=%lld",
                (long long)t, (long long)k);
        }
      }
      for (int64_t i = nd; i < D; i++) CHECK(yr[i] == xr[i], "pass-through dim %lld", (long long)i);
      CHECK(is_guard(yr[D]), "guard after row t=%lld h=%lld overwritten", (long long)t, (long long)h);
    }
  const double e = den > 0 ? num / den : num;
  if (!c->compat) CHECK(e <= 1e-12, "neon nmse %.3g vs double", e);
  else CHECK(e <= 1e-5, "compat nmse %.3g vs double (ggml's f32 angles)", e);
  /* f16 output (the cache write): exactly the f32 result rounded to nearest even */
  uint16_t *yh = xmalloc((size_t)(T * YS0 + 1) * sizeof(uint16_t)), *yhs = xmalloc((size_t)(T * YS0 + 1) * sizeof(uint16_t));
  for (int64_t i = 0; i <= T * YS0; i++) yh[i] = yhs[i] = 0x7777;
  d[RP_YF16] = 1;
  cf_rope_f32__neon(d, x, pos, ff, fp, yh, 3);
  cf_rope_f32__scalar(d, x, pos, ff, fp, yhs, 1);
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      for (int64_t i = 0; i < D; i++) {
        const int64_t o = t * YS0 + h * YS1 + i;
        CHECK(yh[o] == f2h(y[o]), "neon f16 t=%lld h=%lld i=%lld", (long long)t, (long long)h, (long long)i);
        CHECK(yhs[o] == f2h(ys[o]), "scalar f16 t=%lld h=%lld i=%lld", (long long)t, (long long)h, (long long)i);
      }
      CHECK(yh[t * YS0 + h * YS1 + D] == 0x7777, "f16 guard after row overwritten");
    }
  /* in place on the strided x */
  d[RP_YF16] = 0, d[RP_YS0] = XS0, d[RP_YS1] = XS1;
  cf_rope_f32__neon(d, x, pos, ff, fp, x, 3);
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      CHECK(memcmp(x + t * XS0 + h * XS1, y + t * YS0 + h * YS1, (size_t)D * sizeof(float)) == 0,
            "in place != out of place t=%lld h=%lld", (long long)t, (long long)h);
      CHECK(is_guard(x[t * XS0 + h * XS1 + D]), "in place wrote past the row");
    }
  free(pos), free(ff), free(x), free(Cd), free(Sd), free(Cf), free(Sf), free(y), free(y3), free(ys);
  free(yh), free(yhs);
}

static void test_rope_all(void) {
  static const int64_t dims[][2] = {{6, 6}, {10, 6}, {34, 34}, {64, 64}, {80, 64}, {128, 128}, {128, 32}};
  static const int64_t Hs[] = {1, 3, 9};
  int i = 0;
  for (size_t a = 0; a < sizeof dims / sizeof dims[0]; a++)
    for (int mode = 0; mode < 2; mode++)
      for (int compat = 0; compat < 2; compat++, i++) {
        rp_case c = {.T = i % 4 == 0 ? 37 : 7, .H = Hs[i % 3], .D = dims[a][0], .nd = dims[a][1],
                     .mode = mode, .compat = compat, .ext = i % 3 == 1, .ff = i % 5 == 2,
                     .base = i % 2 ? 500000.0 : 10000.0, .fs = i % 3 == 1 ? 0.25 : 1.0};
        begin("rope D=%lld n_dims=%lld H=%lld T=%lld %s %s%s%s base=%g", (long long)c.D, (long long)c.nd,
              (long long)c.H, (long long)c.T, mode ? "neox" : "norm", compat ? "ggml_compat" : "accurate",
              c.ext ? " yarn" : "", c.ff ? " freq_factors" : "", c.base);
        test_rope(&c);
        end();
      }
}

/* A quantized K/V cache (FA_KF16 / FA_VF16 = 2 Q8_0, 3 Q4_0; docs/semantics.md §4): the reference is
 * the double one above over the dequantized cache, with Q as its Q8_0 values when K is quantized.
 * With a quantized K the scores are exact int block dots, so the rows and tiled strategies (any
 * q_tile) give the same bits. */
enum { KV_Q8_0 = 2, KV_Q4_0 = 3 }; /* the FA_KF16 / FA_VF16 codes (flash_attn.inc's FA_Q8_0, FA_Q4_0) */
static int64_t q_rowbytes(int t, int64_t D) { return t == KV_Q8_0 ? D / 32 * 34 : t == KV_Q4_0 ? D / 32 * 18 : 2 * D; }
static void q_quant_row(int t, const float *x, int64_t D, unsigned char *o, float *deq) {
  if (t < KV_Q8_0) { /* f16 */
    for (int64_t i = 0; i < D; i++) { uint16_t h = f2h(x[i]); memcpy(o + 2 * i, &h, 2); deq[i] = h2f(h); }
    return;
  }
  for (int64_t b = 0; b < D / 32; b++) {
    const float *xb = x + 32 * b;
    float amax = 0.0f, mx = 0.0f;
    for (int i = 0; i < 32; i++) if (fabsf(xb[i]) > amax) amax = fabsf(xb[i]), mx = xb[i];
    if (t == KV_Q8_0) {
      unsigned char *blk = o + 34 * b;
      const uint16_t dh = f2h(amax / 127.0f);
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      memcpy(blk, &dh, 2);
      for (int i = 0; i < 32; i++) {
        const int8_t c = (int8_t)nearbyintf(xb[i] * id);
        memcpy(blk + 2 + i, &c, 1);
        deq[32 * b + i] = h2f(dh) * (float)c;
      }
    } else {
      unsigned char *blk = o + 18 * b;
      const uint16_t dh = f2h(mx / -8.0f);
      const float id = mx != 0.0f ? -8.0f / mx : 0.0f;
      memcpy(blk, &dh, 2);
      int c[32];
      for (int i = 0; i < 32; i++) {
        const int v = (int)(xb[i] * id + 8.5f);
        c[i] = v < 0 ? 0 : v > 15 ? 15 : v;
        deq[32 * b + i] = h2f(dh) * (float)(c[i] - 8);
      }
      for (int i = 0; i < 16; i++) blk[2 + i] = (unsigned char)(c[i] | (c[i + 16] << 4));
    }
  }
}
/* FNV-1a over the bytes of every quantized-cache attention output: the plain and the dot-product
 * builds must print the same (run_neon_qemu.sh compares them) */
static uint64_t g_fa_digest = 0xcbf29ce484222325ull;
static void fa_digest(const float *y, int64_t n) {
  const unsigned char *b = (const unsigned char *)y;
  for (size_t i = 0; i < (size_t)n * sizeof(float); i++) g_fa_digest = (g_fa_digest ^ b[i]) * 0x100000001b3ull;
}
static void test_fa_quant(int kt, int vt, int64_t N, int64_t T) {
  const int64_t Hq = 8, Hk = 2, DK = 64, DV = 64, kb = q_rowbytes(kt, DK), vb = q_rowbytes(vt, DV);
  begin("flash_attn quantized K %d V %d N=%lld T=%lld", kt, vt, (long long)N, (long long)T);
  float *q = fbuf(Hq * N * DK), *qd = fbuf(Hq * N * DK), *kd = fbuf(Hk * T * DK), *vd = fbuf(Hk * T * DV), *x = fbuf(DK);
  unsigned char *k = xmalloc((size_t)(Hk * T * kb)), *v = xmalloc((size_t)(Hk * T * vb));
  uint16_t *m = xmalloc((size_t)(N * T) * 2);
  for (int64_t i = 0; i < Hq * N * DK; i++) q[i] = uni(-2, 2);
  for (int64_t r = 0; r < Hk * T; r++) {
    for (int64_t j = 0; j < DK; j++) x[j] = uni(-1, 1);
    q_quant_row(kt, x, DK, k + r * kb, kd + r * DK);
    for (int64_t j = 0; j < DV; j++) x[j] = uni(-1, 1);
    q_quant_row(vt, x, DV, v + r * vb, vd + r * DV);
  }
  for (int64_t n = 0; n < N; n++) /* causal at the end, a band of -inf, row 1 without its tail */
    for (int64_t t = 0; t < T; t++)
      m[n * T + t] = (t > T - N + n || (t >= 3 && t < T / 3) || (n == 1 && t >= T / 2)) ? 0xFC00u : 0;
  for (int64_t r = 0; r < Hq * N; r++) { /* Q as its Q8_0 values when K is quantized */
    unsigned char tmp[64 / 32 * 34];
    if (kt >= 2) q_quant_row(2, q + r * DK, DK, tmp, qd + r * DK);
    else memcpy(qd + r * DK, q + r * DK, (size_t)DK * sizeof(float));
  }
  const float scale = 0.125f;
  double *ref = xmalloc((size_t)(N * Hq * DV) * sizeof(double)), *z = xmalloc((size_t)T * sizeof(double));
  for (int64_t n = 0; n < N; n++)
    for (int64_t h = 0; h < Hq; h++)
      ref_fa_row(T, DK, DV, qd + (h * N + n) * DK, kd + (h / 4) * T * DK, DK, vd + (h / 4) * T * DV, DV, NULL,
                 m + n * T, 1.0f, scale, 0.0f, NULL, z, ref + (n * Hq + h) * DV);
  int64_t d[FA_LEN];
  memset(d, 0, sizeof d);
  d[FA_S] = 1, d[FA_HQ] = Hq, d[FA_N] = N, d[FA_DK] = DK, d[FA_HK] = Hk, d[FA_HV] = Hk, d[FA_T] = T, d[FA_DV] = DV;
  d[FA_KF16] = kt, d[FA_VF16] = vt;
  d[FA_QS2] = DK, d[FA_QS1] = N * DK, d[FA_QS0] = Hq * N * DK;
  const int64_t ke = kt >= 2 ? kb : DK, ve = vt >= 2 ? vb : DV; /* strides: bytes, or f16 elements */
  d[FA_KS2] = ke, d[FA_KS1] = T * ke, d[FA_KS0] = Hk * T * ke;
  d[FA_VS2] = ve, d[FA_VS1] = T * ve, d[FA_VS0] = Hk * T * ve;
  d[FA_MS] = 1, d[FA_MH] = 1, d[FA_MS2] = T, d[FA_MKIND] = 2;
  d[FA_OS2] = DV, d[FA_OS1] = Hq * DV, d[FA_OS0] = N * Hq * DV;
  const struct { int strategy; int64_t qtile; int nth; } ps[] = {{FA_ROWS, 64, 1}, {FA_TILED, 64, 1}, {FA_TILED, 5, 3},
                                                                 {FA_SPLIT, 64, 2}};
  float *out[4];
  for (int p = 0; p < 4; p++) {
    out[p] = fbuf(N * Hq * DV);
    d[FA_STRATEGY] = ps[p].strategy, d[FA_QTILE] = ps[p].qtile, d[FA_CHUNK] = 100;
    CHECK(cf_flash_attn_f32__neon(d, q, k, v, m, NULL, NULL, scale, 0.0f, out[p], ps[p].nth) == 0, "rc");
    const double e = nmse(N * Hq * DV, out[p], ref);
    CHECK(e < 1e-10, "strategy %d q_tile %lld: nmse %g", ps[p].strategy, (long long)ps[p].qtile, e);
    fa_digest(out[p], N * Hq * DV);
  }
  if (kt >= 2)
    for (int p = 1; p < 3; p++)
      CHECK(!memcmp(out[0], out[p], (size_t)(N * Hq * DV) * sizeof(float)), "tiled (q_tile %lld) differs from rows",
            (long long)ps[p].qtile);
  end();
  for (int p = 0; p < 4; p++) free(out[p]);
  free(q), free(qd), free(kd), free(vd), free(x), free(k), free(v), free(m), free(ref), free(z);
}
static void test_fa_quant_all(void) {
  const int kv[][2] = {{2, 1}, {3, 1}, {1, 2}, {1, 3}, {2, 3}, {3, 2}};
  const int64_t nt[][2] = {{13, 63}, {9, 130}, {1, 700}, {37, 200}};
  for (int i = 0; i < 6; i++)
    for (int j = 0; j < 4; j++) test_fa_quant(kv[i][0], kv[i][1], nt[j][0], nt[j][1]);
  printf("neon flash_attn quantized: digest %016llx\n", (unsigned long long)g_fa_digest);
}

int main(void) {
  g_rng = 0x9e3779b97f4a7c15ull;
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
  test_fa_all();
  test_fa_quant_all();
  test_rope_all();
  printf("neon: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
