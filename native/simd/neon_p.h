/* Panel vocabulary of the quantized matmul (native/kernels/qpanel.inc), NEON build: for now the
 * portable definitions of native/simd/scalar_p.h (same results; a NEON version is to come). */
#ifndef CF_SIMD_NEON_P_H
#define CF_SIMD_NEON_P_H
#include "scalar_p.h"
#endif
