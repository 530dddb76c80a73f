/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), neon. */
#ifndef CF_SIMD_NEON_Q_H
#define CF_SIMD_NEON_Q_H
#endif
