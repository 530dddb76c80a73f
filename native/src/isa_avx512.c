/* The avx512 kernels, built only with the avx512 flags of cpufuse/_isa.py: see isa.inc. */
#define CF_ISA avx512
#include "../simd/avx512.h"
#include "../simd/avx512_q.h"
#include "../simd/avx512_p.h"
#include "isa.inc"
