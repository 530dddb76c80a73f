/* The kernels' prototypes for the aarch64 test programs: native/cdef.h, included once for neon and
 * once for scalar (CF_FN(name) is name__<CF_ISA>, as in native/kernels/common.h). */
#ifndef CF_TESTS_PROTOS_H
#define CF_TESTS_PROTOS_H
#ifndef CF_FN
#define CF_CAT_(a, b) a##__##b
#define CF_CAT(a, b) CF_CAT_(a, b)
#define CF_FN(name) CF_CAT(name, CF_ISA)
#endif
#define CF_ISA neon
#include "../cdef.h"
#undef CF_ISA
#define CF_ISA scalar
#include "../cdef.h"
#undef CF_ISA
#endif
