/* The amx kernels: the avx512 kernels, plus AMX tiles for the quantized GEMM (qamx.inc), built
 * only with the amx flags of cpufuse/_isa.py: see isa.inc. */
#define CF_ISA amx
#include "../simd/amx.h"
#include "../simd/avx512_q.h"
#include "../simd/avx512_p.h"
#define P16_GS 16 /* the activation scratch in groups of 16 rows: one tile's A operand */
#include "isa.inc"
