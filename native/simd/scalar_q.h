/* Block decoding for the quantized matmul's f32 mode and float weights (native/kernels/quant.inc),
 * scalar C. Same contract as avx2_q.h (vq: 32 int8 codes in element order; vf8: 8 floats),
 * written as plain loops. This translation unit is compiled with -fno-tree-vectorize, so they stay
 * one element per instruction. */
#ifndef CF_SIMD_SCALAR_Q_H
#define CF_SIMD_SCALAR_Q_H
#include <stdint.h>

typedef struct { int8_t b[32]; } vq;
typedef struct { float f[8]; } vf8;

static inline vq vq_load32(const uint8_t *p) { vq r; for (int i = 0; i < 32; i++) r.b[i] = (int8_t)p[i]; return r; }
static inline vq vq_nib16(const uint8_t *p) {
  vq r;
  for (int i = 0; i < 16; i++) { r.b[i] = (int8_t)(p[i] & 15); r.b[i + 16] = (int8_t)(p[i] >> 4); }
  return r;
}
static inline vq vq_nib32(const uint8_t *p, int hi) {
  vq r;
  for (int i = 0; i < 32; i++) r.b[i] = (int8_t)(hi ? p[i] >> 4 : p[i] & 15);
  return r;
}
static inline vq vq_bit5(uint32_t qh) { vq r; for (int i = 0; i < 32; i++) r.b[i] = (int8_t)(((qh >> i) & 1) << 4); return r; }
static inline vq vq_bitsel(const uint8_t *p, int bit) { vq r; for (int i = 0; i < 32; i++) r.b[i] = (int8_t)(((p[i] >> bit) & 1) << 4); return r; }
static inline vq vq_2bits(const uint8_t *p, int shift) { vq r; for (int i = 0; i < 32; i++) r.b[i] = (int8_t)(((p[i] >> shift) & 3) << 4); return r; }
static inline vq vq_or(vq a, vq b) { for (int i = 0; i < 32; i++) a.b[i] = (int8_t)(a.b[i] | b.b[i]); return a; }
static inline vq vq_sub8(vq a, int c) { for (int i = 0; i < 32; i++) a.b[i] = (int8_t)(a.b[i] - c); return a; }
static inline vf8 vf8_zero(void) { vf8 r; for (int i = 0; i < 8; i++) r.f[i] = 0.0f; return r; }
static inline vf8 vf8_set1(float a) { vf8 r; for (int i = 0; i < 8; i++) r.f[i] = a; return r; }
/* loads through memcpy: weight bytes (F32/F16/BF16 rows of a QTensor) may sit at any address */
static inline vf8 vf8_load(const float *p) { vf8 r; memcpy(r.f, p, sizeof r.f); return r; }
static inline vf8 vf8_load_h(const uint16_t *p) {
  vf8 r;
  for (int i = 0; i < 8; i++) { uint16_t h; memcpy(&h, p + i, 2); r.f[i] = cf_h2f(h); }
  return r;
}
static inline vf8 vf8_load_bf(const uint16_t *p) {
  vf8 r;
  for (int i = 0; i < 8; i++) { uint16_t h; memcpy(&h, p + i, 2); uint32_t u = (uint32_t)h << 16; memcpy(&r.f[i], &u, 4); }
  return r;
}
static inline void vf8_store8(float *p, vf8 v) { for (int i = 0; i < 8; i++) p[i] = v.f[i]; }
static inline vf8 vf8_mul(vf8 a, vf8 b) { for (int i = 0; i < 8; i++) a.f[i] *= b.f[i]; return a; }
static inline vf8 vf8_add(vf8 a, vf8 b) { for (int i = 0; i < 8; i++) a.f[i] += b.f[i]; return a; }
static inline vf8 vf8_fma(vf8 a, vf8 b, vf8 c) { for (int i = 0; i < 8; i++) c.f[i] = a.f[i] * b.f[i] + c.f[i]; return c; } /* two roundings */
static inline float vf8_hsum(vf8 v) {
  return ((v.f[0] + v.f[4]) + (v.f[2] + v.f[6])) + ((v.f[1] + v.f[5]) + (v.f[3] + v.f[7]));
}
static inline void vq_to_f32(vq q, vf8 *o) {
  for (int j = 0; j < 4; j++) for (int i = 0; i < 8; i++) o[j].f[i] = (float)q.b[8 * j + i];
}
static inline float vq_h2f(uint16_t h) { return cf_h2f(h); }
#endif
