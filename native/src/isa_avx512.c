/* The avx512 kernels: the generic bodies instantiated with native/simd/avx512.h.
 * Built only with the avx512 flags listed in cpufuse/_isa.py (the header's #error guard fails the
 * build otherwise). */
#define CF_ISA avx512
#include "../simd/avx512.h"
#include "../simd/avx512_q.h" /* int8 block-dot helpers for quant.inc */
#include "../kernels/body.inc"

/* What this translation unit was compiled with, for cpufuse.info() and the build-flag test:
 * CF_BUILD_FLAGS comes from the build; the macros are what the compiler really enabled. */
#ifndef CF_BUILD_FLAGS
#define CF_BUILD_FLAGS "?"
#endif
const char *cf_build_info__avx512(void) {
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
#ifdef __AVX512VNNI__
         "AVX512VNNI "
#endif
#ifdef __ARM_NEON
         "NEON "
#endif
#ifdef __FAST_MATH__
         "FAST_MATH "
#endif
         ;
}
