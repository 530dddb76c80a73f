/* Shared definitions for the kernel bodies. No intrinsics here. */
#ifndef CF_KERNELS_COMMON_H
#define CF_KERNELS_COMMON_H
#include <stdint.h>
#include <stddef.h>

#define CF_CAT_(a, b) a##__##b
#define CF_CAT(a, b) CF_CAT_(a, b)
/* CF_FN(cf_softmax_f32) -> cf_softmax_f32__avx2 when CF_ISA is avx2 */
#define CF_FN(name) CF_CAT(name, CF_ISA)

#define CF_NEG_INF (-__builtin_inff())

/* exp (docs/semantics.md §6): ln2 split for the Cody-Waite reduction (n*CF_LN2_HI is exact for |n| < 2^15),
 * and the degree-5 polynomial e^r = 1 + r + r^2*(C2 + C3 r + C4 r^2 + C5 r^3) on |r| <= ln2/2:
 * an own weighted least-squares (Lawson) fit of the relative error, 1.05e-7 before rounding. */
#define CF_LN2_HI 0.693359375f
#define CF_LN2_LO (-2.12194440e-4f)
/* ln2 rounded to f32, for the one-constant reduction of vf_exp_le0: r = fma(-n, CF_LN2_F, x) is
 * off by n * 1.9e-9, i.e. about n/60 ulp: < 0.5 ulp where e^x > 1e-9, ~2 ulp near the flush point */
#define CF_LN2_F 0.693147182464599609375f
#define CF_EXP_C2 0.499992311000824f
#define CF_EXP_C3 0.16667114198207855f
#define CF_EXP_C4 0.04189010709524155f
#define CF_EXP_C5 0.008312512189149857f

#include <string.h>
#include <stdatomic.h>
#include <stdlib.h>
/* an A/B knob of the kernels: parse(getenv(name)) (NULL when unset; a value >= 0), read once per process into
 * *cache (-1 until then) */
static inline int cf_knob(atomic_int *cache, const char *name, int (*parse)(const char *)) {
  int v = atomic_load_explicit(cache, memory_order_relaxed);
  if (v < 0) {
    v = parse(getenv(name));
    atomic_store_explicit(cache, v, memory_order_relaxed);
  }
  return v;
}
/* cf_knob's parse of an on/off knob: on unless set to "0" */
static inline int cf_knob_on(const char *e) { return !(e && !strcmp(e, "0")); }
/* a count knob's value: atoi(e) where it lies in [lo, hi], else (or unset) dflt */
static inline int cf_knob_int(const char *e, int dflt, int lo, int hi) {
  const int x = e ? atoi(e) : dflt;
  return x >= lo && x <= hi ? x : dflt;
}

static inline float cf_h2f(uint16_t h) {
  /* exact binary16 -> binary32, including subnormals, inf and NaN */
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else { /* subnormal: normalize */
    int sh = 0;
    while (!(m & 0x400u)) { m <<= 1; sh++; }
    bits = sign | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* f32 -> binary16, round to nearest even; NaN stays NaN (quiet), overflow gives inf */
static inline uint16_t cf_f2h(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 (and inf) */
  if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal half */
    if (ax <= 0x33000000u) return (uint16_t)sign;           /* <= 2^-25: ties to even 0 */
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, sh = 126u - e;
    uint32_t q = m >> sh;
    const uint32_t rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  const uint32_t r = ax - 0x38000000u; /* rebias the exponent from 127 to 15 */
  uint32_t q = r >> 13;
  const uint32_t rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
  return (uint16_t)(sign | q);
}

/* Reduction chunk: partial sums stay in f32 vector lanes for this many elements, then are added
 * to an f64 total. Keeps the f32 error per lane tiny at every row length (docs/semantics.md §2, §3). */
#define CF_CHUNK 256

/* Descriptor layouts (int64 arrays, strides in elements), plan opcodes and record layouts:
 * generated from cpufuse/_layouts.py, which Python packs them with. */
#include "layouts.h"
#endif
