/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), avx512. */
#ifndef CF_SIMD_AVX512_Q_H
#define CF_SIMD_AVX512_Q_H
#endif
