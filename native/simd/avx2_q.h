/* Block decoding for the quantized matmul's f32 mode and float weights (native/kernels/quant.inc;
 * the q8 mode runs on P16 panels, native/simd/<isa>_p.h), AVX2.
 * vq: the 32 int8 codes of one 32-element sub-block, in element order.
 * vf8: 8 f32 lanes (the quantized kernels work on 32-element blocks, so 8 lanes on every x86 ISA). */
#ifndef CF_SIMD_AVX2_Q_H
#define CF_SIMD_AVX2_Q_H
#include <immintrin.h>

typedef __m256i vq;
typedef __m256 vf8;

static inline vq vq_load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* 16 bytes -> 32 codes: element e < 16 is the low nibble of p[e], e >= 16 the high nibble of p[e-16] */
static inline vq vq_nib16(const uint8_t *p) {
  /* the 16 bytes in both halves, the upper half shifted right by 4 (per 32-bit lane), then masked */
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
  const __m256i v = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
/* 32 bytes -> their low (hi = 0) or high (hi = 1) nibbles */
static inline vq vq_nib32(const uint8_t *p, int hi) {
  __m256i v = _mm256_loadu_si256((const __m256i *)p);
  if (hi) v = _mm256_srli_epi16(v, 4);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
/* byte e = 16 where bit e of qh is set, else 0 */
static inline vq vq_bit5(uint32_t qh) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                         0x0101010101010101LL, 0x0000000000000000LL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
  v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}
/* byte l = 16 where bit `bit` of p[l] is set (32 bytes), else 0 */
static inline vq vq_bitsel(const uint8_t *p, int bit) {
  const __m256i m = _mm256_set1_epi8((char)(1 << bit));
  const __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), m);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, m), _mm256_set1_epi8(0x10));
}
/* byte l = ((p[l] >> shift) & 3) << 4 (Q6_K high bits) */
static inline vq vq_2bits(const uint8_t *p, int shift) {
  __m256i v = _mm256_loadu_si256((const __m256i *)p);
  v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift));
  v = _mm256_and_si256(v, _mm256_set1_epi8(3));
  return _mm256_slli_epi16(v, 4); /* no carry across bytes: values < 4 */
}
static inline vq vq_or(vq a, vq b) { return _mm256_or_si256(a, b); }
static inline vq vq_sub8(vq a, int c) { return _mm256_sub_epi8(a, _mm256_set1_epi8((char)c)); }
static inline vf8 vf8_zero(void) { return _mm256_setzero_ps(); }
static inline vf8 vf8_set1(float a) { return _mm256_set1_ps(a); }
static inline vf8 vf8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf8 vf8_load_h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf8 vf8_load_bf(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void vf8_store8(float *p, vf8 v) { _mm256_storeu_ps(p, v); }
static inline vf8 vf8_mul(vf8 a, vf8 b) { return _mm256_mul_ps(a, b); }
static inline vf8 vf8_add(vf8 a, vf8 b) { return _mm256_add_ps(a, b); }
static inline vf8 vf8_fma(vf8 a, vf8 b, vf8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf8_hsum(vf8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
/* codes 8i..8i+7 of q as f32 */
static inline void vq_to_f32(vq q, vf8 *o) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  o[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  o[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  o[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  o[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
/* f16 bits -> f32 (F16C) */
static inline float vq_h2f(uint16_t h) { return _cvtsh_ss(h); }
#endif
