/* Block decoding for the quantized matmul's f32 mode and float weights (native/kernels/quant.inc),
 * AVX-512 build: the AVX2 helpers (those tiles work on 32-element blocks, 8 f32 lanes; the q8 mode
 * runs on P16 panels with AVX-512 VNNI, avx512_p.h). */
#ifndef CF_SIMD_AVX512_Q_H
#define CF_SIMD_AVX512_Q_H
#include "avx2_q.h"
#endif
