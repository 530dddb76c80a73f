/* The avx2 kernels: the generic bodies instantiated with native/simd/avx2.h.
 * Built only with the avx2 flags listed in cpufuse/_isa.py (the header's #error guard fails the
 * build otherwise). */
#define CF_ISA avx2
#include "../simd/avx2.h"
#include "../simd/avx2_q.h" /* int8 block-dot helpers for quant.inc */
#include "../kernels/body.inc"

/* What this translation unit was compiled with, for cpufuse.info() and the build-flag test:
 * CF_BUILD_FLAGS comes from the build; the macros are what the compiler really enabled. */
#ifndef CF_BUILD_FLAGS
#define CF_BUILD_FLAGS "?"
#endif
const char *cf_build_info__avx2(void) {
  return "flags=" CF_BUILD_FLAGS " macros="
#ifdef __SSE2__
         "SSE2 "
#endif
#ifdef __AVX__
         "AVX "
#endif
#ifdef __AVX2__
         "AVX2 "
#endif
#ifdef __FMA__
         "FMA "
#endif
#ifdef __F16C__
         "F16C "
#endif
#ifdef __AVX512F__
         "AVX512F "
#endif
#ifdef __AVX512BW__
         "AVX512BW "
#endif
#ifdef __AVX512VL__
         "AVX512VL "
#endif
#ifdef __AVX512DQ__
         "AVX512DQ "
#endif
#ifdef __ARM_NEON
         "NEON "
#endif
#ifdef __FAST_MATH__
         "FAST_MATH "
#endif
         ;
}
