/* Scalar "vector" helpers (width 1) for the generic kernel bodies. This translation unit is
 * compiled with -fno-tree-vectorize -fno-tree-slp-vectorize -ffp-contract=off, so it is a real
 * scalar baseline: one element per instruction, no FMA contraction. */
#ifndef CF_SIMD_SCALAR_H
#define CF_SIMD_SCALAR_H
#include <stdint.h>
#include <string.h>
#include "../kernels/common.h"

typedef float vf;
#define VW 1
#define CF_VREGS 16 /* vector registers: sizes the flash-attention register tiles */

static inline vf vf_set1(float a) { return a; }
static inline vf vf_zero(void) { return 0.0f; }
static inline vf vf_load(const float *p) { return *p; }
static inline vf vf_loadn(const float *p, int64_t n, float fill) { (void)p; (void)n; return fill; }
static inline void vf_store(float *p, vf v) { *p = v; }
static inline void vf_storen(float *p, vf v, int64_t n) { (void)p; (void)v; (void)n; }
static inline vf vf_load_h(const uint16_t *p) { return cf_h2f(*p); }
static inline vf vf_loadn_h(const uint16_t *p, int64_t n, float fill) { (void)p; (void)n; return fill; }
#define VALIGN 0 /* no streaming stores: plain stores */
static inline void vf_stream(float *p, vf v) { *p = v; }
static inline void vf_stream_fence(void) {}
/* f32 -> f16, round to nearest even, in integer arithmetic (rope's cache write). NaN stays a quiet
 * NaN with the top payload bits; |f| >= 65520 is inf; subnormal halves are rounded exactly.
 * (No vf_dup_even/odd: with one lane the bodies take interleaved pairs two scalars at a time.) */
static inline void vf_store_h(uint16_t *p, vf v) { *p = cf_f2h(v); }
static inline void vf_storen_h(uint16_t *p, vf v, int64_t n) { (void)p; (void)v; (void)n; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; } /* two roundings: contraction is off */
static inline vf vf_div(vf a, vf b) { return a / b; }
static inline vf vf_copysign(vf m, vf s) { return __builtin_copysignf(m, s); }
static inline vf vf_where_eq(vf x, vf c, vf a, vf b) { return x == c ? a : b; }
static inline vf vf_max(vf a, vf b) { return a > b ? a : b; }  /* b wins on NaN, like maxps */
static inline vf vf_max_nan(vf a, vf b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
static inline uint32_t vf_bits_not_ninf(vf v) { return v != -__builtin_inff(); }
/* bitwise or of the two floats' bit patterns; vf_any_nonzero: some lane is not +-0 (NaN counts) */
static inline vf vf_or(vf a, vf b) {
  union { float f; uint32_t u; } x = {a}, y = {b};
  x.u |= y.u;
  return x.f;
}
static inline int vf_any_nonzero(vf v) { return v != 0.0f; }
#define CF_HAVE_T8 0 /* the packing loop transposes element by element */
static inline void vf_hsum4(vf a, vf b, vf c, vf d, float *out) {
  out[0] = a; out[1] = b; out[2] = c; out[3] = d;
}
static inline float vf_hsum(vf v) { return v; }
static inline float vf_hmax(vf v) { return v; }
/* exp (docs/semantics.md §6): the SIMD ISAs' reduction and degree-5 polynomial (common.h); 2^n as two exact
 * power-of-two factors, so subnormal results round once. */
static inline vf vf_exp(vf x) {
  if (x != x) return x;
  if (x < -103.972f) return 0.0f;
  if (x > 88.7228f) return __builtin_inff();
  const float magic = 12582912.0f;
  float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * CF_LN2_HI;
  r = r - n * CF_LN2_LO;
  float q = CF_EXP_C5;
  q = q * r + CF_EXP_C4;
  q = q * r + CF_EXP_C3;
  q = q * r + CF_EXP_C2;
  float p = q * (r * r) + (r + 1.0f);
  int32_t ni = (int32_t)n, k1 = ni >> 1, k2 = ni - k1;
  uint32_t b1 = (uint32_t)(k1 + 127) << 23, b2 = (uint32_t)(k2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &b1, sizeof s1);
  memcpy(&s2, &b2, sizeof s2);
  return (p * s1) * s2;
}
/* exp of an argument <= 0 (softmax, attention): the same function here */
static inline vf vf_exp_le0(vf x) { return vf_exp(x); }

/* float64 "vectors" (width 1) for rope's accurate angle table (native/kernels/rope.inc): the
 * same mul/add sequence as the SIMD ISAs (no FMA anywhere), so the table is the same on every
 * ISA. vd_quadrant: t holds n + 1.5*2^52 (n the quadrant index, low mantissa bits = n mod 4);
 * from sin r, cos r it gives sin and cos of r + n*pi/2. vd_store_cs: round to f32, store C, S,
 * -S; vd_store_cs_il: the interleaved pair tables (C, S) and (-S, C). */
typedef double vd;
#define VDW 1
static inline vd vd_set1(double a) { return a; }
static inline vd vd_load(const double *p) { return *p; }
static inline void vd_store(double *p, vd v) { *p = v; }
static inline vd vd_add(vd a, vd b) { return a + b; }
static inline vd vd_sub(vd a, vd b) { return a - b; }
static inline vd vd_mul(vd a, vd b) { return a * b; }
static inline int vd_all_abs_le(vd v, double lim) { return __builtin_fabs(v) <= lim; }
static inline void vd_quadrant(vd t, vd s, vd c, vd *so, vd *co) {
  uint64_t b;
  memcpy(&b, &t, sizeof b);
  const vd s1 = (b & 1) ? c : s, c1 = (b & 1) ? s : c;
  *so = (b & 2) ? -s1 : s1;
  *co = ((b + 1) & 2) ? -c1 : c1;
}
static inline void vd_store_cs(float *C, float *S, float *N, vd c, vd s) {
  const float cf = (float)c, sf = (float)s;
  *C = cf, *S = sf, *N = -sf;
}
static inline void vd_store_cs_il(float *T1, float *T2, vd c, vd s) {
  const float cf = (float)c, sf = (float)s;
  T1[0] = cf, T1[1] = sf, T2[0] = -sf, T2[1] = cf;
}

static inline vf vf_load_reg(const float *p) { return *p; } /* rope's x loads */
#endif
