/* Runtime CPU feature detection, compiled with the baseline flags only.
 * x86: CPUID leaves 1 and 7, and XGETBV(0) to check that the OS saves the AVX / AVX-512 state.
 * aarch64 Linux: getauxval(AT_HWCAP). Bits are CF_CPU_* below (mirrored in cpufuse/_isa.py). */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include "../cdef.h" /* the declaration cf_cpu_features is checked against */

enum {
  CF_CPU_AVX2 = 1 << 0, CF_CPU_FMA = 1 << 1, CF_CPU_F16C = 1 << 2, CF_CPU_OS_AVX = 1 << 3,
  CF_CPU_AVX512F = 1 << 4, CF_CPU_AVX512BW = 1 << 5, CF_CPU_AVX512VL = 1 << 6,
  CF_CPU_AVX512DQ = 1 << 7, CF_CPU_OS_AVX512 = 1 << 8, CF_CPU_AVX512FP16 = 1 << 9,
  CF_CPU_AMX = 1 << 10, CF_CPU_AVX512VNNI = 1 << 11, CF_CPU_NEON = 1 << 16, CF_CPU_FPHP = 1 << 17
};

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
/* Linux gives a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); without it the first tile instruction faults. 1 when granted. */
static int cf_amx_permit(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
  return 0;
#endif
}
static uint64_t cf_xgetbv0(void) {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}
uint32_t cf_cpu_features(void) {
  unsigned a, b, c, d, f = 0, max_leaf = __get_cpuid_max(0, 0);
  if (max_leaf < 1 || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
  int osxsave = (c >> 27) & 1;
  if (c & (1u << 12)) f |= CF_CPU_FMA;
  if (c & (1u << 29)) f |= CF_CPU_F16C;
  if (osxsave && (c & (1u << 28))) {
    uint64_t xcr0 = cf_xgetbv0();
    if ((xcr0 & 0x6) == 0x6) f |= CF_CPU_OS_AVX;             /* XMM + YMM state */
    if ((xcr0 & 0xe6) == 0xe6) f |= CF_CPU_OS_AVX512;         /* + opmask, ZMM_Hi256, Hi16_ZMM */
  }
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    if (b & (1u << 5)) f |= CF_CPU_AVX2;
    if (b & (1u << 16)) f |= CF_CPU_AVX512F;
    if (b & (1u << 17)) f |= CF_CPU_AVX512DQ;
    if (b & (1u << 30)) f |= CF_CPU_AVX512BW;
    if (b & (1u << 31)) f |= CF_CPU_AVX512VL;
    if (c & (1u << 11)) f |= CF_CPU_AVX512VNNI; /* CPUID.(EAX=7,ECX=0):ECX[11] */
    if (d & (1u << 23)) f |= CF_CPU_AVX512FP16;
    /* AMX usable: AMX-TILE (EDX[24]) and AMX-INT8 (EDX[25]), the OS enables the tile state in XCR0
     * (bits 17, 18), and grants this process its use */
    if ((d & (1u << 24)) && (d & (1u << 25)) && osxsave && (cf_xgetbv0() & (3ull << 17)) == (3ull << 17) &&
        cf_amx_permit())
      f |= CF_CPU_AMX;
  }
  return f;
}
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
uint32_t cf_cpu_features(void) {
  unsigned long hw = getauxval(AT_HWCAP);
  uint32_t f = 0;
  if (hw & (1ul << 1)) f |= CF_CPU_NEON; /* HWCAP_ASIMD */
  if (hw & (1ul << 10)) f |= CF_CPU_FPHP; /* HWCAP_ASIMDHP */
  return f;
}
#elif defined(__aarch64__)
uint32_t cf_cpu_features(void) { return CF_CPU_NEON; } /* NEON is architectural on arm64 */
#else
uint32_t cf_cpu_features(void) { return 0; }
#endif
