/* The scalar kernels, built only with the scalar flags of cpufuse/_isa.py: see isa.inc. */
#define CF_ISA scalar
#include "../simd/scalar.h"
#include "../simd/scalar_q.h"
#include "../simd/scalar_p.h"
#include "isa.inc"
