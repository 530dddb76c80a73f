/* Panel vocabulary of the quantized matmul (native/kernels/qpanel.inc), aarch64 NEON. Semantics:
 * native/simd/avx512_p.h. A 16-lane panel value is four 128-bit registers, quarter q = panel
 * columns 4q..4q+3:
 *   p16c: one 64-byte code chunk as 4 x uint8x16_t (quarter q = chunk bytes 16q..16q+15, i.e.
 *         columns 4q..4q+3 with their 4 consecutive K codes each: the operand layout of SDOT);
 *   p16i: 4 x int32x4_t, p16f: 4 x float32x4_t (lane n = column n).
 * Integer dots, all exact (every int32 lane sum equals the true sum, so any grouping of the adds
 * gives the same value as the other ISAs, and the three builds below give the same bits):
 *   - plain armv8-a: SMULL/SMLAL (int8 x int8 -> int16), summed in int16 only as far as the code
 *     width keeps every lane below 2^15, then SADALP (pairwise widen-add into int32);
 *   - dot-product extension (__ARM_FEATURE_DOTPROD): SDOT by element, the weight quarter times one
 *     4-byte activation group taken from a register by lane index (no broadcasts); the P16_MR-row
 *     tile goes chunk by chunk across its rows (pi_dot_rows, qpanel.inc's optional hook);
 *   - i8mm (__ARM_FEATURE_MATMUL_INT8): the P16_MR-row tile runs SMMLA on row pairs
 *     (pi_dot_rows); one-row tiles keep SDOT.
 * Q8_0: without i8mm the stored codes (q + 128) are turned back into q (EOR 0x80 per weight vector)
 * and dotted signed, so P16_Q8_UNSIGNED is 0 (no offset term); with i8mm they are dotted as
 * unsigned by USDOT / USMMLA and P16_Q8_UNSIGNED is 1 (the -128 * sum(a) offset term). Every other
 * code is <= 63, so its signed int8 dot equals the unsigned one.
 * Floats: FMLA (fused, like the other SIMD ISAs) for pf_fma.
 * native/tests/neon_icount.py counts the tiles' instructions per panel block under qemu. */
#ifndef CF_SIMD_NEON_P_H
#define CF_SIMD_NEON_P_H
#include <arm_neon.h>
#include <string.h>
#include <stdint.h>

/* plain structs, not the NEON x4 tuple types: a tuple is one register group (4 consecutive
 * registers), which costs moves; a struct's members are allocated independently */
typedef struct { uint8x16_t val[4]; } p16c;
typedef struct { int32x4_t val[4]; } p16i;
typedef struct { float32x4_t val[4]; } p16f;

#ifndef P16_MR
#define P16_MR 8 /* activation rows per GEMM tile (fewest vector instructions per row of the counted MR 2..8) */
#endif
#define P16_SMALL 1 /* qpanel.inc's small-row tiles (4 and 2 rows) for the rows after whole groups (checked by the
                     * qemu test; not timed on ARM hardware) */
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define P16_Q8_UNSIGNED 1 /* USDOT dots the stored Q8_0 codes (q + 128) as unsigned */
#else
#define P16_Q8_UNSIGNED 0 /* Q8_0 codes are turned back into q and dotted signed */
#endif

static inline p16c pc_load(const uint8_t *p) {
  p16c r = {{vld1q_u8(p), vld1q_u8(p + 16), vld1q_u8(p + 32), vld1q_u8(p + 48)}};
  return r;
}
static inline void pc_store(uint8_t *p, p16c v) {
  for (int q = 0; q < 4; q++) vst1q_u8(p + 16 * q, v.val[q]);
}
static inline p16c pc_lo(p16c v) {
  const uint8x16_t m = vdupq_n_u8(15);
  for (int q = 0; q < 4; q++) v.val[q] = vandq_u8(v.val[q], m);
  return v;
}
static inline p16c pc_hi(p16c v) {
  for (int q = 0; q < 4; q++) v.val[q] = vshrq_n_u8(v.val[q], 4);
  return v;
}
static inline p16c pc_or(p16c a, p16c b) {
  for (int q = 0; q < 4; q++) a.val[q] = vorrq_u8(a.val[q], b.val[q]);
  return a;
}
/* byte i = 16 where bit i of the 64-bit plane at p is set, else 0: quarter q's bytes read plane
 * bytes 2q (first 8) and 2q + 1 (last 8), selected by TBL, tested bit by bit */
static inline p16c pc_bit16(const uint8_t *p) {
  static const uint8_t sel[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t pl = vreinterpretq_u8_u64(vld1q_dup_u64((const uint64_t *)(const void *)p));
  const uint8x16_t bit = vld1q_u8(sel), sixteen = vdupq_n_u8(16);
  p16c r;
  for (int q = 0; q < 4; q++) {
    const uint8x16_t idx = vcombine_u8(vdup_n_u8((uint8_t)(2 * q)), vdup_n_u8((uint8_t)(2 * q + 1)));
    r.val[q] = vandq_u8(vtstq_u8(vqtbl1q_u8(pl, idx), bit), sixteen);
  }
  return r;
}
/* byte i = ((v[i] >> sh) & 3) << 4, sh in 0, 2, 4, 6 */
static inline p16c pc_2bits(p16c v, int sh) {
  const uint8x16_t m = vdupq_n_u8((uint8_t)(3 << sh));
  for (int q = 0; q < 4; q++) {
    const uint8x16_t x = vandq_u8(v.val[q], m);
    v.val[q] = sh == 0 ? vshlq_n_u8(x, 4) : sh == 2 ? vshlq_n_u8(x, 2) : sh == 4 ? x : vshrq_n_u8(x, 2);
  }
  return v;
}
/* byte i = t[v[i]] (v's bytes 0..15): TBL */
static inline p16c pc_lut16(p16c v, const uint8_t *t) {
  const uint8x16_t tb = vld1q_u8(t);
  for (int q = 0; q < 4; q++) v.val[q] = vqtbl1q_u8(tb, v.val[q]);
  return v;
}
/* byte i = (v[i] >> sh) & 3, sh in 0, 2, 4, 6 */
static inline p16c pc_2b(p16c v, int sh) {
  const uint8x16_t m = vdupq_n_u8(3);
  for (int q = 0; q < 4; q++) {
    const uint8x16_t x = v.val[q];
    v.val[q] = vandq_u8(sh == 0 ? x : sh == 2 ? vshrq_n_u8(x, 2) : sh == 4 ? vshrq_n_u8(x, 4) : vshrq_n_u8(x, 6), m);
  }
  return v;
}
/* byte i = ((v[i] >> b) & 1) << pos: USHL by pos - b (negative: a right shift), then AND */
static inline p16c pc_bitsel(p16c v, int b, int pos) {
  const int8x16_t sh = vdupq_n_s8((int8_t)(pos - b));
  const uint8x16_t m = vdupq_n_u8((uint8_t)(1 << pos));
  for (int q = 0; q < 4; q++) v.val[q] = vandq_u8(vshlq_u8(v.val[q], sh), m);
  return v;
}

static inline p16i pi_set1(int32_t x) {
  p16i r;
  for (int q = 0; q < 4; q++) r.val[q] = vdupq_n_s32(x);
  return r;
}
static inline p16i pi_zero(void) { return pi_set1(0); }
static inline p16i pi_add(p16i a, p16i b) {
  for (int q = 0; q < 4; q++) a.val[q] = vaddq_s32(a.val[q], b.val[q]);
  return a;
}
static inline p16i pi_mul(p16i a, p16i b) {
  for (int q = 0; q < 4; q++) a.val[q] = vmulq_s32(a.val[q], b.val[q]);
  return a;
}
/* 16 unsigned / signed bytes -> 16 int32 */
static inline p16i pi_u8(const uint8_t *p) {
  const uint8x16_t v = vld1q_u8(p);
  const uint16x8_t l = vmovl_u8(vget_low_u8(v)), h = vmovl_high_u8(v);
  p16i r = {{vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(l))), vreinterpretq_s32_u32(vmovl_high_u16(l)),
             vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(h))), vreinterpretq_s32_u32(vmovl_high_u16(h))}};
  return r;
}
static inline p16i pi_i8(const uint8_t *p) {
  const int8x16_t v = vld1q_s8((const int8_t *)p);
  const int16x8_t l = vmovl_s8(vget_low_s8(v)), h = vmovl_high_s8(v);
  p16i r = {{vmovl_s16(vget_low_s16(l)), vmovl_high_s16(l), vmovl_s16(vget_low_s16(h)), vmovl_high_s16(h)}};
  return r;
}

#if defined(__ARM_FEATURE_DOTPROD)
/* acc + the 4-code dots of w's 4 columns with activation group `lane` (0..3) of av */
static inline int32x4_t p16_sdot(int32x4_t acc, int8x16_t w, int8x16_t av, int lane) {
  switch (lane) {
    case 0: return vdotq_laneq_s32(acc, w, av, 0);
    case 1: return vdotq_laneq_s32(acc, w, av, 1);
    case 2: return vdotq_laneq_s32(acc, w, av, 2);
    default: return vdotq_laneq_s32(acc, w, av, 3);
  }
}
/* acc + dot of 16 codes per lane: chunks w[0..3] (codes <= 127) against the 16 signed codes at a */
static inline p16i pi_dot4(p16i acc, const p16c *w, const uint8_t *a, int bits) {
  (void)bits;
  const int8x16_t av = vld1q_s8((const int8_t *)a);
  for (int q = 0; q < 4; q++)
    for (int c = 0; c < 4; c++) acc.val[q] = p16_sdot(acc.val[q], vreinterpretq_s8_u8(w[c].val[q]), av, c);
  return acc;
}
#else
/* quarter q of chunk c against activation group c (broadcast in ab): the int16 products of
 * columns 4q, 4q+1 (lo) and 4q+2, 4q+3 (hi), 4 consecutive lanes per column */
#define P16_MULL(w, ab) vmull_s8(vget_low_s8(vreinterpretq_s8_u8(w)), vget_low_s8(ab))
#define P16_MLAL(acc, w, ab) vmlal_s8(acc, vget_low_s8(vreinterpretq_s8_u8(w)), vget_low_s8(ab))
#define P16_MULLH(w, ab) vmull_high_s8(vreinterpretq_s8_u8(w), ab)
#define P16_MLALH(acc, w, ab) vmlal_high_s8(acc, vreinterpretq_s8_u8(w), ab)
static inline int8x16_t p16_grp(int8x16_t av, int c) { /* activation group c (4 bytes) in every lane */
  const int32x4_t v = vreinterpretq_s32_s8(av);
  return vreinterpretq_s8_s32(c == 0 ? vdupq_laneq_s32(v, 0) : c == 1 ? vdupq_laneq_s32(v, 1)
                              : c == 2 ? vdupq_laneq_s32(v, 2) : vdupq_laneq_s32(v, 3));
}
/* acc + dot of 16 codes per lane. Each int16 lane of lo/hi sums one product per chunk, then
 * SADDP-style pairing (vpaddq_s16) doubles that: codes < 2^bits, |a| <= 128, so 8 products fit
 * int16 for bits <= 5 (31 * 128 * 8 = 31744), 4 for bits 6 (63 * 128 * 4 = 32256); wider codes
 * take pi_dot8_q8 */
static inline p16i pi_dot4(p16i acc, const p16c *w, const uint8_t *a, int bits) {
  const int8x16_t av = vld1q_s8((const int8_t *)a);
  const int8x16_t g0 = p16_grp(av, 0), g1 = p16_grp(av, 1), g2 = p16_grp(av, 2), g3 = p16_grp(av, 3);
  for (int q = 0; q < 4; q++) {
    if (bits <= 5) {
      int16x8_t lo = P16_MULL(w[0].val[q], g0), hi = P16_MULLH(w[0].val[q], g0);
      lo = P16_MLAL(lo, w[1].val[q], g1), hi = P16_MLALH(hi, w[1].val[q], g1);
      lo = P16_MLAL(lo, w[2].val[q], g2), hi = P16_MLALH(hi, w[2].val[q], g2);
      lo = P16_MLAL(lo, w[3].val[q], g3), hi = P16_MLALH(hi, w[3].val[q], g3);
      acc.val[q] = vpadalq_s16(acc.val[q], vpaddq_s16(lo, hi));
    } else {
      int16x8_t lo = P16_MULL(w[0].val[q], g0), hi = P16_MULLH(w[0].val[q], g0);
      lo = P16_MLAL(lo, w[1].val[q], g1), hi = P16_MLALH(hi, w[1].val[q], g1);
      acc.val[q] = vpadalq_s16(acc.val[q], vpaddq_s16(lo, hi));
      lo = P16_MULL(w[2].val[q], g2), hi = P16_MULLH(w[2].val[q], g2);
      lo = P16_MLAL(lo, w[3].val[q], g3), hi = P16_MLALH(hi, w[3].val[q], g3);
      acc.val[q] = vpadalq_s16(acc.val[q], vpaddq_s16(lo, hi));
    }
  }
  return acc;
}
#endif

/* the Q8_0 dot: chunks w[0..7] hold the stored codes q + 128, a the 32 activation codes */
#if defined(__ARM_FEATURE_MATMUL_INT8)
/* USDOT: stored codes unsigned; init carries -128 * sum(a) (P16_Q8_UNSIGNED) */
static inline p16i pi_dot8_q8(p16i init, const p16c *w, const uint8_t *a) {
  const int8x16_t a0 = vld1q_s8((const int8_t *)a), a1 = vld1q_s8((const int8_t *)a + 16);
  for (int q = 0; q < 4; q++) {
    int32x4_t s = init.val[q];
    s = vusdotq_laneq_s32(s, w[0].val[q], a0, 0);
    s = vusdotq_laneq_s32(s, w[1].val[q], a0, 1);
    s = vusdotq_laneq_s32(s, w[2].val[q], a0, 2);
    s = vusdotq_laneq_s32(s, w[3].val[q], a0, 3);
    s = vusdotq_laneq_s32(s, w[4].val[q], a1, 0);
    s = vusdotq_laneq_s32(s, w[5].val[q], a1, 1);
    s = vusdotq_laneq_s32(s, w[6].val[q], a1, 2);
    init.val[q] = vusdotq_laneq_s32(s, w[7].val[q], a1, 3);
  }
  return init;
}
#elif defined(__ARM_FEATURE_DOTPROD)
static inline p16i pi_dot8_q8(p16i init, const p16c *w, const uint8_t *a) {
  const uint8x16_t x = vdupq_n_u8(0x80);
  p16c q[8];
  for (int g = 0; g < 8; g++)
    for (int k = 0; k < 4; k++) q[g].val[k] = veorq_u8(w[g].val[k], x);
  return pi_dot4(pi_dot4(init, q, a, 8), q + 4, a + 16, 8);
}
#else
/* q = code ^ 0x80 (-128..127) times a: one product per int16 lane, widened pairwise (SADALP) into
 * two int32 halves per column, joined by one ADDP: exact for any int8 operands */
static inline p16i pi_dot8_q8(p16i init, const p16c *w, const uint8_t *a) {
  const uint8x16_t x = vdupq_n_u8(0x80);
  const int8x16_t a0 = vld1q_s8((const int8_t *)a), a1 = vld1q_s8((const int8_t *)a + 16);
  int32x4_t lo[4], hi[4];
  for (int q = 0; q < 4; q++) lo[q] = hi[q] = vdupq_n_s32(0);
  for (int g = 0; g < 8; g++) {
    const int8x16_t ab = p16_grp(g < 4 ? a0 : a1, g & 3);
    for (int q = 0; q < 4; q++) {
      const uint8x16_t s = veorq_u8(w[g].val[q], x);
      lo[q] = vpadalq_s16(lo[q], P16_MULL(s, ab));
      hi[q] = vpadalq_s16(hi[q], P16_MULLH(s, ab));
    }
  }
  for (int q = 0; q < 4; q++) init.val[q] = vaddq_s32(init.val[q], vpaddq_s32(lo[q], hi[q]));
  return init;
}
#endif

/* The multi-row dots of a P16_MR tile (the optional hook of qpanel.inc, P16_DOT_ROWS), with the
 * dot-product extension: i[m] = (o ? o[m] : 0) + the dots of chunks w[0..nc-1] with the 4 nc codes
 * at a + 32 m. Plain armv8-a builds keep qpanel.inc's per-row dots. */
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define P16_DOT_ROWS 1
/* SMMLA (USMMLA for Q8_0's unsigned codes) on row pairs: one instruction multiplies 2 columns x 8
 * K codes by 2 rows x 8 K codes into a 2x2 int32 block [c0.r0, c0.r1, c1.r0, c1.r1]. The weights
 * need 8 consecutive K codes per column: chunks 2g and 2g+1 zipped by 32-bit lanes (ZIP1 of
 * quarter q: columns 4q, 4q+1; ZIP2: 4q+2, 4q+3); a row pair's codes are 8-byte halves of the two
 * rows side by side (LD4 of the pair's 64 bytes: group g = val[g]). The pair's int32 blocks are
 * unzipped (UZP1: the even row, UZP2: the odd row) once per call. Exact, like every dot here. */
#if P16_MR % 2
#error "the i8mm tile takes rows in pairs: P16_MR must be even"
#endif
static inline void pi_dot_rows(int MR, p16i *i, const int32_t *o, const p16c *w, int nc, const uint8_t *a, int bits) {
  uint8x16_t wz[4][8]; /* [K group of 8][column pair] */
  for (int g = 0; g < nc / 2; g++)
    for (int q = 0; q < 4; q++) {
      const uint32x4_t x = vreinterpretq_u32_u8(w[2 * g].val[q]), y = vreinterpretq_u32_u8(w[2 * g + 1].val[q]);
      wz[g][2 * q] = vreinterpretq_u8_u32(vzip1q_u32(x, y));
      wz[g][2 * q + 1] = vreinterpretq_u8_u32(vzip2q_u32(x, y));
    }
  for (int p = 0; p < MR / 2; p++) {
    const uint8_t *ap = a + 64 * p;
    int8x16_t av[4];
    if (nc == 8) {
      const int64x2x4_t v = vld4q_s64((const int64_t *)(const void *)ap);
      for (int g = 0; g < 4; g++) av[g] = vreinterpretq_s8_s64(v.val[g]);
    } else {
      const int64x2_t x = vreinterpretq_s64_u8(vld1q_u8(ap)), y = vreinterpretq_s64_u8(vld1q_u8(ap + 32));
      av[0] = vreinterpretq_s8_s64(vzip1q_s64(x, y));
      av[1] = vreinterpretq_s8_s64(vzip2q_s64(x, y));
    }
    /* [o0, o1, o0, o1], read as int32 (an int64 load of an int32 array the caller just wrote may be
     * reordered before those stores: strict aliasing) */
    const int32x4_t init = o ? vcombine_s32(vld1_s32(o + 2 * p), vld1_s32(o + 2 * p)) : vdupq_n_s32(0);
    int32x4_t acc[8];
    for (int j = 0; j < 8; j++) acc[j] = init;
    for (int g = 0; g < nc / 2; g++)
      for (int j = 0; j < 8; j++)
        acc[j] = bits == 8 ? vusmmlaq_s32(acc[j], wz[g][j], av[g]) : vmmlaq_s32(acc[j], vreinterpretq_s8_u8(wz[g][j]), av[g]);
    for (int q = 0; q < 4; q++) {
      i[2 * p].val[q] = vuzp1q_s32(acc[2 * q], acc[2 * q + 1]);
      i[2 * p + 1].val[q] = vuzp2q_s32(acc[2 * q], acc[2 * q + 1]);
    }
  }
}
#elif defined(__ARM_FEATURE_DOTPROD)
#define P16_DOT_ROWS 1
/* SDOT chunk by chunk across the rows: each weight vector feeds the MR rows' dots in turn */
static inline void pi_dot_rows(int MR, p16i *i, const int32_t *o, const p16c *w, int nc, const uint8_t *a, int bits) {
  int8x16_t av[P16_MR][2];
  for (int m = 0; m < MR; m++) {
    i[m] = o ? pi_set1(o[m]) : pi_zero();
    for (int h = 0; h < nc / 4; h++) av[m][h] = vld1q_s8((const int8_t *)a + 32 * m + 16 * h);
  }
#pragma GCC unroll 8
  for (int c = 0; c < nc; c++)
    for (int q = 0; q < 4; q++) {
      uint8x16_t x = w[c].val[q];
      if (bits == 8) x = veorq_u8(x, vdupq_n_u8(0x80));
      for (int m = 0; m < MR; m++) i[m].val[q] = p16_sdot(i[m].val[q], vreinterpretq_s8_u8(x), av[m][c >> 2], c & 3);
    }
}
#endif

/* The int16 pairs of pi_pair_u8 / pi_dpw. NEON keeps them unpaired: val[0] / val[2] = the lo
 * values of columns 0-7 / 8-15 as int16x8, val[1] / val[3] the hi values (a private layout: only
 * pi_dpw reads a pi_pair_u8 result). pi_dpw multiplies by element (SMLAL by lane), exact. */
static inline p16i pi_pair_u8(const uint8_t *lo, const uint8_t *hi) {
  const uint8x16_t l = vld1q_u8(lo), h = vld1q_u8(hi);
  p16i r = {{vreinterpretq_s32_u16(vmovl_u8(vget_low_u8(l))), vreinterpretq_s32_u16(vmovl_u8(vget_low_u8(h))),
             vreinterpretq_s32_u16(vmovl_high_u8(l)), vreinterpretq_s32_u16(vmovl_high_u8(h))}};
  return r;
}
static inline p16i pi_dpw(p16i acc, p16i w, int32_t a2) {
  const int16x4_t a = vreinterpret_s16_s32(vdup_n_s32(a2)); /* lanes lo, hi, lo, hi */
  for (int h = 0; h < 2; h++) {
    const int16x8_t l = vreinterpretq_s16_s32(w.val[2 * h]), u = vreinterpretq_s16_s32(w.val[2 * h + 1]);
    acc.val[2 * h] = vmlal_lane_s16(vmlal_lane_s16(acc.val[2 * h], vget_low_s16(l), a, 0), vget_low_s16(u), a, 1);
    acc.val[2 * h + 1] = vmlal_high_lane_s16(vmlal_high_lane_s16(acc.val[2 * h + 1], l, a, 0), u, a, 1);
  }
  return acc;
}

static inline p16f pf_set1(float x) {
  p16f r;
  for (int q = 0; q < 4; q++) r.val[q] = vdupq_n_f32(x);
  return r;
}
static inline p16f pf_zero(void) { return pf_set1(0.0f); }
static inline p16f pf_cvt(p16i a) {
  p16f r;
  for (int q = 0; q < 4; q++) r.val[q] = vcvtq_f32_s32(a.val[q]);
  return r;
}
static inline p16f pf_h16(const uint8_t *p) { /* 16 f16 -> f32 (exact) */
  const float16x8_t a = vreinterpretq_f16_u8(vld1q_u8(p)), b = vreinterpretq_f16_u8(vld1q_u8(p + 16));
  p16f r = {{vcvt_f32_f16(vget_low_f16(a)), vcvt_high_f32_f16(a), vcvt_f32_f16(vget_low_f16(b)), vcvt_high_f32_f16(b)}};
  return r;
}
static inline p16f pf_bits(p16i a) {
  p16f r;
  for (int q = 0; q < 4; q++) r.val[q] = vreinterpretq_f32_s32(a.val[q]);
  return r;
}
static inline p16f pf_loadf(const float *p) {
  p16f r;
  for (int q = 0; q < 4; q++) r.val[q] = vld1q_f32(p + 4 * q);
  return r;
}
static inline p16f pf_mul(p16f a, p16f b) {
  for (int q = 0; q < 4; q++) a.val[q] = vmulq_f32(a.val[q], b.val[q]);
  return a;
}
static inline p16f pf_fma(p16f a, p16f b, p16f c) { /* a * b + c, one rounding */
  for (int q = 0; q < 4; q++) c.val[q] = vfmaq_f32(c.val[q], a.val[q], b.val[q]);
  return c;
}
static inline p16f pf_neg(p16f a) {
  for (int q = 0; q < 4; q++) a.val[q] = vnegq_f32(a.val[q]);
  return a;
}
static inline void pf_store(float *y, p16f v, int n) {
  if (n >= 16) {
    for (int q = 0; q < 4; q++) vst1q_f32(y + 4 * q, v.val[q]);
    return;
  }
  float t[16];
  for (int q = 0; q < 4; q++) vst1q_f32(t + 4 * q, v.val[q]);
  memcpy(y, t, (size_t)n * sizeof(float));
}
#endif
