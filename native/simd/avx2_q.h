/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), AVX2.
 * vq: the 32 int8 codes of one 32-element sub-block, in element order.
 * vi: 8 int32 lanes; lane L holds the sum over elements 4L..4L+3 of a block product.
 * vf8: 8 f32 lanes (the quantized kernels work on 32-element blocks, so 8 lanes on every x86 ISA). */
#ifndef CF_SIMD_AVX2_Q_H
#define CF_SIMD_AVX2_Q_H
#include <immintrin.h>

typedef __m256i vq;
typedef __m256i vi;
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
/* unsigned codes u (0..127) times signed codes s */
static inline vi vi_dot_us(vq u, vq s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
/* signed times signed (sign trick: |a| times sign(a)*b; a = -128 is not produced by any format
 * decoded here) */
static inline vi vi_dot_ss(vq a, vq b) { return vi_dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }
static inline vf8 vf8_cvt(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf8 vf8_zero(void) { return _mm256_setzero_ps(); }
static inline vf8 vf8_set1(float a) { return _mm256_set1_ps(a); }
/* lanes 0-3 = a, lanes 4-7 = b */
static inline vf8 vf8_set2(float a, float b) { return _mm256_setr_ps(a, a, a, a, b, b, b, b); }
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
/* 4 lane sums into one vector: lanes 0-3 = elements 0-15 of d0..d3, lanes 4-7 = elements 16-31 */
static inline vi vi_hsum4(vi d0, vi d1, vi d2, vi d3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
}
/* vi_hsum4 of the four u8 x s8 products of one activation block with codes of at most 5 bits:
 * the 16-bit pair sums are added twice more in 16 bits (at most 4 x 31 x 127 x 2 = 31496) and
 * widened once, instead of widening each of the four */
static inline vi vi_dot4_small(vq w0, vq w1, vq w2, vq w3, vq a) {
  const __m256i p0 = _mm256_maddubs_epi16(w0, a), p1 = _mm256_maddubs_epi16(w1, a);
  const __m256i p2 = _mm256_maddubs_epi16(w2, a), p3 = _mm256_maddubs_epi16(w3, a);
  const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p0, p1), _mm256_hadd_epi16(p2, p3));
  return _mm256_madd_epi16(h, _mm256_set1_epi16(1));
}
/* lanes 0-3 from lo[0..3], lanes 4-7 from hi[0..3] */
static inline vf8 vf8_load44(const float *lo, const float *hi) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
}
/* out[i] = v[i] + v[i + 4], i < 4 */
static inline void vf8_fold4(vf8 v, float *out) {
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}
/* four f16 scales -> lanes 0-3 and again 4-7 */
static inline vf8 vf8_h4(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
  const __m128 s = _mm_cvtph_ps(_mm_setr_epi16((short)a, (short)b, (short)c, (short)d, 0, 0, 0, 0));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(s), s, 1);
}
/* 8 unsigned bytes -> 8 floats */
static inline vf8 vf8_u8(uint64_t b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)b))); }
/* rows r[0..3] of 8 values (one per sub-block j) -> out[j][0..3] */
static inline void vf8_t4x8(const vf8 *r, float (*out)[4]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  _mm_storeu_ps(out[0], _mm256_castps256_ps128(u0)); _mm_storeu_ps(out[4], _mm256_extractf128_ps(u0, 1));
  _mm_storeu_ps(out[1], _mm256_castps256_ps128(u1)); _mm_storeu_ps(out[5], _mm256_extractf128_ps(u1, 1));
  _mm_storeu_ps(out[2], _mm256_castps256_ps128(u2)); _mm_storeu_ps(out[6], _mm256_extractf128_ps(u2, 1));
  _mm_storeu_ps(out[3], _mm256_castps256_ps128(u3)); _mm_storeu_ps(out[7], _mm256_extractf128_ps(u3, 1));
}
/* d4 - ([h[0] x4 | h[1] x4] << sh): removes a code offset of 2^sh using the activation's 16-element sums */
static inline vi vi_sub_off(vi d4, const int32_t *h, int sh) {
  const __m256i v = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)h)),
                                                _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  return _mm256_sub_epi32(d4, _mm256_sll_epi32(v, _mm_cvtsi32_si128(sh)));
}
/* 8 signed bytes -> 8 floats */
static inline vf8 vf8_i8(uint64_t b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128((long long)b))); }
/* integer-scaled dots for the K-quant tiles: vs holds 16-bit scales, lanes 0-7 for elements
 * 0-15 and 8-15 for elements 16-31; vi_dot_sc(u, a, s) = per lane L (elements 4L..4L+3) the
 * sum of u*a*scale, as 32-bit integers (maddubs pairs stay within 16 bits: u <= 63) */
typedef __m256i vs;
#ifndef CF_QK_MR
#define CF_QK_MR 2 /* activation rows per pass of the K-quant tiles (16 registers) */
#endif
static inline vs vs_set2(int lo, int hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)lo)), _mm_set1_epi16((short)hi), 1);
}
static inline vs vs_set1(int v) { return _mm256_set1_epi16((short)v); }
static inline vi vi_dot_sc(vq u, vq a, vs s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), s); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
/* acc + vi_dot_sc(u, a, s) */
#ifndef CF_HAVE_DOT_SC_ACC
static inline vi vi_dot_sc_acc(vi acc, vq u, vq a, vs s) { return _mm256_add_epi32(acc, vi_dot_sc(u, a, s)); }
#endif
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
/* |w| and a with w's sign, for signed codes through vi_dot_sc */
static inline vq vq_abs(vq w) { return _mm256_sign_epi8(w, w); }
static inline vq vq_signof(vq a, vq w) { return _mm256_sign_epi8(a, w); }
/* f16 bits -> f32 (F16C) */
static inline float vq_h2f(uint16_t h) { return _cvtsh_ss(h); }
#endif
