/* Integer block-dot helpers for the quantized matmul (native/kernels/quant.inc), AVX-512 build:
 * the AVX2 helpers (256-bit, as ggml's x86 vec_dot), with the integer dots done by AVX-512 VNNI
 * (VPDPBUSD on ymm, AVX512_VNNI + AVX512VL) when the build enables it (-mavx512vnni, the avx512
 * flags in cpufuse/_isa.py; the avx512 ISA then needs the avx512vnni CPU bit at run time, so
 * AVX-512 CPUs without VNNI, i.e. Skylake-SP/X, run the avx2 path).
 *
 * dpbusd sums the four u8 x s8 products of each int32 lane exactly, in one instruction; the AVX2
 * maddubs + madd pair gives the same int32 lane sums as long as maddubs does not saturate its
 * int16 pair sums. It never does here: unsigned weight codes are <= 31 (Q5_*), |sign-trick codes|
 * <= 128 (Q8_0; Q6_K <= 32) and activation codes are in [-127, 127], so a pair is at most
 * 2*128*127 = 32512. So the avx512 and avx2 paths give bit-identical results. */
#ifndef CF_SIMD_AVX512_Q_H
#define CF_SIMD_AVX512_Q_H
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* take the AVX2 header under other names for its two dots, then define the VNNI ones */
#define CF_QK_MR 4 /* 32 vector registers */
#define vi_dot_us cf_avx2_vi_dot_us
#define vi_dot_ss cf_avx2_vi_dot_ss
#define CF_HAVE_DOT_SC_ACC 1
#include "avx2_q.h"
/* acc + the scaled 16-bit pair sums in one VPDPWSSD: the accumulator is an operand, so the
 * compiler keeps one running sum per output instead of materializing every product */
static inline vi vi_dot_sc_acc(vi acc, vq u, vq a, vs s) { return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, a), s); }
#undef vi_dot_us
#undef vi_dot_ss
#define CF_Q_VNNI 1
/* unsigned codes u (0..255) times signed codes s: lane L = sum of u[e]*s[e], e = 4L..4L+3 */
static inline vi vi_dot_us(vq u, vq s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
/* signed times signed (sign trick into dpbusd: |a| as unsigned times sign(a)*b; |-128| reads as
 * the unsigned byte 128, so even a = -128 is exact) */
static inline vi vi_dot_ss(vq a, vq b) { return vi_dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }
#else
#include "avx2_q.h"
#define CF_Q_VNNI 0
#endif
#endif
