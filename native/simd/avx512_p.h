/* Panel vocabulary of the quantized matmul (native/kernels/qpanel.inc), AVX-512 + VNNI.
 * p16c: one 64-byte code chunk of a P16 panel (byte 4n+t: column n, K element t of a group of 4);
 * p16i: 16 int32 lanes, one per panel column; p16f: 16 float lanes, one per panel column.
 * pi_dot4 adds to each lane the dot of its column's 16 codes (4 chunks) with 16 activation codes;
 * every integer sum is exact, so any grouping of the adds gives the same value. */
#ifndef CF_SIMD_AVX512_P_H
#define CF_SIMD_AVX512_P_H
#include <immintrin.h>
#include <string.h>
#include <stdint.h>

typedef __m512i p16c;
typedef __m512i p16i;
typedef __m512 p16f;

#define P16_MR 8          /* activation rows per GEMM tile: 8 int + 8 float accumulators + 8 code vectors */
#define P16_Q8_UNSIGNED 1 /* Q8_0 codes are dotted as stored (q + 128) with the offset removed via the sums */

static inline uint32_t p16_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t p16_rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static inline p16c pc_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline p16c pc_lo(p16c v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline p16c pc_hi(p16c v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline p16c pc_or(p16c a, p16c b) { return _mm512_or_si512(a, b); }
static inline void pc_store(uint8_t *p, p16c v) { _mm512_storeu_si512((void *)p, v); }
/* byte i = 16 where bit i of the 64-bit plane at p is set, else 0 */
static inline p16c pc_bit16(const uint8_t *p) { return _mm512_maskz_mov_epi8(_cvtu64_mask64(p16_rd64(p)), _mm512_set1_epi8(16)); }
/* byte i = ((v[i] >> sh) & 3) << 4, sh in 0, 2, 4, 6 */
static inline p16c pc_2bits(p16c v, int sh) {
  const __m512i m = _mm512_and_si512(v, _mm512_set1_epi8((char)(3 << sh)));
  return sh <= 4 ? _mm512_slli_epi16(m, 4 - sh) : _mm512_srli_epi16(m, sh - 4);
}
/* byte i = t[v[i]] (v's bytes 0..15): VPSHUFB with the table in every 128-bit lane */
static inline p16c pc_lut16(p16c v, const uint8_t *t) {
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t)), v);
}
/* byte i = (v[i] >> sh) & 3 */
static inline p16c pc_2b(p16c v, int sh) { return _mm512_and_si512(_mm512_srli_epi16(v, sh), _mm512_set1_epi8(3)); }
/* byte i = ((v[i] >> b) & 1) << pos: a 16-bit shift by b - pos (bits crossing bytes are masked off) */
static inline p16c pc_bitsel(p16c v, int b, int pos) {
  const __m512i x = b >= pos ? _mm512_srli_epi16(v, b - pos) : _mm512_slli_epi16(v, pos - b);
  return _mm512_and_si512(x, _mm512_set1_epi8((char)(1 << pos)));
}

static inline p16i pi_zero(void) { return _mm512_setzero_si512(); }
static inline p16i pi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline p16i pi_add(p16i a, p16i b) { return _mm512_add_epi32(a, b); }
static inline p16i pi_mul(p16i a, p16i b) { return _mm512_mullo_epi32(a, b); }
/* 16 unsigned / signed bytes -> 16 int32 */
static inline p16i pi_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline p16i pi_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* acc + dot of 16 codes per lane: chunks w[0..3] against activation codes a[0..15]; codes <= 255
 * unsigned (bits is the widest code, for ISAs that sum in 16 bits; unused here) */
static inline p16i pi_dot4(p16i acc, const p16c *w, const uint8_t *a, int bits) {
  (void)bits;
  for (int c = 0; c < 4; c++) acc = _mm512_dpbusd_epi32(acc, w[c], _mm512_set1_epi32((int)p16_rd32(a + 4 * c)));
  return acc;
}
/* the Q8_0 dot: chunks w[0..7] hold q + 128; init carries -128 * sum(a) (P16_Q8_UNSIGNED), so the
 * result is init's other part + sum(q * a) */
static inline p16i pi_dot8_q8(p16i init, const p16c *w, const uint8_t *a) {
  return pi_dot4(pi_dot4(init, w, a, 8), w + 4, a + 16, 8);
}
/* acc + pairs of int16 (w: lane = 2 int16) times the int16 pair a2 (broadcast) */
static inline p16i pi_dpw(p16i acc, p16i w, int32_t a2) { return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(a2)); }
/* 16 bytes of lo and 16 of hi -> 16 lanes of int16 pairs (lo, hi), zero-extended */
static inline p16i pi_pair_u8(const uint8_t *lo, const uint8_t *hi) {
  const __m256i l = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)lo));
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)hi));
  const __m512i lw = _mm512_cvtepu16_epi32(l), hw = _mm512_cvtepu16_epi32(h);
  return _mm512_or_si512(lw, _mm512_slli_epi32(hw, 16));
}

static inline p16f pf_zero(void) { return _mm512_setzero_ps(); }
static inline p16f pf_set1(float v) { return _mm512_set1_ps(v); }
static inline p16f pf_cvt(p16i a) { return _mm512_cvtepi32_ps(a); }
static inline p16f pf_h16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline p16f pf_bits(p16i a) { return _mm512_castsi512_ps(a); }
static inline p16f pf_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline p16f pf_mul(p16f a, p16f b) { return _mm512_mul_ps(a, b); }
static inline p16f pf_fma(p16f a, p16f b, p16f c) { return _mm512_fmadd_ps(a, b, c); }
static inline p16f pf_neg(p16f a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
/* MXFP4's E8M0 column scales: 2^(e - 128) for the 16 bytes e at p, exact for every e (VSCALEFPS: 1 * 2^(e - 128);
 * e = 0 gives the subnormal 2^-128, e = 255 2^127), one conversion instead of qpanel.inc's edge test */
#define P16_E8M0 1
static inline p16f pf_e8m0_exact(const uint8_t *p) {
  return _mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(_mm512_sub_epi32(pi_u8(p), _mm512_set1_epi32(128))));
}
static inline void pf_store(float *y, p16f v, int n) {
  if (n >= 16) _mm512_storeu_ps(y, v);
  else _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1u), v);
}
#endif
