/* The throttled read probe (E1) and the clock check (E8) of docs/benchmarks.md, one thread (the
 * caller pins it). Built and run by bench/throttle.py: cc -O2 -march=native throttle.c.
 *
 * E1: stream a buffer one 64-byte line per step, with W units of vector work per line. A unit is
 * one VPMADDWD + VPADDD per 32 bytes of the line (AVX-512: one zmm; AVX2: two ymm) into 4
 * rotating accumulators. Two modes with the same instructions:
 *   indep: the work multiplies a register that does not come from memory (the load only feeds a
 *          running sum), so the loads never wait on the work;
 *   dep:   the work multiplies the loaded vector, as a kernel's unpack and dot do.
 * Each unit passes its operand through an empty asm, so the compiler can neither hoist nor merge
 * the units. Timed over a small buffer (in L2) and a 1 GiB one (from DRAM): if DRAM time per line
 * is max(DRAM at W = 0, L2 time), the hardware overlaps the work with the misses; if it is their
 * sum in dep mode only, the out-of-order window limits the misses in flight; if in both, a
 * prefetch or miss-buffer cap does.
 *
 * E8: cycles from a chain of dependent scalar adds (one cycle each), timed idle and right after
 * 100 ms of the widest int8 dot this CPU has (AVX-512 VNNI / AVX2), to see a frequency drop.
 *
 * E4: the buffer on 4 KiB pages (MADV_NOHUGEPAGE) or, with the 4th argument "thp", on transparent
 * huge pages (MADV_HUGEPAGE).
 *
 * Prints one JSON object. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VEC "avx512"
typedef __m512i V;
#define NV 1 /* vectors per line */
#define LD(p) _mm512_load_si512((const void *)(p))
#define MADD _mm512_madd_epi16
#define ADD _mm512_add_epi32
#define SET1(x) _mm512_set1_epi16((short)(x))
#define ZERO _mm512_setzero_si512()
#define OPK "+v"
#else
#define VEC "avx2"
typedef __m256i V;
#define NV 2
#define LD(p) _mm256_load_si256((const __m256i *)(p))
#define MADD _mm256_madd_epi16
#define ADD _mm256_add_epi32
#define SET1(x) _mm256_set1_epi16((short)(x))
#define ZERO _mm256_setzero_si256()
#define OPK "+x"
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* one pass over n lines with W units per line; DEP: the units take the loaded vectors. Scalars,
 * not arrays, and two constants, so everything stays in registers (a spilled running sum is a
 * store-to-load chain per line, which alone costs more than a line from L2). */
#if NV == 2
#define UNIT(a, c)                                                                                          \
  __asm__ volatile("" : OPK(x0), OPK(x1));                                                                  \
  a = ADD(a, ADD(MADD(x0, c), MADD(x1, c)))
#define LOADS(DEP)                                                                                          \
  const V l0 = LD(buf + 64 * i), l1 = LD(buf + 64 * i + 32);                                                \
  V x0 = DEP ? l0 : r0, x1 = DEP ? l1 : r1;                                                                 \
  sink = ADD(sink, ADD(l0, l1))
#else
#define UNIT(a, c)                                                                                          \
  __asm__ volatile("" : OPK(x0));                                                                           \
  a = ADD(a, MADD(x0, c))
#define LOADS(DEP)                                                                                          \
  const V l0 = LD(buf + 64 * i);                                                                            \
  V x0 = DEP ? l0 : r0;                                                                                     \
  sink = ADD(sink, l0)
#endif
#define PASS(name, DEP)                                                                                     \
  static int32_t name(const uint8_t *buf, int64_t n, int W) {                                               \
    V a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, sink = ZERO, r0 = SET1(1), r1 = SET1(2);                  \
    const V c0 = SET1(3), c1 = SET1(5);                                                                     \
    (void)r1;                                                                                               \
    for (int64_t i = 0; i < n; i++) {                                                                       \
      LOADS(DEP);                                                                                           \
      int u = 0;                                                                                            \
      for (; u + 4 <= W; u += 4) {                                                                          \
        UNIT(a0, c0);                                                                                       \
        UNIT(a1, c1);                                                                                       \
        UNIT(a2, c0);                                                                                       \
        UNIT(a3, c1);                                                                                       \
      }                                                                                                     \
      for (; u < W; u++) { UNIT(a0, c0); }                                                                  \
    }                                                                                                       \
    V t = ADD(ADD(a0, a1), ADD(ADD(a2, a3), sink));                                                         \
    int32_t o[16], r = 0;                                                                                   \
    memcpy(o, &t, sizeof t);                                                                                \
    for (size_t k = 0; k < sizeof t / 4; k++) r += o[k];                                                    \
    return r;                                                                                               \
  }
PASS(pass_indep, 0)
PASS(pass_dep, 1)
static int32_t pass(const uint8_t *buf, int64_t n, int W, int dep) {
  return dep ? pass_dep(buf, n, W) : pass_indep(buf, n, W);
}

/* ns per line: the median of reps passes; small buffers: the fastest of reps runs of >= 2 ms each
 * (a preemption or a neighbour's burst only slows a run) */
#define MAX_REPS 32 /* bench/throttle.py's MAX_REPS */
static double time_lines(const uint8_t *buf, int64_t n, int small, int W, int dep, int reps, int32_t *sink) {
  double best[MAX_REPS];
  int64_t inner = 1;
  if (small) {
    double t0 = now();
    *sink += pass(buf, n, W, dep);
    double dt = now() - t0;
    inner = dt > 0 ? (int64_t)(2e-3 / dt) + 1 : 1000;
  }
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    for (int64_t k = 0; k < inner; k++) *sink += pass(buf, n, W, dep);
    best[r] = (now() - t0) / (double)(inner * n) * 1e9;
  }
  for (int i = 1; i < reps; i++) /* insertion sort, then the median */
    for (int j = i; j > 0 && best[j] < best[j - 1]; j--) {
      double s = best[j];
      best[j] = best[j - 1];
      best[j - 1] = s;
    }
  return small ? best[0] : best[reps / 2];
}

/* GHz from 8 dependent register adds per iteration (a register operand: Golden Cove's renamer folds
 * chains of add-immediate, which then read 5-11 "GHz" on the Xeon) */
static double clock_ghz(int64_t iters) {
  uint64_t x = 0, y = 1;
  __asm__ volatile("" : "+r"(y));
  double t0 = now();
  for (int64_t i = 0; i < iters; i++)
    __asm__ volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                     "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0" : "+r"(x) : "r"(y));
  return 8.0 * (double)iters / ((now() - t0) * 1e9);
}

/* about `sec` seconds of the widest int8 dot */
static int32_t heavy(double sec) {
#if defined(__AVX512VNNI__)
  __m512i a[8], u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-5);
  for (int k = 0; k < 8; k++) a[k] = _mm512_set1_epi32(k);
  double t0 = now();
  while (now() - t0 < sec)
    for (int i = 0; i < 4096; i++) {
      __asm__ volatile("" : "+v"(u), "+v"(s));
      for (int k = 0; k < 8; k++) a[k] = _mm512_dpbusd_epi32(a[k], u, s);
    }
  int32_t o[16];
  _mm512_storeu_si512(o, _mm512_add_epi32(_mm512_add_epi32(a[0], a[7]), a[3]));
  return o[0];
#else
  __m256i a[8], u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-5);
  const __m256i one = _mm256_set1_epi16(1);
  for (int k = 0; k < 8; k++) a[k] = _mm256_set1_epi32(k);
  double t0 = now();
  while (now() - t0 < sec)
    for (int i = 0; i < 4096; i++) {
      __asm__ volatile("" : "+x"(u), "+x"(s));
      for (int k = 0; k < 8; k++) a[k] = _mm256_add_epi32(a[k], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), one));
    }
  int32_t o[8];
  _mm256_storeu_si256((__m256i *)o, _mm256_add_epi32(a[0], a[7]));
  return o[0];
#endif
}

int main(int argc, char **argv) {
  const int64_t big = (argc > 1 ? atoll(argv[1]) : 1024) << 20, small = (argc > 2 ? atoll(argv[2]) : 128) << 10;
  const int reps = argc > 3 ? atoi(argv[3]) : 5, huge = argc > 4 && !strcmp(argv[4], "thp");
  if (reps < 1 || reps > MAX_REPS || big < (1 << 20) || small < 4096 || small > big) {
    fprintf(stderr, "usage: throttle [big MiB >= 1] [small KiB, 4 .. big] [reps 1..%d] [4k|thp]\n", MAX_REPS);
    return 2;
  }
  static const int Ws[] = {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
  uint8_t *buf = aligned_alloc(4096, (size_t)big);
  if (!buf) return 1;
  /* E4: transparent huge pages asked for (numpy does so for its large arrays; malloc does not) */
  if (madvise(buf, (size_t)big, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE)) perror("madvise");
  for (int64_t i = 0; i < big; i++) buf[i] = (uint8_t)(i * 131 + 7);
  int32_t sink = 0;
  printf("{\"vec\": \"%s\", \"pages\": \"%s\", \"big_mib\": %lld, \"small_kib\": %lld, \"reps\": %d,\n", VEC,
         huge ? "thp" : "4k", (long long)(big >> 20), (long long)(small >> 10), reps);
  const double g0 = clock_ghz(20000000);
  printf(" \"rows\": [");
  for (size_t k = 0; k < sizeof Ws / sizeof *Ws; k++)
    for (int dep = 0; dep < 2; dep++) {
      const double l2 = time_lines(buf, small / 64, 1, Ws[k], dep, reps, &sink);
      const double dr = time_lines(buf, big / 64, 0, Ws[k], dep, reps, &sink);
      printf("%s\n  {\"W\": %d, \"mode\": \"%s\", \"l2_ns\": %.4f, \"dram_ns\": %.4f}", k || dep ? "," : "", Ws[k],
             dep ? "dep" : "indep", l2, dr);
      fflush(stdout);
    }
  double idle[5], after[5];
  for (int r = 0; r < 5; r++) {
    (void)clock_ghz(40000000); /* ~0.1 s of scalar work first */
    idle[r] = clock_ghz(2000000);
    sink += heavy(0.1);
    after[r] = clock_ghz(2000000);
  }
  printf("],\n \"ghz_start\": %.4f, \"ghz_idle\": [", g0);
  for (int r = 0; r < 5; r++) printf("%s%.4f", r ? ", " : "", idle[r]);
  printf("], \"ghz_after_int8\": [");
  for (int r = 0; r < 5; r++) printf("%s%.4f", r ? ", " : "", after[r]);
#if defined(__AVX512VNNI__)
  const char *hv = "VPDPBUSD zmm";
#else
  const char *hv = "VPMADDUBSW + VPMADDWD ymm";
#endif
  printf("], \"heavy\": \"%s\", \"sink\": %d}\n", hv, sink & 1);
  free(buf);
  return 0;
}
