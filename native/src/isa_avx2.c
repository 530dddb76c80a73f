/* The avx2 kernels, built only with the avx2 flags of cpufuse/_isa.py: see isa.inc. */
#define CF_ISA avx2
#include "../simd/avx2.h"
#include "../simd/avx2_q.h"
#include "../simd/avx2_p.h"
#include "isa.inc"
