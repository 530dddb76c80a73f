/* Standalone test of the NEON quantized matmul (native/kernels/quant.inc: f32 mode through
 * native/simd/neon_q.h, q8 mode through the panel tiles of qpanel.inc on native/simd/neon_p.h), for
 * aarch64 (native or qemu-user). Links isa_neon.c, isa_scalar.c and native/src/repack.c.
 * For every supported weight type (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS) with random valid blocks it checks:
 *  - f32 mode against a double reference written here (dequantization per docs/semantics.md §8, times x):
 *    NMSE <= 1e-10;
 *  - q8 mode against a double reference of the integer block arithmetic on the quantized
 *    activations (docs/quant-design.md), NMSE <= 1e-10, and neon against scalar, NMSE <= 1e-12;
 *  - the swiglu epilogue, the RMS-norm prologue (fused == unfused bit for bit on each ISA) and
 *    several weights in one call, neon against scalar and the references;
 *  - for the quantized types, weights repacked into P16 panels (cf_repack_p16, QW_LAY = 1) give
 *    the GGUF layout's results bit for bit (q8 and f32 mode, swiglu), and a row's result is the same
 *    alone and inside batches of 3, 5, 6, 7, 8 and 17 rows, at 1 or 3 threads (batch invariance);
 *  - cf_quantize_act__neon against cf_quantize_act__scalar byte for byte;
 *  - no write past an output row (guard elements), results independent of the thread count.
 * The descriptor layout (QM_* / QW_*) and the type ids come from the generated headers layouts.h
 * and qtypes.h. Build and run: native/tests/run_neon_qemu.sh
 * (it builds this program three times: plain armv8-a (SMULL dots), with the dot-product extension
 * (SDOT) and with i8mm (SMMLA/USDOT), and checks that the three print the same q8 digest, i.e.
 * bit-identical q8 results). argv[1] names the build in the summary.
 * Exit status 0 when every case passes. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../kernels/layouts.h" /* QM_* / QW_* (generated from cpufuse/_layouts.py) */
#include "../kernels/qtypes.h"  /* GT_*, QA_*, QK_*, QB_* (generated from cpufuse/quant/types.py) */
#include "cf_protos.h" /* native/cdef.h for neon and scalar */
#include "../kernels/repack.h" /* cf_p16_bytes, cf_repack_p16 (native/src/repack.c) */

#if !defined(__aarch64__)
#error "neon_quant_test.c is an aarch64 program (it uses __fp16 and the neon kernels)"
#endif

#include "test_util.h" /* begin/end/CHECK, g_rng/urand/uni */
static uint8_t rbyte(void) { return (uint8_t)(urand() * 256.0); }

static const float GUARD = -12345.5f;
static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) { printf("out of memory\n"); exit(1); }
  return p;
}
static float *fbuf(int64_t n) {
  float *p = xmalloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) p[i] = GUARD;
  return p;
}
static uint16_t f2h(float f) { __fp16 h = (__fp16)f; uint16_t u; memcpy(&u, &h, 2); return u; }
static double h2d(uint16_t u) { __fp16 h; memcpy(&h, &u, 2); return (double)(float)h; }
static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static void wr16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

/* FNV-1a over the q8-mode results (their N columns) of the quantized types: run_neon_qemu.sh
 * compares it across the plain, dotprod and i8mm builds, whose integer dots differ (SMULL, SDOT,
 * SMMLA) but must give the same bits */
static uint64_t g_digest = 0xcbf29ce484222325ull;
static void digest(const float *y, int64_t rows, int64_t N, int64_t ys) {
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *b = (const uint8_t *)(y + r * ys);
    for (size_t i = 0; i < (size_t)N * sizeof(float); i++) g_digest = (g_digest ^ b[i]) * 0x100000001b3ull;
  }
}


/* worst errors seen, for the summary */
static double w_f32ref, w_q8ref, w_q8ns, w_epi;

/* ---------------------------------------------------------------------------------------------
 * weight types (ggml ids) */
typedef struct { int id; const char *name; int blk, bytes, vt; } tinfo;
#define T(N, vt) {GT_##N, #N, QK_##N, QB_##N, QA_##vt}
static const tinfo TYPES[] = {
    T(F32, F32), T(F16, F32), T(BF16, F32), T(Q4_0, Q8_0),
    T(Q4_1, Q8_1), T(Q5_0, Q8_0), T(Q5_1, Q8_1), T(Q8_0, Q8_0),
    T(Q4_K, Q8_K), T(Q5_K, Q8_K), T(Q6_K, Q8_K), T(Q2_K, Q8_K),
    T(Q3_K, Q8_K), T(IQ4_NL, Q8_0), T(IQ4_XS, Q8_K), T(MXFP4, Q8_0)};
#undef T
static const int KV_IQ4NL[16] = CF_KV_IQ4NL;
static const int KV_MXFP4[16] = CF_KV_MXFP4;
#define NTYPES ((int)(sizeof TYPES / sizeof TYPES[0]))
static int64_t row_bytes(const tinfo *t, int64_t K) { return K / t->blk * t->bytes; }

/* an f16 scale: small positive normal (or, with subn, a positive subnormal) */
static uint16_t rscale(int subn) {
  if (subn) return (uint16_t)(1 + (int)(urand() * 1023.0));
  return f2h(uni(1e-3f, 1e-2f));
}
/* N rows of K elements: random bytes with valid f16 fields */
static uint8_t *gen_weights(const tinfo *t, int64_t N, int64_t K, int subn) {
  const int64_t rb = row_bytes(t, K);
  uint8_t *w = xmalloc((size_t)(N * rb));
  for (int64_t i = 0; i < N * rb; i++) w[i] = rbyte();
  if (t->blk == 1) {
    for (int64_t i = 0; i < N * K; i++) {
      const float v = uni(-1.0f, 1.0f);
      if (t->id == GT_F32) memcpy(w + 4 * i, &v, 4);
      else if (t->id == GT_F16) wr16(w + 2 * i, f2h(v));
      else { uint32_t u; memcpy(&u, &v, 4); wr16(w + 2 * i, (uint16_t)(u >> 16)); }
    }
    return w;
  }
  for (int64_t b = 0; b < N * K / t->blk; b++) {
    uint8_t *p = w + b * t->bytes;
    switch (t->id) {
      case GT_Q4_0: case GT_Q5_0: case GT_Q8_0: wr16(p, rscale(subn)); break;
      case GT_Q4_1: case GT_Q5_1: /* d, m (m of either sign) */
        wr16(p, rscale(subn));
        wr16(p + 2, (uint16_t)(rscale(subn) | (urand() < 0.5 ? 0x8000u : 0)));
        break;
      case GT_Q4_K: case GT_Q5_K: wr16(p, rscale(subn)); wr16(p + 2, rscale(subn)); break;
      case GT_Q6_K: wr16(p + 208, rscale(subn)); break;
      case GT_Q2_K: wr16(p + 80, rscale(subn)); wr16(p + 82, rscale(subn)); break;
      case GT_Q3_K: wr16(p + 108, rscale(subn)); break;
      case GT_IQ4_NL: case GT_IQ4_XS: wr16(p, rscale(subn)); break;
      case GT_MXFP4: p[0] = (uint8_t)(subn ? (int)(urand() * 2.0) : 118 + (int)(urand() * 8.0)); break;
    }
  }
  return w;
}

/* One row decoded per docs/semantics.md §8: element e is f32(f32(sc[e]*q[e]) + mn[e]) with sc, mn
 * f32 values (mn = h2f(m) for Q4_1/Q5_1, -f32(dmin*m_j) for Q4_K/Q5_K, else 0). Float types:
 * sc = the value, q = 1. */
static void decode_row(const tinfo *t, const uint8_t *row, int64_t K, int *q, double *sc, double *mn) {
  for (int64_t e0 = 0; e0 < K; e0 += t->blk) {
    const uint8_t *b = row + e0 / t->blk * t->bytes;
    for (int e = 0; e < t->blk; e++) {
      int qq = 1;
      double s = 0.0, m = 0.0;
      switch (t->id) {
        case GT_F32: { float v; memcpy(&v, b, 4); s = v; break; }
        case GT_F16: s = h2d(rd16(b)); break;
        case GT_BF16: { uint32_t u = (uint32_t)rd16(b) << 16; float v; memcpy(&v, &u, 4); s = v; break; }
        case GT_Q4_0: qq = (e < 16 ? b[2 + e] & 15 : b[2 + e - 16] >> 4) - 8; s = h2d(rd16(b)); break;
        case GT_Q4_1: qq = e < 16 ? b[4 + e] & 15 : b[4 + e - 16] >> 4; s = h2d(rd16(b)); m = h2d(rd16(b + 2)); break;
        case GT_Q5_0: case GT_Q5_1: {
          const int o = t->id == GT_Q5_0 ? 2 : 4;
          uint32_t qh;
          memcpy(&qh, b + o, 4);
          const uint8_t *qs = b + o + 4;
          qq = (e < 16 ? qs[e] & 15 : qs[e - 16] >> 4) | (int)(((qh >> e) & 1) << 4);
          if (t->id == GT_Q5_0) qq -= 16;
          else m = h2d(rd16(b + 2));
          s = h2d(rd16(b));
          break;
        }
        case GT_Q8_0: qq = (int8_t)b[2 + e]; s = h2d(rd16(b)); break;
        case GT_Q4_K: case GT_Q5_K: {
          const int j = e / 32, l = e % 32;
          const uint8_t *k = b + 4;
          int scv, mv;
          if (j < 4) { scv = k[j] & 63; mv = k[j + 4] & 63; }
          else { scv = (k[j + 4] & 15) | ((k[j - 4] >> 6) << 4); mv = (k[j + 4] >> 4) | ((k[j] >> 6) << 4); }
          const uint8_t *qs = b + (t->id == GT_Q4_K ? 16 : 48);
          const uint8_t by = qs[32 * (j / 2) + l];
          qq = j % 2 ? by >> 4 : by & 15;
          if (t->id == GT_Q5_K) qq |= ((b[16 + l] >> j) & 1) << 4;
          s = (float)(h2d(rd16(b)) * scv);
          m = -(double)(float)(h2d(rd16(b + 2)) * mv);
          break;
        }
        case GT_Q6_K: {
          const int h = e / 128, r = e % 128, g = r / 32, l = r % 32;
          const uint8_t lb = b[64 * h + 32 * (g % 2) + l];
          const int lo = g < 2 ? lb & 15 : lb >> 4, hi = (b[128 + 32 * h + l] >> (2 * g)) & 3;
          qq = lo + 16 * hi - 32;
          s = (float)(h2d(rd16(b + 208)) * (int8_t)b[192 + e / 16]);
          break;
        }
        case GT_Q2_K: case GT_Q3_K: { /* element 128h + 32g + l: bits 2g of qs[32h + l]; 16-element scales */
          const int h = e / 128, g = (e % 128) / 32, l = e % 32, j = e / 16;
          qq = (b[(t->id == GT_Q2_K ? 16 : 32) + 32 * h + l] >> (2 * g)) & 3;
          if (t->id == GT_Q2_K) {
            s = (float)(h2d(rd16(b + 80)) * (b[j] & 15));
            m = -(double)(float)(h2d(rd16(b + 82)) * (b[j] >> 4));
          } else {
            if (!((b[l] >> (e / 32)) & 1)) qq -= 4;
            const int lo = j < 8 ? b[96 + j] & 15 : b[96 + j - 8] >> 4, hi = (b[104 + j % 4] >> (2 * (j / 4))) & 3;
            s = (float)(h2d(rd16(b + 108)) * ((lo | hi << 4) - 32));
          }
          break;
        }
        case GT_IQ4_NL: qq = KV_IQ4NL[e < 16 ? b[2 + e] & 15 : b[2 + e - 16] >> 4]; s = h2d(rd16(b)); break;
        case GT_MXFP4: qq = KV_MXFP4[e < 16 ? b[1 + e] & 15 : b[1 + e - 16] >> 4]; s = ldexp(1.0, b[0] - 128); break;
        case GT_IQ4_XS: {
          const int j = e / 32, l = e % 32, sh = rd16(b + 2);
          const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
          qq = KV_IQ4NL[l < 16 ? b[8 + 16 * j + l] & 15 : b[8 + 16 * j + l - 16] >> 4];
          s = (float)(h2d(rd16(b)) * (ls - 32));
          break;
        }
      }
      q[e0 + e] = qq;
      sc[e0 + e] = s;
      mn[e0 + e] = m;
    }
  }
}

/* the quantized activations of cf_quantize_act__scalar: element values d_a*q_a, and per 32
 * elements s_a (Q8_1) */
typedef struct { double *xq, *sa; } qacts;
static qacts parse_act(int vt, int64_t rows, int64_t K, const uint8_t *buf) {
  qacts a = {xmalloc(sizeof(double) * (size_t)(rows * K)), xmalloc(sizeof(double) * (size_t)(rows * K / 32 + 1))};
  const uint8_t *p = buf;
  for (int64_t r = 0; r < rows; r++) {
    if (vt == QA_Q8_K) {
      for (int64_t b = 0; b < K / 256; b++, p += QB_Q8_K) {
        float d;
        memcpy(&d, p, 4);
        for (int i = 0; i < 256; i++) a.xq[r * K + 256 * b + i] = (double)d * (int8_t)p[4 + i];
      }
    } else {
      const int off = vt == QA_Q8_1 ? 4 : 2;
      for (int64_t b = 0; b < K / 32; b++, p += off + 32) {
        const double d = h2d(rd16(p));
        for (int i = 0; i < 32; i++) a.xq[r * K + 32 * b + i] = d * (int8_t)p[off + i];
        a.sa[r * (K / 32) + b] = vt == QA_Q8_1 ? h2d(rd16(p + 2)) : 0.0;
      }
    }
  }
  return a;
}
static int64_t act_bytes(int vt, int64_t rows, int64_t K) {
  return rows * (vt == QA_Q8_K ? K / QK_Q8_K * QB_Q8_K : K / 32 * (vt == QA_Q8_1 ? QB_Q8_1 : QB_Q8_0));
}

/* double reference y[r*N + o] of one weight. act 0: sum_e f32-dequant(W)[o,e] * xr[e] (xr: the
 * rows as double, stride K). act 1 (quantized types): the block arithmetic on the activations
 * quantized by cf_quantize_act__scalar from xq (f32 rows, stride xs). l2 (may be NULL): per output
 * the sum over 32-element blocks of (block term)^2, the scale of rounding differences (below). */
static void reference(const tinfo *t, const uint8_t *w, int64_t N, int64_t K, int64_t rows,
                      const double *xr, const float *xq, int64_t xs, int act, double *y, double *l2) {
  int *q = xmalloc(sizeof(int) * (size_t)K);
  double *sc = xmalloc(sizeof(double) * (size_t)K), *mn = xmalloc(sizeof(double) * (size_t)K);
  const int q8 = act == 1 && t->vt != QA_F32;
  qacts a = {NULL, NULL};
  if (q8) {
    uint8_t *buf = xmalloc((size_t)act_bytes(t->vt, rows, K));
    if (cf_quantize_act__scalar(t->vt, rows, K, xq, xs, buf)) { printf("cf_quantize_act__scalar failed\n"); exit(1); }
    a = parse_act(t->vt, rows, K, buf);
    free(buf);
  }
  for (int64_t o = 0; o < N; o++) {
    decode_row(t, w + o * row_bytes(t, K), K, q, sc, mn);
    for (int64_t r = 0; r < rows; r++) {
      double s = 0.0, ss = 0.0;
      for (int64_t e0 = 0; e0 < K; e0 += 32) {
        const int64_t e1 = e0 + 32 < K ? e0 + 32 : K; /* float types: K need not be a multiple */
        double bs = 0.0;
        if (!q8) {
          for (int64_t e = e0; e < e1; e++) {
            const float v = (float)((float)(sc[e] * q[e]) + mn[e]);
            bs += (double)v * xr[r * K + e];
          }
        } else {
          const double *xa = a.xq + r * K;
          for (int64_t e = e0; e < e1; e++) bs += (sc[e] * q[e] + (t->vt == QA_Q8_K ? mn[e] : 0.0)) * xa[e];
          if (t->vt == QA_Q8_1) bs += mn[e0] * a.sa[r * (K / 32) + e0 / 32];
        }
        s += bs;
        ss += bs * bs;
      }
      y[r * N + o] = s;
      if (l2) l2[r * N + o] = ss;
    }
  }
  free(q); free(sc); free(mn); free(a.xq); free(a.sa);
}

static double nmse(const float *y, int64_t ys, const double *ref, int64_t rows, int64_t N) {
  double num = 0.0, den = 0.0;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t o = 0; o < N; o++) {
      const double d = (double)y[r * ys + o] - ref[r * N + o];
      num += d * d;
      den += ref[r * N + o] * ref[r * N + o];
    }
  if (num != num) return INFINITY;
  return den > 0.0 ? num / den : num;
}
/* neon vs scalar: sum (a - b)^2 / sum max(ref^2, l2). Both sum the same block terms in a
 * different f32 order (FMA or not), so their difference scales with the block terms, not with the
 * result: a single output that cancels to a small value would otherwise fail on rounding alone
 * (seen: y = -0.0126 from block terms of ~0.1, neon 2e-9 and scalar 4e-8 from the reference). For
 * outputs without cancellation ref^2 ~ l2, and this is the plain NMSE. */
static double nmse_rel(const float *a, const float *b, int64_t ys, const double *ref, const double *l2,
                       int64_t rows, int64_t N) {
  double num = 0.0, den = 0.0;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t o = 0; o < N; o++) {
      const double d = (double)a[r * ys + o] - (double)b[r * ys + o], y2 = ref[r * N + o] * ref[r * N + o];
      num += d * d;
      den += y2 > l2[r * N + o] ? y2 : l2[r * N + o];
    }
  if (num != num) return INFINITY;
  return den > 0.0 ? num / den : num;
}
static double nmse_ff(const float *a, const float *b, int64_t ys, int64_t rows, int64_t N) {
  double *ref = xmalloc(sizeof(double) * (size_t)(rows * N));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t o = 0; o < N; o++) ref[r * N + o] = b[r * ys + o];
  const double v = nmse(a, ys, ref, rows, N);
  free(ref);
  return v;
}
/* output rows are N wide in a stride of ys: everything else must still be GUARD */
static int64_t guard_damage(const float *y, int64_t rows, int64_t N, int64_t ys) {
  int64_t bad = 0;
  for (int64_t i = 0; i < rows * ys; i++)
    if (i % ys >= N && memcmp(&y[i], &GUARD, 4)) bad++;
  return bad;
}
static double upd(double *worst, double v) { if (v > *worst) *worst = v; return v; }

static void desc_init(int64_t *d, int64_t rows, int64_t K, int64_t xs, int act, int nw, int epi, int norm) {
  memset(d, 0, sizeof(int64_t) * QM_LEN);
  d[QM_ROWS] = rows; d[QM_K] = K; d[QM_XS] = xs; d[QM_ACT] = act;
  d[QM_NW] = nw; d[QM_EPI] = epi; d[QM_NORM] = norm;
}
static void desc_w(int64_t *d, int i, const tinfo *t, int64_t N, int64_t K, int64_t ys) {
  int64_t *p = d + QM_W0 + i * QW_LEN;
  p[QW_T] = t->id; p[QW_N] = N; p[QW_WS] = row_bytes(t, K); p[QW_YS] = ys;
}

static float *rand_x(int64_t rows, int64_t K, int64_t xs) {
  float *x = fbuf(rows * xs);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < K; k++) x[r * xs + k] = uni(-1.0f, 1.0f);
  return x;
}
static double *x_as_double(const float *x, int64_t rows, int64_t K, int64_t xs) {
  double *o = xmalloc(sizeof(double) * (size_t)(rows * K));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < K; k++) o[r * K + k] = x[r * xs + k];
  return o;
}

/* ---------------------------------------------------------------------------------------------
 * (a), (b): one weight, f32 and q8 mode */
static void test_single(const tinfo *t, int64_t K, int64_t N, int64_t rows, int subn) {
  const int64_t xs = K + (rows > 1 ? 5 : 0), ys = N + 1;
  float *x = rand_x(rows, K, xs);
  double *xd = x_as_double(x, rows, K, xs);
  uint8_t *w = gen_weights(t, N, K, subn);
  double *ref = xmalloc(sizeof(double) * (size_t)(rows * N)), *l2 = xmalloc(sizeof(double) * (size_t)(rows * N));
  float *yn = fbuf(rows * ys), *yc = fbuf(rows * ys), *yt = fbuf(rows * ys);
  int64_t d[QM_LEN];
  for (int act = 0; act < 2; act++) {
    begin("%s K=%lld N=%lld rows=%lld act=%s%s", t->name, (long long)K, (long long)N, (long long)rows,
          act ? "q8" : "f32", subn ? " subnormal-scales" : "");
    desc_init(d, rows, K, xs, act, 1, 0, 0);
    desc_w(d, 0, t, N, K, ys);
    for (int64_t i = 0; i < rows * ys; i++) yn[i] = yc[i] = yt[i] = GUARD;
    const int rn = cf_qmatmul_f32__neon(d, x, NULL, 0.0f, w, NULL, NULL, yn, NULL, NULL, NULL, 1);
    const int rc = cf_qmatmul_f32__scalar(d, x, NULL, 0.0f, w, NULL, NULL, yc, NULL, NULL, NULL, 1);
    CHECK(rn == 0 && rc == 0, "return codes neon %d scalar %d", rn, rc);
    reference(t, w, N, K, rows, xd, x, xs, act, ref, l2);
    double *wr = act && t->vt ? &w_q8ref : &w_f32ref;
    const double en = upd(wr, nmse(yn, ys, ref, rows, N)), ec = upd(wr, nmse(yc, ys, ref, rows, N));
    CHECK(en <= 1e-10, "neon vs double reference: NMSE %.3g", en);
    CHECK(ec <= 1e-10, "scalar vs double reference: NMSE %.3g", ec);
    if (act) {
      if (t->vt) digest(yn, rows, N, ys);
      const double e = upd(&w_q8ns, nmse_rel(yn, yc, ys, ref, l2, rows, N));
      CHECK(e <= 1e-12, "q8 neon vs scalar: NMSE (block-term scaled) %.3g, plain NMSE %.3g", e,
            nmse_ff(yn, yc, ys, rows, N));
    }
    CHECK(guard_damage(yn, rows, N, ys) == 0, "neon wrote past an output row");
    CHECK(guard_damage(yc, rows, N, ys) == 0, "scalar wrote past an output row");
    if (rows >= 5) { /* chunks do not depend on the thread count: bit-identical */
      const int rt = cf_qmatmul_f32__neon(d, x, NULL, 0.0f, w, NULL, NULL, yt, NULL, NULL, NULL, 3);
      CHECK(rt == 0 && memcmp(yt, yn, sizeof(float) * (size_t)(rows * ys)) == 0,
            "neon with 3 threads differs from 1 thread");
    }
    end();
  }
  free(x); free(xd); free(w); free(ref); free(l2); free(yn); free(yc); free(yt);
}

/* (c) swiglu epilogue: y0 = silu(x.W0^T) * (x.W1^T) */
static void test_swiglu(const tinfo *t, int64_t K, int64_t N, int64_t rows) {
  const int64_t xs = K + 3, ys = N + 2;
  float *x = rand_x(rows, K, xs);
  double *xd = x_as_double(x, rows, K, xs);
  uint8_t *wg = gen_weights(t, N, K, 0), *wu = gen_weights(t, N, K, 0);
  double *rg = xmalloc(sizeof(double) * (size_t)(rows * N)), *ru = xmalloc(sizeof(double) * (size_t)(rows * N));
  float *yn = fbuf(rows * ys), *yc = fbuf(rows * ys), *yt = fbuf(rows * ys);
  int64_t d[QM_LEN];
  for (int act = 0; act < 2; act++) {
    begin("swiglu %s K=%lld N=%lld rows=%lld act=%s", t->name, (long long)K, (long long)N, (long long)rows,
          act ? "q8" : "f32");
    desc_init(d, rows, K, xs, act, 2, 1, 0);
    desc_w(d, 0, t, N, K, ys);
    desc_w(d, 1, t, N, K, ys);
    for (int64_t i = 0; i < rows * ys; i++) yn[i] = yc[i] = yt[i] = GUARD;
    const int rn = cf_qmatmul_f32__neon(d, x, NULL, 0.0f, wg, wu, NULL, yn, NULL, NULL, NULL, 1);
    const int rc = cf_qmatmul_f32__scalar(d, x, NULL, 0.0f, wg, wu, NULL, yc, NULL, NULL, NULL, 1);
    CHECK(rn == 0 && rc == 0, "return codes neon %d scalar %d", rn, rc);
    reference(t, wg, N, K, rows, xd, x, xs, act, rg, NULL);
    reference(t, wu, N, K, rows, xd, x, xs, act, ru, NULL);
    for (int64_t i = 0; i < rows * N; i++) rg[i] = rg[i] / (1.0 + exp(-rg[i])) * ru[i];
    const double en = upd(&w_epi, nmse(yn, ys, rg, rows, N)), ec = upd(&w_epi, nmse(yc, ys, rg, rows, N));
    CHECK(en <= 1e-10, "neon vs double reference: NMSE %.3g", en);
    CHECK(ec <= 1e-10, "scalar vs double reference: NMSE %.3g", ec);
    const double e = nmse_ff(yn, yc, ys, rows, N);
    if (act) upd(&w_q8ns, e);
    if (act && t->vt) digest(yn, rows, N, ys);
    CHECK(e <= (act ? 1e-12 : 1e-10), "neon vs scalar: NMSE %.3g", e);
    CHECK(guard_damage(yn, rows, N, ys) == 0, "neon wrote past an output row");
    if (rows >= 5) {
      const int rt = cf_qmatmul_f32__neon(d, x, NULL, 0.0f, wg, wu, NULL, yt, NULL, NULL, NULL, 4);
      CHECK(rt == 0 && memcmp(yt, yn, sizeof(float) * (size_t)(rows * ys)) == 0,
            "neon with 4 threads differs from 1 thread");
    }
    end();
  }
  free(x); free(xd); free(wg); free(wu); free(rg); free(ru); free(yn); free(yc); free(yt);
}

/* (c) RMS-norm prologue: fused == rms_norm_rows then matmul, bit for bit, per ISA; neon vs
 * scalar and the double reference in f32 mode; in q8 mode neon against scalar on the same
 * normalized rows (the two ISAs' norms may differ in the last bit, which can move a code) */
static void test_norm(const tinfo *t, int64_t K, int64_t N, int64_t rows, int with_w) {
  const int64_t xs = K + 7, ys = N;
  const float eps = 1e-5f;
  float *x = rand_x(rows, K, xs), *xc = fbuf(rows * K), *nw = NULL;
  for (int64_t r = 0; r < rows; r++) memcpy(xc + r * K, x + r * xs, sizeof(float) * (size_t)K);
  if (with_w) {
    nw = fbuf(K);
    for (int64_t k = 0; k < K; k++) nw[k] = uni(0.5f, 1.5f);
  }
  uint8_t *w = gen_weights(t, N, K, 0);
  float *xn_n = fbuf(rows * K), *xn_c = fbuf(rows * K);
  float *yn = fbuf(rows * ys), *yc = fbuf(rows * ys), *un = fbuf(rows * ys), *uc = fbuf(rows * ys);
  double *xd = xmalloc(sizeof(double) * (size_t)(rows * K)), *ref = xmalloc(sizeof(double) * (size_t)(rows * N));
  for (int64_t r = 0; r < rows; r++) { /* rms_norm in double */
    double ss = 0.0;
    for (int64_t k = 0; k < K; k++) ss += (double)x[r * xs + k] * x[r * xs + k];
    const double s = 1.0 / sqrt(ss / (double)K + (double)eps);
    for (int64_t k = 0; k < K; k++) xd[r * K + k] = x[r * xs + k] * s * (nw ? nw[k] : 1.0);
  }
  const int r1 = cf_rms_norm_rows_f32__neon(rows, K, xc, nw, eps, xn_n, 1);
  const int r2 = cf_rms_norm_rows_f32__scalar(rows, K, xc, nw, eps, xn_c, 1);
  int64_t d[QM_LEN], du[QM_LEN];
  for (int act = 0; act < 2; act++) {
    begin("norm%s %s K=%lld N=%lld rows=%lld act=%s", with_w ? "*w" : "", t->name, (long long)K, (long long)N,
          (long long)rows, act ? "q8" : "f32");
    CHECK(r1 == 0 && r2 == 0, "rms_norm_rows return codes %d %d", r1, r2);
    desc_init(d, rows, K, xs, act, 1, 0, 1);
    desc_w(d, 0, t, N, K, ys);
    desc_init(du, rows, K, K, act, 1, 0, 0);
    desc_w(du, 0, t, N, K, ys);
    int rc = cf_qmatmul_f32__neon(d, x, nw, eps, w, NULL, NULL, yn, NULL, NULL, NULL, 1);
    rc |= cf_qmatmul_f32__scalar(d, x, nw, eps, w, NULL, NULL, yc, NULL, NULL, NULL, 1);
    rc |= cf_qmatmul_f32__neon(du, xn_n, NULL, 0.0f, w, NULL, NULL, un, NULL, NULL, NULL, 1);
    CHECK(rc == 0, "a call failed");
    CHECK(memcmp(yn, un, sizeof(float) * (size_t)(rows * ys)) == 0, "neon: fused norm != rms_norm_rows + matmul");
    rc = cf_qmatmul_f32__scalar(du, xn_c, NULL, 0.0f, w, NULL, NULL, uc, NULL, NULL, NULL, 1);
    CHECK(rc == 0 && memcmp(yc, uc, sizeof(float) * (size_t)(rows * ys)) == 0,
          "scalar: fused norm != rms_norm_rows + matmul");
    if (!act || t->vt == QA_F32) {
      reference(t, w, N, K, rows, xd, NULL, 0, 0, ref, NULL);
      const double en = upd(&w_epi, nmse(yn, ys, ref, rows, N)), ec = upd(&w_epi, nmse(yc, ys, ref, rows, N));
      CHECK(en <= 1e-10, "neon vs double reference: NMSE %.3g", en);
      CHECK(ec <= 1e-10, "scalar vs double reference: NMSE %.3g", ec);
    } else {
      /* scalar matmul on the neon-normalized rows: the same codes as the fused neon call */
      rc = cf_qmatmul_f32__scalar(du, xn_n, NULL, 0.0f, w, NULL, NULL, uc, NULL, NULL, NULL, 1);
      const double e = upd(&w_q8ns, nmse_ff(yn, uc, ys, rows, N));
      CHECK(rc == 0 && e <= 1e-12, "q8 fused neon vs scalar on the same normalized rows: NMSE %.3g", e);
      double *xnd = x_as_double(xn_n, rows, K, K);
      reference(t, w, N, K, rows, xnd, xn_n, K, 1, ref, NULL);
      const double en = upd(&w_q8ref, nmse(yn, ys, ref, rows, N));
      CHECK(en <= 1e-10, "neon vs double block reference: NMSE %.3g", en);
      free(xnd);
    }
    end();
  }
  free(x); free(xc); free(nw); free(w); free(xn_n); free(xn_c); free(yn); free(yc); free(un); free(uc);
  free(xd); free(ref);
}

/* three weights in one call (QKV-like), different types and widths */
static void test_multi(const tinfo *t0, const tinfo *t1, const tinfo *t2, int64_t K, int64_t rows) {
  const tinfo *ts[3] = {t0, t1, t2};
  const int64_t Ns[3] = {33, 7, 17}, xs = K;
  float *x = rand_x(rows, K, xs);
  double *xd = x_as_double(x, rows, K, xs);
  uint8_t *w[3];
  float *yn[3], *yc[3];
  for (int i = 0; i < 3; i++) {
    w[i] = gen_weights(ts[i], Ns[i], K, 0);
    yn[i] = fbuf(rows * Ns[i]);
    yc[i] = fbuf(rows * Ns[i]);
  }
  double *ref = xmalloc(sizeof(double) * (size_t)(rows * 33));
  int64_t d[QM_LEN];
  for (int act = 0; act < 2; act++) {
    begin("multi %s+%s+%s K=%lld rows=%lld act=%s", t0->name, t1->name, t2->name, (long long)K, (long long)rows,
          act ? "q8" : "f32");
    desc_init(d, rows, K, xs, act, 3, 0, 0);
    for (int i = 0; i < 3; i++) desc_w(d, i, ts[i], Ns[i], K, Ns[i]);
    int rc = cf_qmatmul_f32__neon(d, x, NULL, 0.0f, w[0], w[1], w[2], yn[0], yn[1], yn[2], NULL, 2);
    rc |= cf_qmatmul_f32__scalar(d, x, NULL, 0.0f, w[0], w[1], w[2], yc[0], yc[1], yc[2], NULL, 1);
    CHECK(rc == 0, "a call failed");
    for (int i = 0; i < 3; i++) {
      reference(ts[i], w[i], Ns[i], K, rows, xd, x, xs, act, ref, NULL);
      const double en = nmse(yn[i], Ns[i], ref, rows, Ns[i]);
      CHECK(en <= 1e-10, "weight %d: neon vs double reference: NMSE %.3g", i, en);
      const double e = nmse_ff(yn[i], yc[i], Ns[i], rows, Ns[i]);
      CHECK(e <= (act ? 1e-12 : 1e-10), "weight %d: neon vs scalar: NMSE %.3g", i, e);
    }
    end();
  }
  for (int i = 0; i < 3; i++) { free(w[i]); free(yn[i]); free(yc[i]); }
  free(x); free(xd); free(ref);
}

/* ---------------------------------------------------------------------------------------------
 * (e) P16 panels (native/src/repack.c) and batch invariance */
/* one call of weight w (layout lay: 0 GGUF rows, 1 P16 panels) on rows [r0, r0 + rows) of x */
static int call1(const tinfo *t, int lay, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t xs,
                 int64_t r0, int64_t rows, int act, float *y, int64_t ys, int nth) {
  int64_t d[QM_LEN];
  desc_init(d, rows, K, xs, act, 1, 0, 0);
  desc_w(d, 0, t, N, K, ys);
  d[QM_W0 + QW_LAY] = lay;
  return cf_qmatmul_f32__neon(d, x + r0 * xs, NULL, 0.0f, w, NULL, NULL, y, NULL, NULL, NULL, nth);
}
/* weights repacked in C (cf_repack_p16, QW_LAY = 1) == GGUF layout, bit for bit, in q8 and f32
 * mode and in the swiglu epilogue; every row alone == the same row inside batches of 3, 5, 6, 7, 8 and 17
 * rows (so in P16_MR-row tiles at different positions, in the small-row tiles and in one-row tiles), either layout, 1 or
 * 3 threads; q8 results against the double block reference */
static void test_p16(const tinfo *t, int64_t K, int64_t N) {
  const int64_t R = 17, xs = K + 3, ys = N + 1, rb = row_bytes(t, K), np = (N + 15) / 16;
  float *x = rand_x(R, K, xs);
  double *xd = x_as_double(x, R, K, xs);
  uint8_t *w[2], *u[2];
  w[0] = gen_weights(t, N, K, 0);
  u[0] = gen_weights(t, N, K, 0);
  const int64_t pb = cf_p16_bytes(t->id, N, K);
  w[1] = xmalloc((size_t)(pb > 0 ? pb : 1));
  u[1] = xmalloc((size_t)(pb > 0 ? pb : 1));
  const int rr = cf_repack_p16(t->id, N, K, w[0], rb, w[1], 0, np) | cf_repack_p16(t->id, N, K, u[0], rb, u[1], 0, np);
  float *y[2][2], *yb = fbuf(R * ys), *yt = fbuf(R * ys);
  for (int a = 0; a < 2; a++)
    for (int l = 0; l < 2; l++) y[a][l] = fbuf(R * ys);
  double *ref = xmalloc(sizeof(double) * (size_t)(R * N));
  begin("p16 %s K=%lld N=%lld: repacked == GGUF layout, batch invariance", t->name, (long long)K, (long long)N);
  CHECK(pb == 16 * np * rb && rr == 0, "cf_p16_bytes %lld (want %lld), cf_repack_p16 %d", (long long)pb,
        (long long)(16 * np * rb), rr);
  for (int act = 0; act < 2; act++) {
    for (int l = 0; l < 2; l++)
      CHECK(call1(t, l, w[l], N, K, x, xs, 0, R, act, y[act][l], ys, 1) == 0, "call failed (act %d, layout %d)", act, l);
    CHECK(memcmp(y[act][0], y[act][1], sizeof(float) * (size_t)(R * ys)) == 0,
          "%s mode: P16 layout differs from the GGUF layout", act ? "q8" : "f32");
  }
  /* first row, rows: P16_MR-row tiles, and the small-row tiles of what is left (7 = 4 + 2 + 1, 6 = 4 + 2, 5, 3) */
  static const int64_t B[][2] = {{0, 8}, {5, 8}, {9, 8}, {0, 3}, {14, 3}, {7, 3}, {1, 7}, {10, 7}, {4, 6}, {12, 5}};
  for (int l = 0; l < 2; l++) {
    for (int b = 0; b < (int)(sizeof B / sizeof B[0]); b++) {
      const int64_t r0 = B[b][0], n = B[b][1];
      const int rc = call1(t, l, w[l], N, K, x, xs, r0, n, 1, yb, ys, 1);
      CHECK(rc == 0 && memcmp(yb, y[1][l] + r0 * ys, sizeof(float) * (size_t)(n * ys)) == 0,
            "layout %d: rows %lld..%lld as a batch of %lld differ from the batch of 17", l, (long long)r0,
            (long long)(r0 + n - 1), (long long)n);
    }
    int64_t bad = -1;
    for (int64_t r = 0; r < R && bad < 0; r++)
      if (call1(t, l, w[l], N, K, x, xs, r, 1, 1, yb, ys, 1) || memcmp(yb, y[1][l] + r * ys, sizeof(float) * (size_t)N))
        bad = r;
    CHECK(bad < 0, "layout %d: row %lld alone differs from the batch of 17", l, (long long)bad);
    CHECK(call1(t, l, w[l], N, K, x, xs, 0, R, 1, yt, ys, 3) == 0 &&
              memcmp(yt, y[1][l], sizeof(float) * (size_t)(R * ys)) == 0,
          "layout %d: 3 threads differ from 1", l);
  }
  reference(t, w[0], N, K, R, xd, x, xs, 1, ref, NULL);
  const double e = upd(&w_q8ref, nmse(y[1][1], ys, ref, R, N));
  CHECK(e <= 1e-10, "P16 q8 vs double block reference: NMSE %.3g", e);
  CHECK(guard_damage(y[1][1], R, N, ys) == 0, "wrote past an output row");
  int64_t d[QM_LEN];
  for (int l = 0; l < 2; l++) { /* swiglu: gate and up weights both in layout l */
    desc_init(d, R, K, xs, 1, 2, 1, 0);
    desc_w(d, 0, t, N, K, ys);
    desc_w(d, 1, t, N, K, ys);
    d[QM_W0 + QW_LAY] = d[QM_W0 + QW_LEN + QW_LAY] = l;
    CHECK(cf_qmatmul_f32__neon(d, x, NULL, 0.0f, w[l], u[l], NULL, l ? yt : yb, NULL, NULL, NULL, 2) == 0, "swiglu call failed");
  }
  CHECK(memcmp(yb, yt, sizeof(float) * (size_t)(R * ys)) == 0, "swiglu: P16 layout differs from the GGUF layout");
  digest(y[1][1], R, N, ys);
  digest(yt, R, N, ys);
  end();
  for (int l = 0; l < 2; l++) { free(w[l]); free(u[l]); }
  for (int a = 0; a < 2; a++)
    for (int l = 0; l < 2; l++) free(y[a][l]);
  free(x); free(xd); free(yb); free(yt); free(ref);
}

/* (d) activation quantization, neon == scalar byte for byte */
static void test_quantize_act(int vt, int64_t K, int64_t rows) {
  const int64_t xs = K + 3;
  float *x = rand_x(rows, K, xs);
  /* special blocks in the last row: all zero, constant, a +-max tie, large and tiny values */
  float *xl = x + (rows - 1) * xs;
  for (int k = 0; k < 32; k++) xl[k] = 0.0f;
  if (K >= 256) {
    for (int k = 0; k < 256; k++) xl[k] = 0.0f; /* a whole zero super-block */
    if (K >= 512) {
      for (int k = 256; k < 288; k++) xl[k] = 0.375f;
      xl[300] = 2.5f, xl[301] = -2.5f; /* tie: the first (positive) wins in Q8_K */
    }
  }
  if (K >= 768) {
    for (int k = 512; k < 544; k++) xl[k] = uni(-1e6f, 1e6f);
    for (int k = 544; k < 576; k++) xl[k] = uni(-1e-30f, 1e-30f);
    xl[600] = -7.0f; /* a negative maximum */
  }
  const int64_t nb = act_bytes(vt, rows, K);
  uint8_t *bn = xmalloc((size_t)nb + 16), *bc = xmalloc((size_t)nb + 16);
  memset(bn, 0xA5, (size_t)nb + 16);
  memset(bc, 0xA5, (size_t)nb + 16);
  begin("quantize_act vtype=%d K=%lld rows=%lld", vt, (long long)K, (long long)rows);
  const int rn = cf_quantize_act__neon(vt, rows, K, x, xs, bn);
  const int rc = cf_quantize_act__scalar(vt, rows, K, x, xs, bc);
  CHECK(rn == 0 && rc == 0, "return codes %d %d", rn, rc);
  int64_t first = -1;
  for (int64_t i = 0; i < nb + 16 && first < 0; i++)
    if (bn[i] != bc[i]) first = i;
  CHECK(first < 0, "neon and scalar bytes differ first at byte %lld of %lld", (long long)first, (long long)nb);
  CHECK(bn[nb] == 0xA5 && bn[nb + 15] == 0xA5, "neon wrote past the output");
  end();
  free(x); free(bn); free(bc);
}

int main(int argc, char **argv) {
  g_rng = 0x243f6a8885a308d3ull;
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *label = argc > 1 ? argv[1] : "neon";
  printf("neon quant [%s] build: %s\n", label, cf_build_info__neon());
#if defined(__ARM_FEATURE_MATMUL_INT8)
  printf("neon quant [%s]: this build has i8mm (panel tiles: smmla on row pairs, usdot/sdot for one row)\n", label);
#elif defined(__ARM_FEATURE_DOTPROD)
  printf("neon quant [%s]: this build has the dot-product extension (panel tiles: sdot)\n", label);
#else
  printf("neon quant [%s]: this build has neither dotprod nor i8mm (int8 dots: smull)\n", label);
#endif
  static const int64_t Ns[] = {1, 7, 33}, Rs[] = {1, 3, 5, 17};
  for (int ti = 0; ti < NTYPES; ti++) {
    const tinfo *t = &TYPES[ti];
    const int64_t base = t->blk == 256 ? 256 : 32;
    const int64_t Ks[] = {base, 2 * base, 3 * base, 1536};
    for (int ki = 0; ki < 4; ki++)
      for (int ni = 0; ni < 3; ni++)
        for (int ri = 0; ri < 4; ri++) test_single(t, Ks[ki], Ns[ni], Rs[ri], 0);
    if (t->blk == 1) { /* float weights: K not a multiple of 16 (the tail loop) */
      test_single(t, 37, 7, 3, 0);
      test_single(t, 13, 5, 5, 0);
    } else {
      test_single(t, 2 * base, 7, 5, 1); /* subnormal f16 scales */
    }
    test_swiglu(t, 2 * base, 7, 1);
    test_swiglu(t, 512, 33, 5);
    test_norm(t, 512, 7, 1, 1);
    test_norm(t, 1536, 33, 5, 1);
    test_norm(t, 512, 9, 3, 0);
    if (t->blk > 1) {
      test_p16(t, 2 * base, 33);
      test_p16(t, t->blk == 256 ? 1536 : 1024, 16);
    }
  }
  test_multi(&TYPES[8], &TYPES[10], &TYPES[7], 512, 5);  /* Q4_K + Q6_K + Q8_0 */
  test_multi(&TYPES[4], &TYPES[3], &TYPES[1], 256, 3);   /* Q4_1 + Q4_0 + F16 */
  test_multi(&TYPES[9], &TYPES[6], &TYPES[2], 1536, 17); /* Q5_K + Q5_1 + BF16 */
  static const int vts[] = {8, 9, 15};
  static const int64_t qK[] = {256, 512, 1536}, qR[] = {1, 3};
  for (int v = 0; v < 3; v++)
    for (int k = 0; k < 3; k++)
      for (int r = 0; r < 2; r++) test_quantize_act(vts[v], qK[k], qR[r]);
  test_quantize_act(8, 32, 2);
  test_quantize_act(9, 96, 2);
  printf("neon quant [%s]: worst NMSE f32 vs ref %.3g, q8 vs block ref %.3g, q8 neon vs scalar %.3g (single weight: block-term scaled), "
         "swiglu/norm vs ref %.3g\n", label, w_f32ref, w_q8ref, w_q8ns, w_epi);
  printf("neon quant [%s]: q8 digest %016llx\n", label, (unsigned long long)g_digest);
  printf("neon quant [%s]: %d passed, %d failed\n", label, g_pass, g_fail);
  return g_fail ? 1 : 0;
}
