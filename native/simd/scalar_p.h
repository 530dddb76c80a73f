/* Panel vocabulary of the quantized matmul (native/kernels/qpanel.inc), portable C: plain loops
 * over the 16 lanes (the build keeps them scalar: -fno-tree-vectorize). The semantics every ISA's
 * header implements: see native/simd/avx512_p.h. */
#ifndef CF_SIMD_SCALAR_P_H
#define CF_SIMD_SCALAR_P_H
#include <string.h>
#include <stdint.h>
#include "../kernels/common.h" /* cf_h2f */

typedef struct { uint8_t b[64]; } p16c;
typedef struct { int32_t v[16]; } p16i;
typedef struct { float v[16]; } p16f;

#define P16_MR 4
#define P16_Q8_UNSIGNED 1

static inline p16c pc_load(const uint8_t *p) { p16c r; memcpy(r.b, p, 64); return r; }
static inline void pc_store(uint8_t *p, p16c v) { memcpy(p, v.b, 64); }
static inline p16c pc_lo(p16c v) { for (int i = 0; i < 64; i++) v.b[i] &= 15; return v; }
static inline p16c pc_hi(p16c v) { for (int i = 0; i < 64; i++) v.b[i] = (uint8_t)(v.b[i] >> 4); return v; }
static inline p16c pc_or(p16c a, p16c b) { for (int i = 0; i < 64; i++) a.b[i] |= b.b[i]; return a; }
static inline p16c pc_bit16(const uint8_t *p) {
  p16c r;
  for (int i = 0; i < 64; i++) r.b[i] = (uint8_t)(((p[i >> 3] >> (i & 7)) & 1) << 4);
  return r;
}
static inline p16c pc_2bits(p16c v, int sh) { for (int i = 0; i < 64; i++) v.b[i] = (uint8_t)(((v.b[i] >> sh) & 3) << 4); return v; }
/* byte i = t[v[i]] (v's bytes are 0..15: IQ4's table) */
static inline p16c pc_lut16(p16c v, const uint8_t *t) { for (int i = 0; i < 64; i++) v.b[i] = t[v.b[i] & 15]; return v; }
/* byte i = (v[i] >> sh) & 3, sh in 0, 2, 4, 6 (2-bit codes) */
static inline p16c pc_2b(p16c v, int sh) { for (int i = 0; i < 64; i++) v.b[i] = (uint8_t)((v.b[i] >> sh) & 3); return v; }
/* byte i = ((v[i] >> b) & 1) << pos (b, pos in 0..7: one bit of each byte moved to bit pos) */
static inline p16c pc_bitsel(p16c v, int b, int pos) {
  for (int i = 0; i < 64; i++) v.b[i] = (uint8_t)(((v.b[i] >> b) & 1) << pos);
  return v;
}

static inline p16i pi_zero(void) { p16i r; memset(&r, 0, sizeof r); return r; }
static inline p16i pi_set1(int32_t x) { p16i r; for (int n = 0; n < 16; n++) r.v[n] = x; return r; }
static inline p16i pi_add(p16i a, p16i b) { for (int n = 0; n < 16; n++) a.v[n] += b.v[n]; return a; }
static inline p16i pi_mul(p16i a, p16i b) { for (int n = 0; n < 16; n++) a.v[n] *= b.v[n]; return a; }
static inline p16i pi_u8(const uint8_t *p) { p16i r; for (int n = 0; n < 16; n++) r.v[n] = p[n]; return r; }
static inline p16i pi_i8(const uint8_t *p) { p16i r; for (int n = 0; n < 16; n++) r.v[n] = (int8_t)p[n]; return r; }
static inline p16i pi_dot4(p16i acc, const p16c *w, const uint8_t *a, int bits) {
  (void)bits;
  for (int n = 0; n < 16; n++) {
    int32_t s = 0;
    for (int c = 0; c < 4; c++)
      for (int t = 0; t < 4; t++) s += (int32_t)w[c].b[4 * n + t] * (int8_t)a[4 * c + t];
    acc.v[n] += s;
  }
  return acc;
}
/* Q8_0: stored codes q + 128 dotted as unsigned; init carries -128 * sum(a) (P16_Q8_UNSIGNED) */
static inline p16i pi_dot8_q8(p16i init, const p16c *w, const uint8_t *a) {
  for (int n = 0; n < 16; n++) {
    int32_t s = 0;
    for (int g = 0; g < 8; g++)
      for (int t = 0; t < 4; t++) s += (int32_t)w[g].b[4 * n + t] * (int8_t)a[4 * g + t];
    init.v[n] += s;
  }
  return init;
}
static inline p16i pi_dpw(p16i acc, p16i w, int32_t a2) {
  const int32_t alo = (int16_t)(a2 & 0xFFFF), ahi = (int16_t)((uint32_t)a2 >> 16);
  for (int n = 0; n < 16; n++)
    acc.v[n] += (int16_t)(w.v[n] & 0xFFFF) * alo + (int16_t)((uint32_t)w.v[n] >> 16) * ahi;
  return acc;
}
static inline p16i pi_pair_u8(const uint8_t *lo, const uint8_t *hi) {
  p16i r;
  for (int n = 0; n < 16; n++) r.v[n] = (int32_t)((uint32_t)lo[n] | ((uint32_t)hi[n] << 16));
  return r;
}

static inline p16f pf_zero(void) { p16f r; memset(&r, 0, sizeof r); return r; }
static inline p16f pf_set1(float x) { p16f r; for (int n = 0; n < 16; n++) r.v[n] = x; return r; }
static inline p16f pf_cvt(p16i a) { p16f r; for (int n = 0; n < 16; n++) r.v[n] = (float)a.v[n]; return r; }
static inline p16f pf_h16(const uint8_t *p) {
  p16f r;
  for (int n = 0; n < 16; n++) { uint16_t h; memcpy(&h, p + 2 * n, 2); r.v[n] = cf_h2f(h); }
  return r;
}
static inline p16f pf_bits(p16i a) { p16f r; memcpy(r.v, a.v, sizeof r.v); return r; }
static inline p16f pf_loadf(const float *p) { p16f r; memcpy(r.v, p, sizeof r.v); return r; }
static inline p16f pf_mul(p16f a, p16f b) { for (int n = 0; n < 16; n++) a.v[n] *= b.v[n]; return a; }
/* no FMA on the scalar path: a*b rounded, then + c rounded (-ffp-contract=off) */
static inline p16f pf_fma(p16f a, p16f b, p16f c) { for (int n = 0; n < 16; n++) c.v[n] = a.v[n] * b.v[n] + c.v[n]; return c; }
static inline p16f pf_neg(p16f a) { for (int n = 0; n < 16; n++) a.v[n] = -a.v[n]; return a; }
static inline void pf_store(float *y, p16f v, int n) { memcpy(y, v.v, (size_t)(n < 16 ? n : 16) * sizeof(float)); }
#endif
