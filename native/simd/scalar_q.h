/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), scalar. */
#ifndef CF_SIMD_SCALAR_Q_H
#define CF_SIMD_SCALAR_Q_H
#endif
