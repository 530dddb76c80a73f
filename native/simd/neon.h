/* NEON (aarch64 Advanced SIMD) vector helpers for the generic kernel bodies. f16 is widened with
 * vcvt_f32_f16 (exact); tails go through a small stack buffer, never past the row. */
#ifndef CF_SIMD_NEON_H
#define CF_SIMD_NEON_H
#if !defined(__ARM_NEON) || !defined(__aarch64__)
#error "neon.h is for aarch64 builds with Advanced SIMD"
#endif
#include <arm_neon.h>
#include <stdint.h>
#include <string.h>
#include "../kernels/common.h"

typedef float32x4_t vf;
#define VW 4
#define CF_VREGS 32 /* vector registers: sizes the flash-attention register tiles */

static inline vf vf_set1(float a) { return vdupq_n_f32(a); }
static inline vf vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline vf vf_loadn(const float *p, int64_t n, float fill) {
  float buf[VW] = {fill, fill, fill, fill};
  memcpy(buf, p, (size_t)n * sizeof(float));
  return vld1q_f32(buf);
}
static inline void vf_store(float *p, vf v) { vst1q_f32(p, v); }
static inline void vf_storen(float *p, vf v, int64_t n) {
  float buf[VW];
  vst1q_f32(buf, v);
  memcpy(p, buf, (size_t)n * sizeof(float));
}
static inline vf vf_load_h(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline vf vf_loadn_h(const uint16_t *p, int64_t n, float fill) {
  uint16_t buf[VW] = {0};
  memcpy(buf, p, (size_t)n * sizeof(uint16_t));
  vf v = vf_load_h(buf);
  const uint32_t iota[VW] = {0, 1, 2, 3};
  uint32x4_t m = vcltq_u32(vld1q_u32(iota), vdupq_n_u32((uint32_t)n));
  return vbslq_f32(m, v, vdupq_n_f32(fill));
}
#define VALIGN 0 /* no streaming stores: plain stores */
static inline void vf_stream(float *p, vf v) { vst1q_f32(p, v); }
static inline void vf_stream_fence(void) {}
/* f32 -> f16 stores, round to nearest even (FPCR default; rope's cache write); pair duplication for
 * interleaved (x[2k], x[2k+1]) pairs: dup_even = (v0, v0, v2, v2), dup_odd = (v1, v1, v3, v3) */
static inline void vf_store_h(uint16_t *p, vf v) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
static inline void vf_storen_h(uint16_t *p, vf v, int64_t n) {
  uint16_t buf[VW];
  vf_store_h(buf, v);
  memcpy(p, buf, (size_t)n * sizeof(uint16_t));
}
static inline vf vf_dup_even(vf v) { return vtrn1q_f32(v, v); }
static inline vf vf_dup_odd(vf v) { return vtrn2q_f32(v, v); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vf_copysign(vf m, vf s) {
  const uint32x4_t sign = vdupq_n_u32(0x80000000u);
  return vbslq_f32(sign, s, m);
}
static inline vf vf_where_eq(vf x, vf c, vf a, vf b) { return vbslq_f32(vceqq_f32(x, c), a, b); }
static inline vf vf_max(vf a, vf b) { return vmaxq_f32(a, b); } /* NaN-propagating */
static inline vf vf_max_nan(vf a, vf b) { return vmaxq_f32(a, b); } /* already NaN-propagating */
static inline uint32_t vf_bits_not_ninf(vf v) {
  const uint32x4_t ne = vmvnq_u32(vceqq_f32(v, vdupq_n_f32(-__builtin_inff())));
  const uint32_t w[VW] = {1, 2, 4, 8};
  return vaddvq_u32(vandq_u32(ne, vld1q_u32(w)));
}
/* bitwise or; vf_any_nonzero: some lane is not +-0 (NaN counts) */
static inline vf vf_or(vf a, vf b) { return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(a), vreinterpretq_u32_f32(b))); }
static inline int vf_any_nonzero(vf v) { return vminvq_u32(vceqq_f32(v, vdupq_n_f32(0.0f))) == 0; }
#define CF_HAVE_T8 0 /* the packing loop transposes element by element */
static inline void vf_hsum4(vf a, vf b, vf c, vf d, float *out) {
  vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)));
}
static inline float vf_hsum(vf v) { return vaddvq_f32(v); }
static inline float vf_hmax(vf v) { return vmaxvq_f32(v); }     /* NaN-propagating */
/* exp (docs/semantics.md §6): the x86 reduction and degree-5 polynomial (common.h), round-to-nearest n by
 * vrndnq; 2^n as two exact factors (no slow path); below -103.97 (and -inf) 0, above 88.72 +inf. */
static inline vf vf_exp(vf x) {
  vf xc = vminq_f32(vdupq_n_f32(88.75f), vmaxq_f32(vdupq_n_f32(-104.0f), x));
  vf n = vrndnq_f32(vmulq_f32(xc, vdupq_n_f32(1.44269504088896341f)));
  vf r = vfmsq_f32(xc, n, vdupq_n_f32(CF_LN2_HI));
  r = vfmsq_f32(r, n, vdupq_n_f32(CF_LN2_LO));
  vf q = vfmaq_f32(vdupq_n_f32(CF_EXP_C4), vdupq_n_f32(CF_EXP_C5), r);
  q = vfmaq_f32(vdupq_n_f32(CF_EXP_C3), q, r);
  q = vfmaq_f32(vdupq_n_f32(CF_EXP_C2), q, r);
  vf p = vaddq_f32(vfmaq_f32(r, q, vmulq_f32(r, r)), vdupq_n_f32(1.0f)); /* 1 + (e^r - 1) */
  int32x4_t ni = vcvtq_s32_f32(n);
  int32x4_t k1 = vshrq_n_s32(ni, 1), k2 = vsubq_s32(ni, k1);
  int32x4_t bias = vdupq_n_s32(127);
  vf s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, bias), 23));
  vf s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, bias), 23));
  vf y = vmulq_f32(vmulq_f32(p, s1), s2);
  y = vbslq_f32(vcltq_f32(x, vdupq_n_f32(-103.972f)), vdupq_n_f32(0.0f), y);
  y = vbslq_f32(vcgtq_f32(x, vdupq_n_f32(88.7228f)), vdupq_n_f32(__builtin_inff()), y);
  /* NaN x: the float path already carries NaN through p (comparisons are false) */
  return y;
}
/* exp of an argument <= 0 (softmax, attention): the same function here */
static inline vf vf_exp_le0(vf x) { return vf_exp(x); }

/* float64 vectors for rope's accurate angle table (native/kernels/rope.inc): plain mul/add, no
 * FMA, so the table is the same on every ISA. vd_quadrant: t holds n + 1.5*2^52 (n the quadrant
 * index, low bits of the mantissa = n mod 4); from sin r, cos r it gives sin and cos of
 * r + n*pi/2. vd_store_cs: round to f32 and store C, S and -S; vd_store_cs_il: the interleaved
 * pair tables (C0, S0, C1, S1, ...) and (-S0, C0, -S1, C1, ...) of 2*VDW floats each. */
typedef float64x2_t vd;
#define VDW 2
static inline vd vd_set1(double a) { return vdupq_n_f64(a); }
static inline vd vd_load(const double *p) { return vld1q_f64(p); }
static inline void vd_store(double *p, vd v) { vst1q_f64(p, v); }
static inline vd vd_add(vd a, vd b) { return vaddq_f64(a, b); }
static inline vd vd_sub(vd a, vd b) { return vsubq_f64(a, b); }
static inline vd vd_mul(vd a, vd b) { return vmulq_f64(a, b); }
static inline int vd_all_abs_le(vd v, double lim) {
  const uint64x2_t m = vcleq_f64(vabsq_f64(v), vdupq_n_f64(lim));
  return (vgetq_lane_u64(m, 0) & vgetq_lane_u64(m, 1)) != 0;
}
static inline void vd_quadrant(vd t, vd s, vd c, vd *so, vd *co) {
  const uint64x2_t b = vreinterpretq_u64_f64(t), two = vdupq_n_u64(2);
  const uint64x2_t swap = vtstq_u64(b, vdupq_n_u64(1));
  const vd s1 = vbslq_f64(swap, c, s), c1 = vbslq_f64(swap, s, c);
  const uint64x2_t ss = vshlq_n_u64(vandq_u64(b, two), 62);
  const uint64x2_t cs = vshlq_n_u64(vandq_u64(vaddq_u64(b, vdupq_n_u64(1)), two), 62);
  *so = vreinterpretq_f64_u64(veorq_u64(vreinterpretq_u64_f64(s1), ss));
  *co = vreinterpretq_f64_u64(veorq_u64(vreinterpretq_u64_f64(c1), cs));
}
static inline void vd_store_cs(float *C, float *S, float *N, vd c, vd s) {
  const float32x2_t cf = vcvt_f32_f64(c), sf = vcvt_f32_f64(s);
  vst1_f32(C, cf);
  vst1_f32(S, sf);
  vst1_f32(N, vneg_f32(sf));
}
static inline void vd_store_cs_il(float *T1, float *T2, vd c, vd s) {
  const float32x2_t cf = vcvt_f32_f64(c), sf = vcvt_f32_f64(s), nf = vneg_f32(sf);
  vst1q_f32(T1, vcombine_f32(vzip1_f32(cf, sf), vzip2_f32(cf, sf)));
  vst1q_f32(T2, vcombine_f32(vzip1_f32(nf, cf), vzip2_f32(nf, cf)));
}

/* a load kept in a register (rope's dup_even/dup_odd; NEON never folds loads into shuffles) */
static inline vf vf_load_reg(const float *p) { return vld1q_f32(p); }
#endif
