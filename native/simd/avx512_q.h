/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), AVX-512 build:
 * the AVX2 helpers (256-bit, as ggml's x86 vec_dot). */
#ifndef CF_SIMD_AVX512_Q_H
#define CF_SIMD_AVX512_Q_H
#include "avx2_q.h"
#endif
