/* AVX2 + FMA + F16C vector helpers for the generic kernel bodies (the .inc files in native/kernels).
 * Everything is static inline; vector constants are locals. Tails use maskload/maskstore so a
 * kernel never touches memory past the end of a row. */
#ifndef CF_SIMD_AVX2_H
#define CF_SIMD_AVX2_H
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "avx2.h needs -mavx2 -mfma -mf16c (the avx2 flags from cpufuse/_isa.py)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include "../kernels/common.h"
#include <string.h>

typedef __m256 vf;
#define VW 8
#define CF_VREGS 16 /* vector registers: sizes the flash-attention register tiles */

static inline __m256i cf_tailmask(int64_t n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), iota);
}
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
/* n in [1, VW): lanes >= n are `fill` */
static inline vf vf_loadn(const float *p, int64_t n, float fill) {
  __m256i m = cf_tailmask(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline void vf_storen(float *p, vf v, int64_t n) { _mm256_maskstore_ps(p, cf_tailmask(n), v); }
static inline vf vf_load_h(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf vf_loadn_h(const uint16_t *p, int64_t n, float fill) {
  uint16_t buf[VW] = {0};
  memcpy(buf, p, (size_t)n * sizeof(uint16_t));
  __m256i m = cf_tailmask(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), vf_load_h(buf), _mm256_castsi256_ps(m));
}
/* non-temporal store (p 32-byte aligned), for outputs much larger than the caches */
#define VALIGN 32
static inline void vf_stream(float *p, vf v) { _mm256_stream_ps(p, v); }
static inline void vf_stream_fence(void) { _mm_sfence(); }
/* f32 -> f16 stores, round to nearest even (rope's cache write); pair duplication for interleaved
 * (x[2k], x[2k+1]) pairs: dup_even = (v0, v0, v2, v2, ...), dup_odd = (v1, v1, v3, v3, ...) */
static inline void vf_store_h(uint16_t *p, vf v) {
  _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void vf_storen_h(uint16_t *p, vf v, int64_t n) {
  uint16_t buf[VW];
  vf_store_h(buf, v);
  memcpy(p, buf, (size_t)n * sizeof(uint16_t));
}
static inline vf vf_dup_even(vf v) { return _mm256_moveldup_ps(v); }
static inline vf vf_dup_odd(vf v) { return _mm256_movehdup_ps(v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); } /* a*b + c */
/* max: if either is NaN the second operand is returned; kernels pass the new value second, so
 * a NaN in the data reaches the running max at least transiently and the row goes NaN via exp. */
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
/* magnitude of m with the sign of s */
static inline vf vf_copysign(vf m, vf s) {
  const vf sign = _mm256_set1_ps(-0.0f);
  return _mm256_or_ps(_mm256_andnot_ps(sign, m), _mm256_and_ps(sign, s));
}
/* x == c ? a : b, lane-wise */
static inline vf vf_where_eq(vf x, vf c, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, c, _CMP_EQ_OQ)); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
/* NaN-propagating max (either operand NaN gives NaN) */
static inline vf vf_max_nan(vf a, vf b) {
  return _mm256_blendv_ps(_mm256_max_ps(a, b), _mm256_add_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}
/* bit i set where lane i of v is not -inf */
static inline uint32_t vf_bits_not_ninf(vf v) {
  return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ));
}
/* bitwise or; vf_any_nonzero: some lane is not +-0 (NaN counts) */
static inline vf vf_or(vf a, vf b) { return _mm256_or_ps(a, b); }
static inline int vf_any_nonzero(vf v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ)) != 0; }
/* 8x8 transpose: dst[c][r] = src[r][c] for r, c < 8 (row strides in floats) */
#define CF_HAVE_T8 1
static inline void cf_transpose8x8(const float *src, int64_t ss, float *dst, int64_t ds) {
  __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + ss), r2 = _mm256_loadu_ps(src + 2 * ss),
         r3 = _mm256_loadu_ps(src + 3 * ss), r4 = _mm256_loadu_ps(src + 4 * ss), r5 = _mm256_loadu_ps(src + 5 * ss),
         r6 = _mm256_loadu_ps(src + 6 * ss), r7 = _mm256_loadu_ps(src + 7 * ss);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
         t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
         t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
         u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
         u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
         u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + ds, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));
}
/* out[0..3] = horizontal sums of a, b, c, d (one hadd tree instead of four reductions) */
static inline void vf_hsum4(vf a, vf b, vf c, vf d, float *out) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
static inline float vf_hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vf_hmax(vf v) {
  /* NaN-propagating horizontal max: a NaN lane makes the result NaN */
  __m128 a = _mm256_castps256_ps128(v), b = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_max_ps(a, b);
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) return __builtin_nanf("");
  return _mm_cvtss_f32(s);
}

/* exp (docs/semantics.md §6), degree-5 polynomial (CF_EXP_C2..C5 in common.h). n = round(x*log2 e) by the
 * magic-constant trick, r = x - n*ln2 (two-constant split), e^r - 1 = r + r^2*q(r).
 * Common path: lanes in [-87.34, 88.37], where 2^n is a normal float built straight from the bits
 * of the magic sum and y = s + s*(e^r - 1) rounds once. Lanes below -103.97 (including -inf) are 0.
 * Only a vector holding a lane whose result is subnormal, or one above 88.37, takes the slow path,
 * which applies 2^n as two exact power-of-two factors so the result is rounded once. */
static inline vf cf_exp_m1(vf r) {
  vf q = _mm256_fmadd_ps(_mm256_set1_ps(CF_EXP_C5), r, _mm256_set1_ps(CF_EXP_C4));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(CF_EXP_C3));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(CF_EXP_C2));
  return _mm256_fmadd_ps(q, _mm256_mul_ps(r, r), r); /* e^r - 1 */
}
static inline vf cf_exp_r(vf xc, vf n) {
  vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(CF_LN2_HI), xc);
  return _mm256_fnmadd_ps(n, _mm256_set1_ps(CF_LN2_LO), r);
}
static vf cf_exp_slow(vf x) {
  vf xc = _mm256_min_ps(_mm256_set1_ps(88.75f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const vf magic = _mm256_set1_ps(12582912.0f);
  vf n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic), magic);
  vf p = _mm256_add_ps(cf_exp_m1(cf_exp_r(xc, n)), _mm256_set1_ps(1.0f));
  __m256i ni = _mm256_cvtps_epi32(n);
  __m256i k1 = _mm256_srai_epi32(ni, 1), k2 = _mm256_sub_epi32(ni, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  vf s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  vf s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  vf y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-103.972f), _CMP_LT_OQ));
  return _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, _mm256_set1_ps(88.7228f), _CMP_GT_OQ));
}
/* the common path on xc clamped to [lo, ...]: 2^n from the low bits of t = x*log2e + 1.5*2^23 + 127 */
static inline vf cf_exp_fast(vf xc, int one_const) {
  const vf magic = _mm256_set1_ps(12583039.0f);   /* 1.5*2^23 + 127: low bits of t are n + 127 */
  vf t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic);
  vf s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)); /* 2^n */
  vf n = _mm256_sub_ps(t, magic);
  vf r = one_const ? _mm256_fnmadd_ps(n, _mm256_set1_ps(CF_LN2_F), xc) : cf_exp_r(xc, n);
  return _mm256_fmadd_ps(cf_exp_m1(r), s, s);
}
static inline vf vf_exp(vf x) {
  const vf lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.37f);
  vf y = cf_exp_fast(_mm256_min_ps(hi, _mm256_max_ps(lo, x)), 0); /* NaN x stays NaN */
  vf under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  if (_mm256_movemask_ps(_mm256_or_ps(under, over))) {
    y = _mm256_andnot_ps(under, y); /* far below: 0 */
    vf tiny = _mm256_and_ps(under, _mm256_cmp_ps(x, _mm256_set1_ps(-103.972f), _CMP_GE_OQ));
    vf fix = _mm256_or_ps(tiny, over);
    if (_mm256_movemask_ps(fix)) y = _mm256_blendv_ps(y, cf_exp_slow(x), fix);
  }
  return y;
}
/* exp for arguments <= 0 (softmax, attention: z - max), no branch: the clamp at -88 makes n = -127,
 * whose 2^n bit pattern is +0, so every lane below about -87.7 (-inf included) gives +0 instead of
 * a subnormal (docs/semantics.md §2: underflow to +0 is fine); NaN stays NaN (NaN * 0); one-constant
 * reduction (CF_LN2_F). */
static inline vf vf_exp_le0(vf x) { return cf_exp_fast(_mm256_max_ps(_mm256_set1_ps(-88.0f), x), 1); }

/* float64 vectors for rope's accurate angle table (native/kernels/rope.inc): plain mul/add, no
 * FMA, so the table is the same on every ISA. vd_quadrant: t holds n + 1.5*2^52 (n the quadrant
 * index, low bits of the mantissa = n mod 4); from sin r, cos r it gives sin and cos of
 * r + n*pi/2. vd_store_cs: round to f32 and store C, S and -S; vd_store_cs_il: the interleaved
 * pair tables (C0, S0, C1, S1, ...) and (-S0, C0, -S1, C1, ...) of 2*VDW floats each. */
typedef __m256d vd;
#define VDW 4
static inline vd vd_set1(double a) { return _mm256_set1_pd(a); }
static inline vd vd_load(const double *p) { return _mm256_loadu_pd(p); }
static inline void vd_store(double *p, vd v) { _mm256_storeu_pd(p, v); }
static inline vd vd_add(vd a, vd b) { return _mm256_add_pd(a, b); }
static inline vd vd_sub(vd a, vd b) { return _mm256_sub_pd(a, b); }
static inline vd vd_mul(vd a, vd b) { return _mm256_mul_pd(a, b); }
/* every lane |v| <= lim (a NaN lane is not) */
static inline int vd_all_abs_le(vd v, double lim) {
  const vd a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), v);
  return _mm256_movemask_pd(_mm256_cmp_pd(a, _mm256_set1_pd(lim), _CMP_LE_OQ)) == 0xF;
}
static inline void vd_quadrant(vd t, vd s, vd c, vd *so, vd *co) {
  const __m256i b = _mm256_castpd_si256(t), two = _mm256_set1_epi64x(2);
  const vd swap = _mm256_castsi256_pd(_mm256_slli_epi64(b, 63)); /* blendv reads the sign bit */
  const vd s1 = _mm256_blendv_pd(s, c, swap), c1 = _mm256_blendv_pd(c, s, swap);
  const __m256i ss = _mm256_slli_epi64(_mm256_and_si256(b, two), 62);
  const __m256i cs = _mm256_slli_epi64(_mm256_and_si256(_mm256_add_epi64(b, _mm256_set1_epi64x(1)), two), 62);
  *so = _mm256_xor_pd(s1, _mm256_castsi256_pd(ss));
  *co = _mm256_xor_pd(c1, _mm256_castsi256_pd(cs));
}
static inline void vd_store_cs(float *C, float *S, float *N, vd c, vd s) {
  const __m128 cf = _mm256_cvtpd_ps(c), sf = _mm256_cvtpd_ps(s);
  _mm_storeu_ps(C, cf);
  _mm_storeu_ps(S, sf);
  _mm_storeu_ps(N, _mm_xor_ps(sf, _mm_set1_ps(-0.0f)));
}
static inline void vd_store_cs_il(float *T1, float *T2, vd c, vd s) {
  const __m128 cf = _mm256_cvtpd_ps(c), sf = _mm256_cvtpd_ps(s), nf = _mm_xor_ps(sf, _mm_set1_ps(-0.0f));
  _mm_storeu_ps(T1, _mm_unpacklo_ps(cf, sf));
  _mm_storeu_ps(T1 + 4, _mm_unpackhi_ps(cf, sf));
  _mm_storeu_ps(T2, _mm_unpacklo_ps(nf, cf));
  _mm_storeu_ps(T2 + 4, _mm_unpackhi_ps(nf, cf));
}

/* a load kept in a register: not folded into each of its uses (rope's dup_even/dup_odd of one x
 * vector would otherwise load it twice, which costs when rows are not 32-byte aligned) */
static inline vf vf_load_reg(const float *p) {
  vf v = _mm256_loadu_ps(p);
  __asm__("" : "+x"(v));
  return v;
}
#endif
