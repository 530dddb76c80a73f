/* The neon kernels, built only with the neon flags of cpufuse/_isa.py: see isa.inc. */
#define CF_ISA neon
#include "../simd/neon.h"
#include "../simd/neon_q.h"
#include "../simd/neon_p.h"
#include "isa.inc"
