/* Shared by the NEON C tests (neon_test.c, neon_quant_test.c): case bookkeeping (a case passes
 * when no CHECK inside it failed; the first few failures of a case are printed) and a
 * deterministic xorshift generator (each test seeds g_rng with its own constant). */
#ifndef CF_NEON_TEST_UTIL_H
#define CF_NEON_TEST_UTIL_H
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

static int g_pass, g_fail, c_fail;
static char c_name[320];
static void begin(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void begin(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c_name, sizeof c_name, fmt, ap);
  va_end(ap);
  c_fail = 0;
}
static void end(void) {
  if (c_fail) g_fail++, printf("FAIL %s (%d failed checks)\n", c_name, c_fail);
  else g_pass++;
}
#define CHECK(cond, ...)                                                                          \
  do {                                                                                            \
    if (!(cond) && c_fail++ < 4) {                                                                \
      printf("  [%s] check failed: %s: ", c_name, #cond);                                         \
      printf(__VA_ARGS__);                                                                        \
      printf("\n");                                                                               \
    }                                                                                             \
  } while (0)

static uint64_t g_rng;
static double urand(void) { /* [0, 1) */
  g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) * 0x1.0p-53;
}
static float uni(float lo, float hi) { return (float)(lo + (hi - lo) * urand()); }
#endif
