/* The amx ISA: the avx512 kernels (this header brings its vocabulary), plus AMX tiles for the
 * quantized GEMM (native/kernels/qamx.inc, tile vocabulary in amx_tile.h). Built with the avx512
 * flags and -mamx-tile -mamx-int8; CF_AMX_EMULATE=1 builds it instead on any AVX-512 VNNI CPU with
 * the tile instructions emulated in C (a developer's test build, see docs/quant-design.md). */
#ifndef CF_SIMD_AMX_H
#define CF_SIMD_AMX_H
#if !defined(CF_AMX_EMULATE) && !(defined(__AMX_TILE__) && defined(__AMX_INT8__))
#error "the amx ISA needs -mamx-tile -mamx-int8 (cpufuse/_isa.py), or CF_AMX_EMULATE"
#endif
#include "avx512.h"
#define CF_HAVE_AMX 1
#endif
