/* Panel vocabulary of the quantized matmul (native/kernels/qpanel.inc), AVX2: a 16-lane panel
 * vector is two 256-bit halves (columns 0-7, 8-15). Dots are u8 x s8 VPMADDUBSW pairs summed in
 * 16 bits as far as the code width allows without overflow, then widened with VPMADDWD: exact
 * int32 results, the same as the AVX-512 VNNI dots. Semantics: see native/simd/avx512_p.h. */
#ifndef CF_SIMD_AVX2_P_H
#define CF_SIMD_AVX2_P_H
#include <immintrin.h>
#include <string.h>
#include <stdint.h>

typedef struct { __m256i lo, hi; } p16c;
typedef struct { __m256i lo, hi; } p16i;
typedef struct { __m256 lo, hi; } p16f;

#define P16_MR 4
#define P16_XR 8 /* the multi-row hooks' tiles of two activation groups (IQ4_NL, IQ4_XS, Q8_0) */
#define P16_Q8_UNSIGNED 0
/* The multi-row steps below (Q3_K's, Q4_K's, IQ4's, Q8_0's) each have two forms with the same exact
 * int32 sums: a C function of intrinsics (one a debugger steps through) and an inline-assembly string
 * that fixes the instruction order. P16_ASM_<STEP> 1 compiles the assembly; the defaults keep it only
 * where the A/B of docs/notes.md ("AVX2 multi-row steps: C or assembly") measured that it pays
 * (Q3_K's and Q4_K's steps, where GCC's own order of the C form spills). A build may set them, or all
 * at once with -DP16_AVX2_ASM=0 or 1. */
#ifdef P16_AVX2_ASM
#define P16_ASM_Q3K P16_AVX2_ASM
#define P16_ASM_K4 P16_AVX2_ASM
#define P16_ASM_IQ4 P16_AVX2_ASM
#define P16_ASM_Q8 P16_AVX2_ASM
#endif
#ifndef P16_ASM_Q3K
#define P16_ASM_Q3K 1
#endif
#ifndef P16_ASM_K4
#define P16_ASM_K4 1
#endif
#ifndef P16_ASM_IQ4
#define P16_ASM_IQ4 0
#endif
#ifndef P16_ASM_Q8
#define P16_ASM_Q8 0
#endif
/* the 4 bytes at p broadcast to every 32-bit lane */
static inline __m256i p16_bcast4(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

static inline uint32_t p16_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline p16c pc_load(const uint8_t *p) {
  p16c r = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
  return r;
}
static inline void pc_store(uint8_t *p, p16c v) {
  _mm256_storeu_si256((__m256i *)p, v.lo);
  _mm256_storeu_si256((__m256i *)(p + 32), v.hi);
}
static inline p16c pc_lo(p16c v) {
  const __m256i m = _mm256_set1_epi8(15);
  p16c r = {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
  return r;
}
static inline p16c pc_hi(p16c v) {
  const __m256i m = _mm256_set1_epi8(15);
  p16c r = {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
  return r;
}
static inline p16c pc_or(p16c a, p16c b) { p16c r = {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; return r; }
/* 32 bits -> 32 bytes: 16 where the bit is set */
static inline __m256i p16_bits32(uint32_t q) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)q), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
}
static inline p16c pc_bit16(const uint8_t *p) { p16c r = {p16_bits32(p16_rd32(p)), p16_bits32(p16_rd32(p + 4))}; return r; }
static inline __m256i p16_2bits(__m256i v, int sh) {
  const __m256i m = _mm256_and_si256(v, _mm256_set1_epi8((char)(3 << sh)));
  return sh <= 4 ? _mm256_slli_epi16(m, 4 - sh) : _mm256_srli_epi16(m, sh - 4);
}
static inline p16c pc_2bits(p16c v, int sh) { p16c r = {p16_2bits(v.lo, sh), p16_2bits(v.hi, sh)}; return r; }
/* byte i = t[v[i]] (v's bytes 0..15): VPSHUFB with the 16-byte table in both lanes */
static inline p16c pc_lut16(p16c v, const uint8_t *t) {
  const __m256i tb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
  p16c r = {_mm256_shuffle_epi8(tb, v.lo), _mm256_shuffle_epi8(tb, v.hi)};
  return r;
}
/* byte i = (v[i] >> sh) & 3 */
static inline p16c pc_2b(p16c v, int sh) {
  const __m256i m = _mm256_set1_epi8(3);
  p16c r = {_mm256_and_si256(_mm256_srli_epi16(v.lo, sh), m), _mm256_and_si256(_mm256_srli_epi16(v.hi, sh), m)};
  return r;
}
/* byte i = ((v[i] >> b) & 1) << pos: a 16-bit shift by b - pos (bits crossing bytes are masked off) */
static inline __m256i p16_bitsel(__m256i v, int b, int pos) {
  const __m256i x = b >= pos ? _mm256_srli_epi16(v, b - pos) : _mm256_slli_epi16(v, pos - b);
  return _mm256_and_si256(x, _mm256_set1_epi8((char)(1 << pos)));
}
static inline p16c pc_bitsel(p16c v, int b, int pos) { p16c r = {p16_bitsel(v.lo, b, pos), p16_bitsel(v.hi, b, pos)}; return r; }

static inline p16i pi_zero(void) { p16i r = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return r; }
static inline p16i pi_set1(int32_t v) { p16i r = {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; return r; }
static inline p16i pi_add(p16i a, p16i b) { p16i r = {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; return r; }
static inline p16i pi_mul(p16i a, p16i b) { p16i r = {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; return r; }
static inline p16i pi_u8(const uint8_t *p) {
  const __m128i v = _mm_loadu_si128((const __m128i *)p);
  p16i r = {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))};
  return r;
}
static inline p16i pi_i8(const uint8_t *p) {
  const __m128i v = _mm_loadu_si128((const __m128i *)p);
  p16i r = {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
  return r;
}
/* one half: acc + the dots of 4 chunks of unsigned codes of at most `bits` bits; u8 x s8 pairs are
 * at most 2 * (2^bits - 1) * 128 in magnitude, so 4 of them fit int16 up to 5 bits, 2 up to 6 */
static inline __m256i p16_dot4h(__m256i acc, __m256i w0, __m256i w1, __m256i w2, __m256i w3, const uint8_t *a, int bits) {
  const __m256i one = _mm256_set1_epi16(1);
  const __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_set1_epi32((int)p16_rd32(a)));
  const __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_set1_epi32((int)p16_rd32(a + 4)));
  const __m256i p2 = _mm256_maddubs_epi16(w2, _mm256_set1_epi32((int)p16_rd32(a + 8)));
  const __m256i p3 = _mm256_maddubs_epi16(w3, _mm256_set1_epi32((int)p16_rd32(a + 12)));
  if (bits <= 5)
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3)), one));
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), one));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(p2, p3), one));
}
static inline p16i pi_dot4(p16i acc, const p16c *w, const uint8_t *a, int bits) {
  p16i r = {p16_dot4h(acc.lo, w[0].lo, w[1].lo, w[2].lo, w[3].lo, a, bits),
          p16_dot4h(acc.hi, w[0].hi, w[1].hi, w[2].hi, w[3].hi, a, bits)};
  return r;
}
/* Q8_0: stored codes are q + 128; q = code ^ 0x80 as int8, dotted with the sign trick
 * (|q| unsigned times sign(q)*a: pairs <= 2*128*127, one pair sum per 16-bit lane) */
static inline __m256i p16_dots8h(__m256i acc, __m256i q, const uint8_t *a) {
  const __m256i av = _mm256_set1_epi32((int)p16_rd32(a));
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(av, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
/* the 8 chunks' dots, each chunk's bytes XORed with flip first (0x80: Q8_0's stored q + 128 back to q;
 * 0: the codes are q already, and the XOR folds away) */
static inline p16i p16_dot8x(p16i init, const p16c *w, const uint8_t *a, char flip) {
  const __m256i x = _mm256_set1_epi8(flip);
  for (int g = 0; g < 8; g++) {
    init.lo = p16_dots8h(init.lo, _mm256_xor_si256(w[g].lo, x), a + 4 * g);
    init.hi = p16_dots8h(init.hi, _mm256_xor_si256(w[g].hi, x), a + 4 * g);
  }
  return init;
}
static inline p16i pi_dot8_q8(p16i init, const p16c *w, const uint8_t *a) { return p16_dot8x(init, w, a, (char)0x80); }
/* the same dot of signed codes q held as they are (IQ4_NL / IQ4_XS: their table maps the 4-bit
 * codes straight to q, so no XOR; qpanel.inc's P16_IQ4_SIGNED hook) */
#define P16_IQ4_SIGNED 1
static inline p16i pi_dot8_s8(p16i init, const p16c *w, const uint8_t *a) { return p16_dot8x(init, w, a, 0); }
/* Scaled dots (qpanel.inc's pi_dot_sc): each column's scale as a 16-bit pair (lanes 2n, 2n + 1 of
 * its 32-bit lane), so the widening VPMADDWD multiplies by it: s * dot with no VPMULLD, and up to
 * 8 chunks of codes of at most 4 bits (4 of 5 bits, 2 of 6) summed in 16 bits before it. The exact
 * int32 result is that of pi_mul(pi_dot4(...), s), so the bits do not change. */
#define P16_DOT_SC 1
typedef struct { __m256i lo, hi; } p16s;
/* 16 unsigned scale bytes (one per column) + add, as 16-bit pairs */
static inline p16s ps_u8(const uint8_t *p, int32_t add) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
  const __m256i ml = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
                                      4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
  const __m256i mh = _mm256_add_epi8(ml, _mm256_set1_epi16(8)); /* +8 on the index bytes only */
  p16s r = {_mm256_shuffle_epi8(v, ml), _mm256_shuffle_epi8(v, mh)};
  if (add) {
    r.lo = _mm256_add_epi16(r.lo, _mm256_set1_epi16((short)add));
    r.hi = _mm256_add_epi16(r.hi, _mm256_set1_epi16((short)add));
  }
  return r;
}
/* one half: acc + s * (off + the dots of nc chunks w[c] with the 4 codes at a + 4c); off is added to
 * the first 16-bit sum (the caller keeps |off| + the sum's bound below 2^15) */
static inline __m256i p16_dotsch(__m256i acc, const p16c *w, int hi, int nc, const uint8_t *a, int bits, __m256i s,
                                 int32_t off) {
  const int gk = bits <= 4 ? 8 : bits == 5 ? 4 : 2; /* chunks per 16-bit sum: gk * 2 * (2^bits - 1) * 128 < 2^15 */
  for (int c0 = 0; c0 < nc; c0 += gk) {
    const int n = nc - c0 < gk ? nc - c0 : gk; /* 2, 4 or 8 */
#define P16_MAB(c) \
  _mm256_maddubs_epi16(hi ? w[c0 + (c)].hi : w[c0 + (c)].lo, _mm256_set1_epi32((int)p16_rd32(a + 4 * (c0 + (c)))))
    __m256i p = _mm256_add_epi16(P16_MAB(0), P16_MAB(1));
    if (n >= 4) p = _mm256_add_epi16(p, _mm256_add_epi16(P16_MAB(2), P16_MAB(3)));
    if (n == 8)
      p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_add_epi16(P16_MAB(4), P16_MAB(5)),
                                               _mm256_add_epi16(P16_MAB(6), P16_MAB(7))));
#undef P16_MAB
    if (off && c0 == 0) p = _mm256_add_epi16(p, _mm256_set1_epi32(off & 0xffff));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
  }
  return acc;
}
static inline p16i pi_dot_sc(p16i acc, const p16c *w, int nc, const uint8_t *a, int bits, p16s s, int32_t off) {
  p16i r = {p16_dotsch(acc.lo, w, 0, nc, a, bits, s.lo, off), p16_dotsch(acc.hi, w, 1, nc, a, bits, s.hi, off)};
  return r;
}
/* Q3_K one-row hook (qpanel.inc's P16_Q3K_ROW): acc + 256 * sum over g < 4 of (sc_g - 32) * (off[g] +
 * I_g), the sub-blocks j = 8h + 2g + s of one (h, s): codes u = ((v >> 2g) & 3) | (bit 4h + g of hv) << 2
 * over the 4 chunks at v + 64c, hv + 64c; the activation codes of g at a + astep * g; the 16 scale
 * bytes of g at sc + 32g; off[g] added to the low 16-bit half of each lane, as p16_dotsch's off. Each
 * half's 4 sums are formed chunk by chunk (the codes loaded once for the 4 sub-blocks; nothing
 * spills), and the scale sits in the high byte of each 16-bit pair, so VPMADDWD multiplies by
 * 256 (sc - 32) with no 16-bit add of -32. Each 16-bit lane's off + I_g is at most 8 * 4 * 128 in
 * magnitude, each term at most 2^26 and a super-block's 16 sub-blocks at most 2^30: exact, 256 times
 * qpanel.inc's S_s, whose float it gives exactly (times 2^-8). */
#define P16_Q3K_ROW 1
static inline p16i pi_q3k_row(p16i acc, const uint8_t *v, const uint8_t *hv, int h, const uint8_t *a, int64_t astep,
                              const uint8_t *sc, const int32_t *off) {
  const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4), k32 = _mm256_set1_epi8(32);
  const __m256i sl = _mm256_setr_epi8(-1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3,
                                      -1, 4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7);
  const __m256i sh = _mm256_add_epi8(sl, _mm256_set1_epi16(8 << 8)); /* +8 on the index bytes only */
  for (int hf = 0; hf < 2; hf++) {
    __m256i p[4];
    for (int g = 0; g < 4; g++) p[g] = _mm256_set1_epi32(off[g] & 0xffff); /* off once per 32-bit lane */
    for (int c = 0; c < 4; c++) {
      const __m256i x = _mm256_loadu_si256((const __m256i *)(v + 64 * c + 32 * hf));
      const __m256i y = _mm256_loadu_si256((const __m256i *)(hv + 64 * c + 32 * hf));
#pragma GCC unroll 4
      for (int g = 0; g < 4; g++) {
        const __m256i lo = _mm256_and_si256(g ? _mm256_srli_epi16(x, 2 * g) : x, m3);
        const int b = 4 * h + g;
        const __m256i hi = _mm256_and_si256(b > 2 ? _mm256_srli_epi16(y, b - 2) : b < 2 ? _mm256_slli_epi16(y, 2 - b) : y, m4);
        const __m256i av = _mm256_set1_epi32((int)p16_rd32(a + astep * g + 4 * c));
        p[g] = _mm256_add_epi16(p[g], _mm256_maddubs_epi16(_mm256_or_si256(lo, hi), av));
      }
    }
    __m256i r = hf ? acc.hi : acc.lo;
    for (int g = 0; g < 4; g++) {
      const __m256i sv = _mm256_sub_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(sc + 32 * g))), k32);
      r = _mm256_add_epi32(r, _mm256_madd_epi16(p[g], _mm256_shuffle_epi8(sv, hf ? sh : sl)));
    }
    if (hf) acc.hi = r;
    else acc.lo = r;
  }
  return acc;
}
/* Multi-row tile of Q3_K on its decoded panel (qpanel.inc's P16_Q3K_ROWS hook, p16_q3k_dec): a
 * super-block's sums S_s of the P16_MR rows, one 8-column half at a time, sub-block by sub-block: each
 * code chunk is loaded once for the rows, each row sums its offset and its 4 VPMADDUBSW pairs in 16
 * bits (the offset in the low half of each lane, as p16_dotsch's off) and multiplies them by the
 * sub-block's scale with one VPMADDWD. Live: 4 int32 sums, 4 16-bit sums, the chunk, the scale and a
 * product (11 of 16 ymm), so nothing spills. The values are the exact int32 sums of qpanel.inc's
 * tile. (The same step for Q2_K's packed 2-bit planes, shifted and masked once per chunk, measured no
 * faster than qpanel.inc's tile on Zen 3: 29.8 ms both, 4096x4096 x128.)
 * The step is in assembly, the order as written: GCC otherwise re-associates the 16-bit sums into
 * trees and starts all 16 products at once, which spills. P16_RS_P(m, c, X): row m's product with
 * chunk c (in w), then X on it. */
#define P16_RS_P(m, c, X) "vpbroadcastd (" #m "*32+" #c "*4)(%[a]), %[t]\n\t" "vpmaddubsw %[t], %[w], %[t]\n\t" X
#define P16_RS_ADD(m) "vpaddw %[t], %[p" #m "], %[p" #m "]\n\t"
#define P16_RS_F(m) P16_RS_P(m, 0, "vpbroadcastd " #m "*4(%[o]), %[p" #m "]\n\t" P16_RS_ADD(m))
#define P16_RS_C(c) "vmovdqu " #c "*64(%[v]), %[w]\n\t" P16_RS_P(0, c, P16_RS_ADD(0)) P16_RS_P(1, c, P16_RS_ADD(1)) \
  P16_RS_P(2, c, P16_RS_ADD(2)) P16_RS_P(3, c, P16_RS_ADD(3))
#define P16_RS_END(m) "vpmaddwd %[s], %[p" #m "], %[p" #m "]\n\t" "vpaddd %[p" #m "], %[c" #m "], %[c" #m "]\n\t"
_Static_assert(P16_MR == 4, "the assembly step holds 4 rows");
/* acc[m] (one half, 8 columns) += s * (off[m] + the row-m sum of the 4 chunks at v + 64c with the 4 codes
 * of row m at a + 32m + 4c); off[m] & 0xffff == off[m] */
#if !P16_ASM_Q3K
static inline __attribute__((always_inline)) void p16_rows_sub(__m256i *acc, const uint8_t *v, const uint8_t *a,
                                                               __m256i s, const int32_t *off) {
  __m256i p[P16_MR];
  for (int c = 0; c < 4; c++) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)(v + 64 * c));
    for (int m = 0; m < P16_MR; m++) {
      const __m256i t = _mm256_maddubs_epi16(w, p16_bcast4(a + 32 * m + 4 * c));
      p[m] = _mm256_add_epi16(c ? p[m] : _mm256_set1_epi32(off[m]), t);
    }
  }
  for (int m = 0; m < P16_MR; m++) acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p[m], s));
}
#else
static inline __attribute__((always_inline)) void p16_rows_sub(__m256i *acc, const uint8_t *v, const uint8_t *a,
                                                               __m256i s, const int32_t *off) {
  __m256i p0, p1, p2, p3, w, t;
  __asm__("vmovdqu (%[v]), %[w]\n\t" P16_RS_F(0) P16_RS_F(1) P16_RS_F(2) P16_RS_F(3) P16_RS_C(1) P16_RS_C(2)
              P16_RS_C(3) P16_RS_END(0) P16_RS_END(1) P16_RS_END(2) P16_RS_END(3)
          : [c0] "+x"(acc[0]), [c1] "+x"(acc[1]), [c2] "+x"(acc[2]), [c3] "+x"(acc[3]), [p0] "=&x"(p0),
            [p1] "=&x"(p1), [p2] "=&x"(p2), [p3] "=&x"(p3), [w] "=&x"(w), [t] "=&x"(t)
          : [v] "r"(v), [a] "r"(a), [s] "x"(s), [o] "r"(off), "m"(*(const uint8_t(*)[256])v),
            "m"(*(const uint8_t(*)[128])a), "m"(*(const int32_t(*)[4])off));
}
#endif
/* Q3_K: isc[m] = S_s of row m; the codes of sub-block j at v + 256j, its scale bytes at sc + 16j (the
 * scale sc_j - 32), row m's offset term of j at off[P16_MR j + m] as its low 16 bits (off & 0xffff), row
 * m's codes of 32-element block b of the super-block at a + astep b + 32m */
#define P16_Q3K_ROWS 1
static inline void pi_q3k_rows(p16i *isc, const uint8_t *v, const uint8_t *a, int64_t astep, const uint8_t *sc,
                               const int32_t *off) {
#pragma GCC unroll 2
  for (int hf = 0; hf < 2; hf++) {
    __m256i acc[P16_MR];
    for (int m = 0; m < P16_MR; m++) acc[m] = _mm256_setzero_si256();
    for (int j = 0; j < 16; j++) {
      const int h = j >> 3, g = (j >> 1) & 3, s = j & 1;
      const p16s sv = ps_u8(sc + 16 * j, -32);
      p16_rows_sub(acc, v + 256 * j + 32 * hf, a + astep * (4 * h + g) + 16 * s, hf ? sv.hi : sv.lo, off + P16_MR * j);
    }
    for (int m = 0; m < P16_MR; m++) {
      if (hf) isc[m].hi = acc[m];
      else isc[m].lo = acc[m];
    }
  }
}
/* Multi-row tile of Q4_K (qpanel.inc's P16_K4_ROWS hook): one sub-block of 32 codes for the P16_MR rows,
 * one 8-column half at a time: each of the record's 8 chunks is loaded and its nibbles (the low ones for
 * the even sub-block, the high ones for the odd) masked once for the rows; each row sums its 8
 * VPMADDUBSW products in 16 bits (8 * 2 * 15 * 127 < 2^15) and multiplies them by the sub-block's scale
 * with one VPMADDWD. Live: 4 int32 sums, 4 16-bit sums, the chunk, a product, the mask and the scale. In
 * assembly for the order as written (as P16_RS_*). */
#define P16_K4_F(m, c) P16_RS_P(m, c, "vmovdqa %[t], %[p" #m "]\n\t")
#define P16_K4_A(m, c) P16_RS_P(m, c, P16_RS_ADD(m))
#define P16_K4_W(c, X) "vmovdqu " #c "*64(%[v]), %[w]\n\t" X "vpand %[m0f], %[w], %[w]\n\t"
#define P16_K4_C(c, X, R) P16_K4_W(c, X) R(0, c) R(1, c) R(2, c) R(3, c)
#define P16_K4_ASM(X)                                                                                       \
  __asm__(P16_K4_C(0, X, P16_K4_F) P16_K4_C(1, X, P16_K4_A) P16_K4_C(2, X, P16_K4_A) P16_K4_C(3, X, P16_K4_A)    \
              P16_K4_C(4, X, P16_K4_A) P16_K4_C(5, X, P16_K4_A) P16_K4_C(6, X, P16_K4_A) P16_K4_C(7, X, P16_K4_A) \
                  P16_RS_END(0) P16_RS_END(1) P16_RS_END(2) P16_RS_END(3)                                        \
          : [c0] "+x"(acc[0]), [c1] "+x"(acc[1]), [c2] "+x"(acc[2]), [c3] "+x"(acc[3]), [p0] "=&x"(p0),        \
            [p1] "=&x"(p1), [p2] "=&x"(p2), [p3] "=&x"(p3), [w] "=&x"(w), [t] "=&x"(t)                          \
          : [v] "r"(v), [a] "r"(a), [s] "x"(s), [m0f] "x"(m0f), "m"(*(const uint8_t(*)[512])v),               \
            "m"(*(const uint8_t(*)[128])a))
/* acc[m] (one half) += s * (row m's dot of the 32 codes at a + 32m with the nibbles of the 8 chunks at
 * v + 64c: the low ones if !hi, else the high ones) */
#if !P16_ASM_K4
static inline __attribute__((always_inline)) void p16_k4_rows_sub(__m256i *acc, const uint8_t *v, const uint8_t *a,
                                                                  __m256i s, int hi) {
  __m256i p[P16_MR];
  const __m256i m0f = _mm256_set1_epi8(15);
  for (int c = 0; c < 8; c++) {
    __m256i w = _mm256_loadu_si256((const __m256i *)(v + 64 * c));
    if (hi) w = _mm256_srli_epi16(w, 4);
    w = _mm256_and_si256(w, m0f);
    for (int m = 0; m < P16_MR; m++) {
      const __m256i t = _mm256_maddubs_epi16(w, p16_bcast4(a + 32 * m + 4 * c));
      p[m] = c ? _mm256_add_epi16(p[m], t) : t;
    }
  }
  for (int m = 0; m < P16_MR; m++) acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p[m], s));
}
#else
static inline __attribute__((always_inline)) void p16_k4_rows_sub(__m256i *acc, const uint8_t *v, const uint8_t *a,
                                                                  __m256i s, int hi) {
  __m256i p0, p1, p2, p3, w, t;
  const __m256i m0f = _mm256_set1_epi8(15);
  if (hi)
    P16_K4_ASM("vpsrlw $4, %[w], %[w]\n\t");
  else
    P16_K4_ASM("");
}
#endif
#define P16_K4_ROWS 1
/* Q4_K: isc[m] += the super-block's scaled sums S_s of row m; the record of sub-blocks 2g, 2g + 1 at
 * rec + 512 g, the scale bytes of sub-block j at sc + 16 j, row m's codes of sub-block j at a[j] + 32 m */
static inline void pi_k4_rows(p16i *isc, const uint8_t *rec, const uint8_t *const *a, const uint8_t *sc) {
#pragma GCC unroll 2
  for (int hf = 0; hf < 2; hf++) {
    __m256i acc[P16_MR];
    for (int m = 0; m < P16_MR; m++) acc[m] = hf ? isc[m].hi : isc[m].lo;
    for (int j = 0; j < 8; j++) {
      const p16s sv = ps_u8(sc + 16 * j, 0);
      p16_k4_rows_sub(acc, rec + 512 * (j >> 1) + 32 * hf, a[j], hf ? sv.hi : sv.lo, j & 1);
    }
    for (int m = 0; m < P16_MR; m++) {
      if (hf) isc[m].hi = acc[m];
      else isc[m].lo = acc[m];
    }
  }
}
/* Multi-row tiles of IQ4_NL and IQ4_XS (qpanel.inc's P16_IQ4_ROWS hook): the dots of one 32-element
 * block for nr = 4 or 8 rows (one activation group of P16_MR rows at a0, or two, the second at a1),
 * one 8-column half at a time, chunk by chunk: each chunk of nibbles is mapped to its signed values
 * q and |q| once for the rows (VPSHUFB, VPSIGNB), and each row adds s * (|q| . sign(q) a) by VPSIGNB,
 * VPMADDUBSW and a VPMADDWD by s: the scale pairs of IQ4_XS's sub-block (its VPMULLD saved), ones for
 * IQ4_NL. The activations are within +-127 (Q8_0's and Q8_K's codes), so each pair sum fits 16 bits,
 * as in p16_dots8h. Live: nr sums, the raw nibbles, q, |q|, a product, the table, the mask and s (at
 * most 15 of 16 ymm). In assembly for the order as written (as P16_RS_*). P16_IQ_G(o, X, R): the rows
 * R's products with the chunk of the activation codes at offset o, X putting the nibbles into q. */
#define P16_IQ_R(m, b, r, o)                                                                                  \
  "vpbroadcastd (" #r "*32+" #o ")(%[" #b "]), %[t]\n\t" "vpsignb %[q], %[t], %[t]\n\t"                        \
  "vpmaddubsw %[t], %[aq], %[t]\n\t" "vpmaddwd %[s], %[t], %[t]\n\t" "vpaddd %[t], %[i" #m "], %[i" #m "]\n\t"
#define P16_IQ_R4(o) P16_IQ_R(0, a0, 0, o) P16_IQ_R(1, a0, 1, o) P16_IQ_R(2, a0, 2, o) P16_IQ_R(3, a0, 3, o)
#define P16_IQ_R8(o) P16_IQ_R4(o) P16_IQ_R(4, a1, 0, o) P16_IQ_R(5, a1, 1, o) P16_IQ_R(6, a1, 2, o) P16_IQ_R(7, a1, 3, o)
#define P16_IQ_G(o, X, R) X "vpshufb %[q], %[tab], %[q]\n\t" "vpsignb %[q], %[q], %[aq]\n\t" R(o)
#define P16_IQ_C(c, R)                                                                                        \
  P16_IQ_G(c*4, "vmovdqu " #c "*64(%[v]), %[raw]\n\t" "vpand %[m0f], %[raw], %[q]\n\t", R)                     \
  P16_IQ_G(16+c*4, "vpsrlw $4, %[raw], %[raw]\n\t" "vpand %[m0f], %[raw], %[q]\n\t", R)
#define P16_IQ_ASM(R, ...)                                                                                    \
  __asm__(P16_IQ_C(0, R) P16_IQ_C(1, R) P16_IQ_C(2, R) P16_IQ_C(3, R)                                          \
          : [i0] "+x"(i[0]), [i1] "+x"(i[1]), [i2] "+x"(i[2]), [i3] "+x"(i[3]), [raw] "=&x"(raw), [q] "=&x"(q), \
            [aq] "=&x"(aq), [t] "=&x"(t) __VA_ARGS__                                                         \
          : [v] "r"(v), [a0] "r"(a0), [a1] "r"(a1), [tab] "x"(tab), [s] "x"(s), [m0f] "x"(m0f),               \
            "m"(*(const uint8_t(*)[256])v), "m"(*(const uint8_t(*)[128])a0), "m"(*(const uint8_t(*)[128])a1))
/* i[m] += s * (|q| . sign(q) (the 4 codes of row m at offset o)) for nr rows: rows 0..3 at a0 + 32m,
 * 4..7 at a1 + 32(m - 4) */
static inline __attribute__((always_inline)) void p16_qrows_step(int nr, __m256i *i, __m256i q, __m256i aq,
                                                                 const uint8_t *a0, const uint8_t *a1, int o,
                                                                 __m256i s) {
  for (int m = 0; m < nr; m++) {
    const __m256i t = _mm256_sign_epi8(p16_bcast4((m < 4 ? a0 + 32 * m : a1 + 32 * (m - 4)) + o), q);
    i[m] = _mm256_add_epi32(i[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, t), s));
  }
}
/* i[m] (one half: 8 columns) += s * (the dot of row m's 32 codes at a0 + 32m (rows 4..7: a1 + 32 (m - 4))
 * with the block's values: the 4 nibble chunks at v + 64c, low nibbles elements 4c.., high 16 + 4c..;
 * tab: the 16 values) */
#if !P16_ASM_IQ4
static inline __attribute__((always_inline)) void p16_iq4_rows_h(int nr, __m256i *i, const uint8_t *v,
                                                                 const uint8_t *a0, const uint8_t *a1, __m256i tab,
                                                                 __m256i s) {
  const __m256i m0f = _mm256_set1_epi8(15);
  for (int c = 0; c < 4; c++) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(v + 64 * c));
    for (int h = 0; h < 2; h++) {
      const __m256i q = _mm256_shuffle_epi8(tab, _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m0f));
      p16_qrows_step(nr, i, q, _mm256_sign_epi8(q, q), a0, a1, 16 * h + 4 * c, s);
    }
  }
}
#else
static inline __attribute__((always_inline)) void p16_iq4_rows_h(int nr, __m256i *i, const uint8_t *v,
                                                                 const uint8_t *a0, const uint8_t *a1, __m256i tab,
                                                                 __m256i s) {
  __m256i raw, q, aq, t;
  const __m256i m0f = _mm256_set1_epi8(15);
  if (nr == 8)
    P16_IQ_ASM(P16_IQ_R8, , [i4] "+x"(i[4]), [i5] "+x"(i[5]), [i6] "+x"(i[6]), [i7] "+x"(i[7]));
  else
    P16_IQ_ASM(P16_IQ_R4, );
}
#endif
#define P16_IQ4_ROWS 1
/* Q8_0's multi-row tiles (qpanel.inc's P16_Q8_ROWS hook), as the IQ4 ones above: per chunk of 4 codes
 * the stored bytes (q + 128) are XORed back to q and |q| formed once for the rows; each row adds
 * |q| . sign(q) a (VPSIGNB, VPMADDUBSW, VPMADDWD by ones). Pair sums are at most 2 * 128 * 127. */
#define P16_Q8_C(c, R)                                                                                        \
  "vmovdqu " #c "*64(%[v]), %[q]\n\t" "vpxor %[x80], %[q], %[q]\n\t" "vpsignb %[q], %[q], %[aq]\n\t" R(c*4)
#define P16_Q8_ASM(R, ...)                                                                                    \
  __asm__(P16_Q8_C(0, R) P16_Q8_C(1, R) P16_Q8_C(2, R) P16_Q8_C(3, R) P16_Q8_C(4, R) P16_Q8_C(5, R)            \
          P16_Q8_C(6, R) P16_Q8_C(7, R)                                                                       \
          : [i0] "+x"(i[0]), [i1] "+x"(i[1]), [i2] "+x"(i[2]), [i3] "+x"(i[3]), [q] "=&x"(q), [aq] "=&x"(aq),   \
            [t] "=&x"(t) __VA_ARGS__                                                                          \
          : [v] "r"(v), [a0] "r"(a0), [a1] "r"(a1), [x80] "x"(x80), [s] "x"(s),                               \
            "m"(*(const uint8_t(*)[512])v), "m"(*(const uint8_t(*)[128])a0), "m"(*(const uint8_t(*)[128])a1))
/* i[m] (one half) += the dot of row m's 32 codes (at a0 + 32m; rows 4..7 at a1 + 32(m - 4)) with the 8
 * chunks of stored codes at v + 64g */
#if !P16_ASM_Q8
static inline __attribute__((always_inline)) void p16_q8_rows_h(int nr, __m256i *i, const uint8_t *v,
                                                                const uint8_t *a0, const uint8_t *a1) {
  const __m256i x80 = _mm256_set1_epi8((char)0x80), s = _mm256_set1_epi16(1);
  for (int c = 0; c < 8; c++) {
    const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(v + 64 * c)), x80);
    p16_qrows_step(nr, i, q, _mm256_sign_epi8(q, q), a0, a1, 4 * c, s);
  }
}
#else
static inline __attribute__((always_inline)) void p16_q8_rows_h(int nr, __m256i *i, const uint8_t *v,
                                                                const uint8_t *a0, const uint8_t *a1) {
  __m256i q, aq, t;
  const __m256i x80 = _mm256_set1_epi8((char)0x80), s = _mm256_set1_epi16(1);
  if (nr == 8)
    P16_Q8_ASM(P16_IQ_R8, , [i4] "+x"(i[4]), [i5] "+x"(i[5]), [i6] "+x"(i[6]), [i7] "+x"(i[7]));
  else
    P16_Q8_ASM(P16_IQ_R4, );
}
#endif
#define P16_Q8_ROWS 1
/* the two 8-column halves of an IQ4 (q8 = 0) or Q8_0 (q8 = 1) step for nr = 4 or 8 rows: acc[m] += s * the
 * dots of the block at v with the codes at a0, a1; s from ps_u8 (NULL: 1); tab: IQ4's values */
static inline __attribute__((always_inline)) void p16_rows2(int q8, int nr, p16i *acc, const uint8_t *v, const uint8_t *a0,
                                                            const uint8_t *a1, const uint8_t *table, const p16s *s) {
  const __m256i tab = q8 ? _mm256_setzero_si256() : _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
  const __m256i one = _mm256_set1_epi16(1);
  __m256i i[8];
  for (int m = 0; m < nr; m++) i[m] = acc[m].lo;
  if (q8) p16_q8_rows_h(nr, i, v, a0, a1);
  else p16_iq4_rows_h(nr, i, v, a0, a1, tab, s ? s->lo : one);
  for (int m = 0; m < nr; m++) {
    acc[m].lo = i[m];
    i[m] = acc[m].hi;
  }
  if (q8) p16_q8_rows_h(nr, i, v + 32, a0, a1);
  else p16_iq4_rows_h(nr, i, v + 32, a0, a1, tab, s ? s->hi : one);
  for (int m = 0; m < nr; m++) acc[m].hi = i[m];
}
/* acc[m] += s * (the IQ4 block's dots) / (the Q8_0 panel block's dots, its 8 chunks at v) for nr rows */
static inline __attribute__((always_inline)) void pi_iq4_rows(int nr, p16i *acc, const uint8_t *v, const uint8_t *a0,
                                                              const uint8_t *a1, const uint8_t *table, const p16s *s) {
  p16_rows2(0, nr, acc, v, a0, a1, table, s);
}
static inline __attribute__((always_inline)) void pi_q8_rows(int nr, p16i *acc, const uint8_t *v, const uint8_t *a0,
                                                             const uint8_t *a1) {
  p16_rows2(1, nr, acc, v, a0, a1, NULL, NULL);
}
static inline p16i pi_dpw(p16i acc, p16i w, int32_t a2) {
  const __m256i av = _mm256_set1_epi32(a2);
  p16i r = {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(w.lo, av)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(w.hi, av))};
  return r;
}
/* 16 + 16 unsigned bytes -> 16-bit pairs (lo[n], hi[n]): the bytes interleaved, then widened */
static inline p16i pi_pair_u8(const uint8_t *lo, const uint8_t *hi) {
  const __m128i l = _mm_loadu_si128((const __m128i *)lo), h = _mm_loadu_si128((const __m128i *)hi);
  p16i r = {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(l, h)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(l, h))};
  return r;
}

static inline p16f pf_zero(void) { p16f r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline p16f pf_set1(float v) { p16f r = {_mm256_set1_ps(v), _mm256_set1_ps(v)}; return r; }
static inline p16f pf_cvt(p16i a) { p16f r = {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; return r; }
static inline p16f pf_h16(const uint8_t *p) {
  p16f r = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
  return r;
}
static inline p16f pf_bits(p16i a) { p16f r = {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; return r; }
static inline p16f pf_loadf(const float *p) { p16f r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline p16f pf_mul(p16f a, p16f b) { p16f r = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; return r; }
static inline p16f pf_fma(p16f a, p16f b, p16f c) { p16f r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; return r; }
static inline p16f pf_neg(p16f a) {
  const __m256 s = _mm256_set1_ps(-0.0f);
  p16f r = {_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
  return r;
}
static inline void pf_store(float *y, p16f v, int n) {
  if (n >= 16) {
    _mm256_storeu_ps(y, v.lo);
    _mm256_storeu_ps(y + 8, v.hi);
    return;
  }
  float t[16];
  _mm256_storeu_ps(t, v.lo);
  _mm256_storeu_ps(t + 8, v.hi);
  memcpy(y, t, (size_t)n * sizeof(float));
}
#endif
