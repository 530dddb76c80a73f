/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), scalar C.
 * Same contract as avx2_q.h (vq: 32 int8 codes in element order; vi: 8 int32 lanes, lane L =
 * elements 4L..4L+3; vf8: 8 floats), written as plain loops. This translation unit is compiled
 * with -fno-tree-vectorize, so they stay one element per instruction. */
#ifndef CF_SIMD_SCALAR_Q_H
#define CF_SIMD_SCALAR_Q_H
#include <stdint.h>

typedef struct { int8_t b[32]; } vq;
typedef struct { int32_t l[8]; } vi;
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
static inline vi vi_dot_ss(vq a, vq b) {
  vi r;
  for (int l = 0; l < 8; l++) {
    int32_t s = 0;
    for (int e = 4 * l; e < 4 * l + 4; e++) s += (int32_t)a.b[e] * (int32_t)b.b[e];
    r.l[l] = s;
  }
  return r;
}
static inline vi vi_dot_us(vq u, vq s) { return vi_dot_ss(u, s); } /* u holds 0..127: same as signed */
static inline vf8 vf8_cvt(vi a) { vf8 r; for (int i = 0; i < 8; i++) r.f[i] = (float)a.l[i]; return r; }
static inline vf8 vf8_zero(void) { vf8 r; for (int i = 0; i < 8; i++) r.f[i] = 0.0f; return r; }
static inline vf8 vf8_set1(float a) { vf8 r; for (int i = 0; i < 8; i++) r.f[i] = a; return r; }
static inline vf8 vf8_set2(float a, float b) { vf8 r; for (int i = 0; i < 4; i++) { r.f[i] = a; r.f[i + 4] = b; } return r; }
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
static inline vi vi_hsum4(vi d0, vi d1, vi d2, vi d3) {
  const vi *d[4] = {&d0, &d1, &d2, &d3};
  vi r;
  for (int n = 0; n < 4; n++) {
    r.l[n] = (d[n]->l[0] + d[n]->l[1]) + (d[n]->l[2] + d[n]->l[3]);
    r.l[n + 4] = (d[n]->l[4] + d[n]->l[5]) + (d[n]->l[6] + d[n]->l[7]);
  }
  return r;
}
static inline vi vi_dot4_small(vq w0, vq w1, vq w2, vq w3, vq a) {
  return vi_hsum4(vi_dot_us(w0, a), vi_dot_us(w1, a), vi_dot_us(w2, a), vi_dot_us(w3, a));
}
static inline vf8 vf8_load44(const float *lo, const float *hi) {
  vf8 r;
  for (int i = 0; i < 4; i++) { r.f[i] = lo[i]; r.f[i + 4] = hi[i]; }
  return r;
}
static inline void vf8_fold4(vf8 v, float *out) { for (int i = 0; i < 4; i++) out[i] = v.f[i] + v.f[i + 4]; }
static inline vf8 vf8_h4(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
  vf8 r;
  r.f[0] = r.f[4] = cf_h2f(a); r.f[1] = r.f[5] = cf_h2f(b); r.f[2] = r.f[6] = cf_h2f(c); r.f[3] = r.f[7] = cf_h2f(d);
  return r;
}
static inline vf8 vf8_u8(uint64_t b) { vf8 r; for (int i = 0; i < 8; i++) r.f[i] = (float)((b >> (8 * i)) & 0xff); return r; }
static inline void vf8_t4x8(const vf8 *r, float (*out)[4]) {
  for (int j = 0; j < 8; j++) for (int n = 0; n < 4; n++) out[j][n] = r[n].f[j];
}
static inline vi vi_sub_off(vi d4, const int32_t *h, int sh) {
  for (int i = 0; i < 8; i++) d4.l[i] -= h[i >> 2] * (1 << sh);
  return d4;
}
static inline vf8 vf8_i8(uint64_t b) { vf8 r; for (int i = 0; i < 8; i++) r.f[i] = (float)(int8_t)((b >> (8 * i)) & 0xff); return r; }
typedef struct { int16_t lo, hi; } vs;
#define CF_QK_MR 4
static inline vs vs_set2(int lo, int hi) { vs r = {(int16_t)lo, (int16_t)hi}; return r; }
static inline vs vs_set1(int v) { return vs_set2(v, v); }
static inline vi vi_dot_sc(vq u, vq a, vs s) {
  vi r;
  for (int l = 0; l < 8; l++) {
    int32_t t = 0;
    for (int e = 4 * l; e < 4 * l + 4; e++) t += (int32_t)u.b[e] * (int32_t)a.b[e];
    r.l[l] = t * (l < 4 ? s.lo : s.hi);
  }
  return r;
}
static inline vi vi_add(vi a, vi b) { for (int i = 0; i < 8; i++) a.l[i] += b.l[i]; return a; }
static inline vi vi_dot_sc_acc(vi acc, vq u, vq a, vs s) { return vi_add(acc, vi_dot_sc(u, a, s)); }
static inline vi vi_zero(void) { vi r; for (int i = 0; i < 8; i++) r.l[i] = 0; return r; }
static inline vq vq_abs(vq w) { for (int i = 0; i < 32; i++) w.b[i] = (int8_t)(w.b[i] < 0 ? -w.b[i] : w.b[i]); return w; }
static inline vq vq_signof(vq a, vq w) {
  for (int i = 0; i < 32; i++) a.b[i] = (int8_t)(w.b[i] < 0 ? -a.b[i] : (w.b[i] == 0 ? 0 : a.b[i]));
  return a;
}
static inline float vq_h2f(uint16_t h) { return cf_h2f(h); }
#endif
