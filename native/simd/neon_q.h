/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), aarch64 NEON.
 * Same contract as avx2_q.h and scalar_q.h:
 *  vq:  the 32 int8 codes of one 32-element sub-block in element order (val[0] = elements 0-15,
 *       val[1] = elements 16-31);
 *  vi:  8 int32 lanes, lane L = the sum over elements 4L..4L+3 of a block product (val[0] lanes
 *       0-3 = elements 0-15, val[1] = elements 16-31; Q6_K's split scales rely on this);
 *  vf8: 8 f32 lanes (val[0] = lanes 0-3, val[1] = lanes 4-7).
 * The int8 dot is sdot (vdotq_s32) when the build enables the dot-product extension
 * (__ARM_FEATURE_DOTPROD, e.g. -march=armv8.2-a+dotprod); plain armv8-a builds use a widening
 * multiply (vmull_s8) and pairwise adds that give exactly the same lane sums. Both are exact. */
#ifndef CF_SIMD_NEON_Q_H
#define CF_SIMD_NEON_Q_H
#include <arm_neon.h>
#include <stdint.h>

typedef int8x16x2_t vq;
typedef int32x4x2_t vi;
typedef float32x4x2_t vf8;

static inline vq vq_load32(const uint8_t *p) {
  vq r;
  r.val[0] = vld1q_s8((const int8_t *)p);
  r.val[1] = vld1q_s8((const int8_t *)p + 16);
  return r;
}
/* 16 bytes -> 32 codes: element e < 16 is the low nibble of p[e], e >= 16 the high nibble of p[e-16] */
static inline vq vq_nib16(const uint8_t *p) {
  const uint8x16_t b = vld1q_u8(p);
  vq r;
  r.val[0] = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F)));
  r.val[1] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
  return r;
}
/* 32 bytes -> their low (hi = 0) or high (hi = 1) nibbles */
static inline vq vq_nib32(const uint8_t *p, int hi) {
  const uint8x16_t b0 = vld1q_u8(p), b1 = vld1q_u8(p + 16);
  vq r;
  if (hi) {
    r.val[0] = vreinterpretq_s8_u8(vshrq_n_u8(b0, 4));
    r.val[1] = vreinterpretq_s8_u8(vshrq_n_u8(b1, 4));
  } else {
    const uint8x16_t m = vdupq_n_u8(0x0F);
    r.val[0] = vreinterpretq_s8_u8(vandq_u8(b0, m));
    r.val[1] = vreinterpretq_s8_u8(vandq_u8(b1, m));
  }
  return r;
}
/* byte e = 16 where bit e of qh is set, else 0 */
static inline vq vq_bit5(uint32_t qh) {
  static const uint8_t bits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t sel = vld1q_u8(bits), sixteen = vdupq_n_u8(0x10);
  /* byte e of lo = byte e/8 of qh (elements 0-15), of hi = byte 2 + e/8 (elements 16-31) */
  const uint8x16_t lo = vcombine_u8(vdup_n_u8((uint8_t)qh), vdup_n_u8((uint8_t)(qh >> 8)));
  const uint8x16_t hi = vcombine_u8(vdup_n_u8((uint8_t)(qh >> 16)), vdup_n_u8((uint8_t)(qh >> 24)));
  vq r;
  r.val[0] = vreinterpretq_s8_u8(vandq_u8(vtstq_u8(lo, sel), sixteen));
  r.val[1] = vreinterpretq_s8_u8(vandq_u8(vtstq_u8(hi, sel), sixteen));
  return r;
}
/* byte l = 16 where bit `bit` of p[l] is set (32 bytes), else 0 */
static inline vq vq_bitsel(const uint8_t *p, int bit) {
  const uint8x16_t m = vdupq_n_u8((uint8_t)(1u << bit)), sixteen = vdupq_n_u8(0x10);
  vq r;
  r.val[0] = vreinterpretq_s8_u8(vandq_u8(vtstq_u8(vld1q_u8(p), m), sixteen));
  r.val[1] = vreinterpretq_s8_u8(vandq_u8(vtstq_u8(vld1q_u8(p + 16), m), sixteen));
  return r;
}
/* byte l = ((p[l] >> shift) & 3) << 4 (Q6_K high bits) */
static inline vq vq_2bits(const uint8_t *p, int shift) {
  const int8x16_t sh = vdupq_n_s8((int8_t)-shift); /* vshlq by a negative count: logical right shift */
  const uint8x16_t three = vdupq_n_u8(3);
  vq r;
  r.val[0] = vreinterpretq_s8_u8(vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(p), sh), three), 4));
  r.val[1] = vreinterpretq_s8_u8(vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(p + 16), sh), three), 4));
  return r;
}
static inline vq vq_or(vq a, vq b) {
  a.val[0] = vorrq_s8(a.val[0], b.val[0]);
  a.val[1] = vorrq_s8(a.val[1], b.val[1]);
  return a;
}
static inline vq vq_sub8(vq a, int c) {
  const int8x16_t v = vdupq_n_s8((int8_t)c);
  a.val[0] = vsubq_s8(a.val[0], v);
  a.val[1] = vsubq_s8(a.val[1], v);
  return a;
}

/* 16 int8 products -> 4 int32 lanes, lane L = elements 4L..4L+3 (exact) */
#if defined(__ARM_FEATURE_DOTPROD)
#define CF_NEON_Q_DOT "sdot"
static inline int32x4_t cf_neon_dot16(int8x16_t a, int8x16_t b) { return vdotq_s32(vdupq_n_s32(0), a, b); }
#else
#define CF_NEON_Q_DOT "vmull"
static inline int32x4_t cf_neon_dot16(int8x16_t a, int8x16_t b) {
  /* |product| <= 128*128 fits int16; pairs are widened to int32 before any further add */
  const int32x4_t p0 = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));  /* e0+e1 .. e6+e7 */
  const int32x4_t p1 = vpaddlq_s16(vmull_high_s8(a, b));                         /* e8+e9 .. e14+e15 */
  return vpaddq_s32(p0, p1); /* e0-3, e4-7, e8-11, e12-15 */
}
#endif
/* signed times signed; exact for every int8 value, -128 included */
static inline vi vi_dot_ss(vq a, vq b) {
  vi r;
  r.val[0] = cf_neon_dot16(a.val[0], b.val[0]);
  r.val[1] = cf_neon_dot16(a.val[1], b.val[1]);
  return r;
}
/* unsigned codes u (0..127) times signed codes s: u fits int8, so the signed dot is exact */
static inline vi vi_dot_us(vq u, vq s) { return vi_dot_ss(u, s); }

/* integer-scaled dots for the K-quant tiles (contract in avx2_q.h): the lane sums times a 16-bit
 * scale per half (vmulq_n_s32 on each 4-lane half) */
typedef struct { int32_t lo, hi; } vs;
#define CF_QK_MR 4 /* 32 vector registers */
static inline vs vs_set2(int lo, int hi) { vs r = {lo, hi}; return r; }
static inline vs vs_set1(int v) { return vs_set2(v, v); }
static inline vi vi_dot_sc(vq u, vq a, vs s) {
  vi r = vi_dot_us(u, a);
  r.val[0] = vmulq_n_s32(r.val[0], s.lo);
  r.val[1] = vmulq_n_s32(r.val[1], s.hi);
  return r;
}
static inline vi vi_add(vi a, vi b) {
  a.val[0] = vaddq_s32(a.val[0], b.val[0]);
  a.val[1] = vaddq_s32(a.val[1], b.val[1]);
  return a;
}
static inline vi vi_dot_sc_acc(vi acc, vq u, vq a, vs s) { return vi_add(acc, vi_dot_sc(u, a, s)); }
static inline vi vi_zero(void) { vi r; r.val[0] = vdupq_n_s32(0); r.val[1] = vdupq_n_s32(0); return r; }
/* signed codes go through vi_dot_sc as they are (the NEON dot is signed x signed) */
static inline vq vq_abs(vq w) { return w; }
static inline vq vq_signof(vq a, vq w) { (void)w; return a; }

static inline void vf8_store8(float *p, vf8 v) { vst1q_f32(p, v.val[0]); vst1q_f32(p + 4, v.val[1]); }
static inline vf8 vf8_cvt(vi a) {
  vf8 r;
  r.val[0] = vcvtq_f32_s32(a.val[0]);
  r.val[1] = vcvtq_f32_s32(a.val[1]);
  return r;
}
static inline vf8 vf8_zero(void) {
  vf8 r;
  r.val[0] = r.val[1] = vdupq_n_f32(0.0f);
  return r;
}
static inline vf8 vf8_set1(float a) {
  vf8 r;
  r.val[0] = r.val[1] = vdupq_n_f32(a);
  return r;
}
/* lanes 0-3 = a, lanes 4-7 = b */
static inline vf8 vf8_set2(float a, float b) {
  vf8 r;
  r.val[0] = vdupq_n_f32(a);
  r.val[1] = vdupq_n_f32(b);
  return r;
}
static inline vf8 vf8_load(const float *p) {
  vf8 r;
  r.val[0] = vld1q_f32(p);
  r.val[1] = vld1q_f32(p + 4);
  return r;
}
/* 8 f16 -> f32 (exact, subnormals included: FPCR.FZ16 is off in user space) */
static inline vf8 vf8_load_h(const uint16_t *p) {
  const uint16x8_t h = vld1q_u16(p);
  vf8 r;
  r.val[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
  r.val[1] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)));
  return r;
}
/* 8 bf16 -> f32: the bits moved to the upper half */
static inline vf8 vf8_load_bf(const uint16_t *p) {
  const uint16x8_t h = vld1q_u16(p);
  vf8 r;
  r.val[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
  r.val[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
  return r;
}
static inline vf8 vf8_mul(vf8 a, vf8 b) {
  a.val[0] = vmulq_f32(a.val[0], b.val[0]);
  a.val[1] = vmulq_f32(a.val[1], b.val[1]);
  return a;
}
static inline vf8 vf8_add(vf8 a, vf8 b) {
  a.val[0] = vaddq_f32(a.val[0], b.val[0]);
  a.val[1] = vaddq_f32(a.val[1], b.val[1]);
  return a;
}
/* a*b + c, one rounding */
static inline vf8 vf8_fma(vf8 a, vf8 b, vf8 c) {
  c.val[0] = vfmaq_f32(c.val[0], a.val[0], b.val[0]);
  c.val[1] = vfmaq_f32(c.val[1], a.val[1], b.val[1]);
  return c;
}
/* ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)): the order of avx2_q.h and scalar_q.h */
static inline float vf8_hsum(vf8 v) {
  const float32x4_t t = vaddq_f32(v.val[0], v.val[1]);
  const float32x2_t u = vadd_f32(vget_low_f32(t), vget_high_f32(t));
  return vpadds_f32(u);
}
/* codes 8i..8i+7 of q as f32 */
static inline void vq_to_f32(vq q, vf8 *o) {
  for (int h = 0; h < 2; h++) {
    const int16x8_t w0 = vmovl_s8(vget_low_s8(q.val[h])), w1 = vmovl_high_s8(q.val[h]);
    o[2 * h].val[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w0)));
    o[2 * h].val[1] = vcvtq_f32_s32(vmovl_high_s16(w0));
    o[2 * h + 1].val[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w1)));
    o[2 * h + 1].val[1] = vcvtq_f32_s32(vmovl_high_s16(w1));
  }
}
/* 4 lane sums into one vector: lanes 0-3 = elements 0-15 of d0..d3, lanes 4-7 = elements 16-31
 * (pairwise adds: [a0+a1, a2+a3, b0+b1, b2+b3], twice; exact int32) */
static inline vi vi_hsum4(vi d0, vi d1, vi d2, vi d3) {
  vi r;
  r.val[0] = vpaddq_s32(vpaddq_s32(d0.val[0], d1.val[0]), vpaddq_s32(d2.val[0], d3.val[0]));
  r.val[1] = vpaddq_s32(vpaddq_s32(d0.val[1], d1.val[1]), vpaddq_s32(d2.val[1], d3.val[1]));
  return r;
}
/* the x4 tile's dot of four small-code rows: no 16-bit shortcut on NEON, the plain reduction */
static inline vi vi_dot4_small(vq w0, vq w1, vq w2, vq w3, vq a) {
  return vi_hsum4(vi_dot_us(w0, a), vi_dot_us(w1, a), vi_dot_us(w2, a), vi_dot_us(w3, a));
}
/* lanes 0-3 from lo[0..3], lanes 4-7 from hi[0..3] */
static inline vf8 vf8_load44(const float *lo, const float *hi) {
  vf8 r;
  r.val[0] = vld1q_f32(lo);
  r.val[1] = vld1q_f32(hi);
  return r;
}
/* out[i] = v[i] + v[i + 4], i < 4 */
static inline void vf8_fold4(vf8 v, float *out) { vst1q_f32(out, vaddq_f32(v.val[0], v.val[1])); }
/* four f16 scales -> lanes 0-3 and again 4-7 (exact) */
static inline vf8 vf8_h4(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
  const uint64_t bits = (uint64_t)a | ((uint64_t)b << 16) | ((uint64_t)c << 32) | ((uint64_t)d << 48);
  vf8 r;
  r.val[0] = r.val[1] = vcvt_f32_f16(vreinterpret_f16_u16(vcreate_u16(bits)));
  return r;
}
/* 8 unsigned bytes (byte i = bits 8i..8i+7 of b) -> 8 floats */
static inline vf8 vf8_u8(uint64_t b) {
  const uint16x8_t w = vmovl_u8(vcreate_u8(b));
  vf8 r;
  r.val[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w)));
  r.val[1] = vcvtq_f32_u32(vmovl_high_u16(w));
  return r;
}
/* 8 signed bytes (byte i = bits 8i..8i+7 of b) -> 8 floats */
static inline vf8 vf8_i8(uint64_t b) {
  const int16x8_t w = vmovl_s8(vcreate_s8(b));
  vf8 r;
  r.val[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
  r.val[1] = vcvtq_f32_s32(vmovl_high_s16(w));
  return r;
}
/* lanes 0-3 minus h[0] * 2^sh, lanes 4-7 minus h[1] * 2^sh */
static inline vi vi_sub_off(vi d4, const int32_t *h, int sh) {
  d4.val[0] = vsubq_s32(d4.val[0], vdupq_n_s32(h[0] * (1 << sh)));
  d4.val[1] = vsubq_s32(d4.val[1], vdupq_n_s32(h[1] * (1 << sh)));
  return d4;
}
/* rows r[0..3] of 8 values (one per sub-block j) -> out[j][0..3] = r[0..3][j]: two 4x4
 * transposes (lanes 0-3, then 4-7) */
static inline void cf_neon_t4x4(float32x4_t r0, float32x4_t r1, float32x4_t r2, float32x4_t r3, float (*out)[4]) {
  const float32x4_t t0 = vtrn1q_f32(r0, r1), t1 = vtrn2q_f32(r0, r1); /* r0_0 r1_0 r0_2 r1_2 | r0_1 r1_1 r0_3 r1_3 */
  const float32x4_t t2 = vtrn1q_f32(r2, r3), t3 = vtrn2q_f32(r2, r3);
  const float64x2_t a0 = vreinterpretq_f64_f32(t0), a1 = vreinterpretq_f64_f32(t1);
  const float64x2_t a2 = vreinterpretq_f64_f32(t2), a3 = vreinterpretq_f64_f32(t3);
  vst1q_f32(out[0], vreinterpretq_f32_f64(vtrn1q_f64(a0, a2)));
  vst1q_f32(out[1], vreinterpretq_f32_f64(vtrn1q_f64(a1, a3)));
  vst1q_f32(out[2], vreinterpretq_f32_f64(vtrn2q_f64(a0, a2)));
  vst1q_f32(out[3], vreinterpretq_f32_f64(vtrn2q_f64(a1, a3)));
}
static inline void vf8_t4x8(const vf8 *r, float (*out)[4]) {
  cf_neon_t4x4(r[0].val[0], r[1].val[0], r[2].val[0], r[3].val[0], out);
  cf_neon_t4x4(r[0].val[1], r[1].val[1], r[2].val[1], r[3].val[1], out + 4);
}
/* f16 bits -> f32 (exact) */
static inline float vq_h2f(uint16_t h) {
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}
#endif
