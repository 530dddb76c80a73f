/* Block decoding for the quantized matmul's f32 mode and float weights (native/kernels/quant.inc;
 * the q8 mode runs on P16 panels, neon_p.h), aarch64 NEON. Same contract as avx2_q.h and scalar_q.h:
 *  vq:  the 32 int8 codes of one 32-element sub-block in element order (val[0] = elements 0-15,
 *       val[1] = elements 16-31);
 *  vf8: 8 f32 lanes (val[0] = lanes 0-3, val[1] = lanes 4-7). */
#ifndef CF_SIMD_NEON_Q_H
#define CF_SIMD_NEON_Q_H
#include <arm_neon.h>
#include <stdint.h>

typedef int8x16x2_t vq;
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

static inline void vf8_store8(float *p, vf8 v) { vst1q_f32(p, v.val[0]); vst1q_f32(p + 4, v.val[1]); }
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
/* f16 bits -> f32 (exact) */
static inline float vq_h2f(uint16_t h) {
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}
#endif
