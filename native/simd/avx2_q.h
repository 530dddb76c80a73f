/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), avx2. */
#ifndef CF_SIMD_AVX2_Q_H
#define CF_SIMD_AVX2_Q_H
#endif
