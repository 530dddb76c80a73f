/* AVX-512 (F/BW/VL/DQ) vector helpers for the generic kernel bodies. Tails use __mmask16
 * masked loads/stores, which never fault on the masked-off lanes; exp uses vscalefps. */
#ifndef CF_SIMD_AVX512_H
#define CF_SIMD_AVX512_H
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__)
#error "avx512.h needs -mavx512f -mavx512bw -mavx512vl -mavx512dq (the avx512 flags from cpufuse/_isa.py)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include "../kernels/common.h"

typedef __m512 vf;
#define VW 16
#define CF_VREGS 32 /* vector registers: sizes the flash-attention register tiles */

static inline __mmask16 cf_tailmask(int64_t n) { return (__mmask16)((1u << n) - 1u); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_loadn(const float *p, int64_t n, float fill) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), cf_tailmask(n), p);
}
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline void vf_storen(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, cf_tailmask(n), v); }
static inline vf vf_load_h(const uint16_t *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vf vf_loadn_h(const uint16_t *p, int64_t n, float fill) {
  __mmask16 m = cf_tailmask(n);
  vf v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), v);
}
#define VALIGN 64
static inline void vf_stream(float *p, vf v) { _mm512_stream_ps(p, v); }
static inline void vf_stream_fence(void) { _mm_sfence(); }
/* f32 -> f16 stores, round to nearest even (rope's cache write); pair duplication for interleaved
 * (x[2k], x[2k+1]) pairs: dup_even = (v0, v0, v2, v2, ...), dup_odd = (v1, v1, v3, v3, ...) */
static inline void vf_store_h(uint16_t *p, vf v) {
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void vf_storen_h(uint16_t *p, vf v, int64_t n) {
  _mm256_mask_storeu_epi16(p, cf_tailmask(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vf_dup_even(vf v) { return _mm512_moveldup_ps(v); }
static inline vf vf_dup_odd(vf v) { return _mm512_movehdup_ps(v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_copysign(vf m, vf s) {
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(m)),
                                             _mm512_and_si512(sign, _mm512_castps_si512(s))));
}
static inline vf vf_where_eq(vf x, vf c, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, c, _CMP_EQ_OQ), b, a); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_max_nan(vf a, vf b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), _mm512_max_ps(a, b), _mm512_add_ps(a, b));
}
static inline uint32_t vf_bits_not_ninf(vf v) {
  return (uint32_t)_mm512_cmp_ps_mask(v, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_UQ);
}
/* bitwise or; vf_any_nonzero: some lane is not +-0 (NaN counts) */
static inline vf vf_or(vf a, vf b) { return _mm512_or_ps(a, b); }
static inline int vf_any_nonzero(vf v) { return _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ) != 0; }
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
static inline void vf_hsum4(vf a, vf b, vf c, vf d, float *out) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
/* The 16 sums of a 4x4 tile of dot-product accumulators x<4*m + l> (m: K row, l: query row),
 * stored as dst[l * ds + m]: three shuffle-and-add rounds (30 shuffles, 15 adds for 16 sums, where
 * four vf_hsum4 calls take 44 shuffles and 32 adds). Round 1 folds 512 -> 256 bits pairwise,
 * round 2 leaves 128-bit lane l of t[m] holding x[4m + l], round 3 reduces inside the lanes. */
#define CF_HAVE_HSUM16 1
static inline __attribute__((always_inline)) void vf_hsum16(vf x0, vf x1, vf x2, vf x3, vf x4, vf x5, vf x6, vf x7,
                                                            vf x8, vf x9, vf x10, vf x11, vf x12, vf x13, vf x14,
                                                            vf x15, float *dst, int64_t ds) {
#define CF_H16_R1(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE))
#define CF_H16_R2(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD))
  const vf t0 = CF_H16_R2(CF_H16_R1(x0, x1), CF_H16_R1(x2, x3));
  const vf t1 = CF_H16_R2(CF_H16_R1(x4, x5), CF_H16_R1(x6, x7));
  const vf t2 = CF_H16_R2(CF_H16_R1(x8, x9), CF_H16_R1(x10, x11));
  const vf t3 = CF_H16_R2(CF_H16_R1(x12, x13), CF_H16_R1(x14, x15));
#undef CF_H16_R1
#undef CF_H16_R2
  const vf u01 = _mm512_add_ps(_mm512_unpacklo_ps(t0, t1), _mm512_unpackhi_ps(t0, t1));
  const vf u23 = _mm512_add_ps(_mm512_unpacklo_ps(t2, t3), _mm512_unpackhi_ps(t2, t3));
  const vf r = _mm512_add_ps(_mm512_shuffle_ps(u01, u23, 0x44), _mm512_shuffle_ps(u01, u23, 0xEE));
  _mm_storeu_ps(dst, _mm512_castps512_ps128(r));
  _mm_storeu_ps(dst + ds, _mm512_extractf32x4_ps(r, 1));
  _mm_storeu_ps(dst + 2 * ds, _mm512_extractf32x4_ps(r, 2));
  _mm_storeu_ps(dst + 3 * ds, _mm512_extractf32x4_ps(r, 3));
}
static inline float vf_hsum(vf v) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vf_hmax(vf v) {
  if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return __builtin_nanf("");
  return _mm512_reduce_max_ps(v);
}
/* exp (docs/semantics.md §6), degree-5 polynomial (CF_EXP_C2..C5 in common.h), 2^n via vscalefps.
 * n = round(x*log2 e) by the magic-constant trick, r = x - n*ln2 with ln2 split in two,
 * e^r = 1 + (r + r^2*q(r)). The common path clamps at -87.34 so no lane produces a subnormal:
 * on Intel cores a subnormal result costs a microcode assist, and masked (-inf) softmax lanes
 * would otherwise hit it on every vector. Overflow needs no test: above 88.72 the clamp at 88.75
 * gives n = 128 and vscalefps returns +inf. */
static inline vf cf_exp_p(vf xc, vf *n, int one_const) {
  const vf magic = _mm512_set1_ps(12582912.0f);
  *n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  vf r;
  if (one_const) {
    r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(CF_LN2_F), xc);
  } else {
    r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(CF_LN2_HI), xc);
    r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(CF_LN2_LO), r);
  }
  vf q = _mm512_fmadd_ps(_mm512_set1_ps(CF_EXP_C5), r, _mm512_set1_ps(CF_EXP_C4));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(CF_EXP_C3));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(CF_EXP_C2));
  return _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
}
/* full range: exp(-inf) = 0, NaN stays NaN, +inf gives +inf; a vector holding a lane below
 * -87.34 takes the exact scalef path for that lane (a subnormal or zero result). */
static inline vf vf_exp(vf x) {
  const vf lo = _mm512_set1_ps(-87.33654f);
  vf n, xc = _mm512_min_ps(_mm512_set1_ps(88.75f), _mm512_max_ps(lo, x)); /* NaN stays NaN */
  const vf p = cf_exp_p(xc, &n, 0);
  vf y = _mm512_scalef_ps(p, n);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  if (under) {
    vf n2, p2 = cf_exp_p(_mm512_max_ps(_mm512_set1_ps(-104.0f), x), &n2, 0);
    y = _mm512_mask_scalef_ps(y, under, p2, n2); /* x = -inf: p2 * 2^-150 rounds to 0 */
  }
  return y;
}
/* exp for arguments <= 0 (softmax, attention: z - max): lanes below -87.34 give +0 instead of a
 * subnormal (docs/semantics.md §2: underflow to +0 is fine), NaN stays NaN; no branch; one-constant
 * reduction (CF_LN2_F). */
static inline vf vf_exp_le0(vf x) {
  const vf lo = _mm512_set1_ps(-87.33654f);
  vf n, p = cf_exp_p(_mm512_max_ps(lo, x), &n, 1);
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), p, n);
}

/* float64 vectors for rope's accurate angle table (native/kernels/rope.inc): plain mul/add, no
 * FMA, so the table is the same on every ISA. vd_quadrant: t holds n + 1.5*2^52 (n the quadrant
 * index, low bits of the mantissa = n mod 4); from sin r, cos r it gives sin and cos of
 * r + n*pi/2. vd_store_cs: round to f32 and store C, S and -S; vd_store_cs_il: the interleaved
 * pair tables (C0, S0, C1, S1, ...) and (-S0, C0, -S1, C1, ...) of 2*VDW floats each. */
typedef __m512d vd;
#define VDW 8
static inline vd vd_set1(double a) { return _mm512_set1_pd(a); }
static inline vd vd_load(const double *p) { return _mm512_loadu_pd(p); }
static inline void vd_store(double *p, vd v) { _mm512_storeu_pd(p, v); }
static inline vd vd_add(vd a, vd b) { return _mm512_add_pd(a, b); }
static inline vd vd_sub(vd a, vd b) { return _mm512_sub_pd(a, b); }
static inline vd vd_mul(vd a, vd b) { return _mm512_mul_pd(a, b); }
static inline int vd_all_abs_le(vd v, double lim) {
  return _mm512_cmp_pd_mask(_mm512_abs_pd(v), _mm512_set1_pd(lim), _CMP_LE_OQ) == 0xFF;
}
static inline void vd_quadrant(vd t, vd s, vd c, vd *so, vd *co) {
  const __m512i b = _mm512_castpd_si512(t), two = _mm512_set1_epi64(2);
  const __mmask8 swap = _mm512_test_epi64_mask(b, _mm512_set1_epi64(1));
  const vd s1 = _mm512_mask_blend_pd(swap, s, c), c1 = _mm512_mask_blend_pd(swap, c, s);
  const __m512i ss = _mm512_slli_epi64(_mm512_and_si512(b, two), 62);
  const __m512i cs = _mm512_slli_epi64(_mm512_and_si512(_mm512_add_epi64(b, _mm512_set1_epi64(1)), two), 62);
  *so = _mm512_xor_pd(s1, _mm512_castsi512_pd(ss));
  *co = _mm512_xor_pd(c1, _mm512_castsi512_pd(cs));
}
static inline void vd_store_cs(float *C, float *S, float *N, vd c, vd s) {
  const __m256 cf = _mm512_cvtpd_ps(c), sf = _mm512_cvtpd_ps(s);
  _mm256_storeu_ps(C, cf);
  _mm256_storeu_ps(S, sf);
  _mm256_storeu_ps(N, _mm256_xor_ps(sf, _mm256_set1_ps(-0.0f)));
}
static inline void vd_store_cs_il(float *T1, float *T2, vd c, vd s) {
  const __m256 cf = _mm512_cvtpd_ps(c), sf = _mm512_cvtpd_ps(s), nf = _mm256_xor_ps(sf, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_unpacklo_ps(cf, sf), b = _mm256_unpackhi_ps(cf, sf); /* (c0 s0 c1 s1 | c4 s4 c5 s5) */
  const __m256 e = _mm256_unpacklo_ps(nf, cf), f = _mm256_unpackhi_ps(nf, cf);
  _mm256_storeu_ps(T1, _mm256_permute2f128_ps(a, b, 0x20));
  _mm256_storeu_ps(T1 + 8, _mm256_permute2f128_ps(a, b, 0x31));
  _mm256_storeu_ps(T2, _mm256_permute2f128_ps(e, f, 0x20));
  _mm256_storeu_ps(T2 + 8, _mm256_permute2f128_ps(e, f, 0x31));
}

/* a load kept in a register: not folded into each of its uses (rope's dup_even/dup_odd of one x
 * vector would otherwise load it twice, which costs when rows are not 64-byte aligned) */
static inline vf vf_load_reg(const float *p) {
  vf v = _mm512_loadu_ps(p);
  __asm__("" : "+v"(v));
  return v;
}
#endif
