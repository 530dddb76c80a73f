/* Driver of native/tests/neon_icount.py (aarch64): one q8-mode cf_qmatmul_f32__neon call, weight
 * type argv[1] (a name: Q4_0, ...), argv[2] activation rows, K = argv[3], N = argv[4] outputs; random
 * codes, f16 scales of 2^-7. Prints the type's block size and a checksum (so the call cannot be
 * optimized away). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../kernels/layouts.h" /* QM_* / QW_* */
#include "../kernels/qtypes.h"  /* GT_*, cf_qtype_block, cf_qtype_bytes */
#include "cf_protos.h"

static uint64_t g_s = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
  g_s ^= g_s << 13, g_s ^= g_s >> 7, g_s ^= g_s << 17;
  return (uint32_t)(g_s >> 16);
}
int main(int argc, char **argv) {
  if (argc != 5) return 2;
  int t = -1;
#define X(T) if (!strcmp(argv[1], #T)) t = GT_##T;
  CF_QUANT_TYPES(X)
#undef X
  const int64_t rows = atoll(argv[2]), K = atoll(argv[3]), N = atoll(argv[4]);
  const int blk = cf_qtype_block(t), bb = (int)cf_qtype_bytes(t);
  int d_at = 0, m_at = -1; /* f16 d / m offsets in a block */
  switch (t) {
    case GT_Q4_0: case GT_Q5_0: case GT_Q8_0: break;
    case GT_Q4_1: case GT_Q5_1: case GT_Q4_K: case GT_Q5_K: m_at = 2; break;
    case GT_Q6_K: d_at = 208; break;
    default: return 2;
  }
  const int64_t rb = K / blk * bb;
  uint8_t *w = malloc((size_t)(N * rb));
  float *x = malloc(sizeof(float) * (size_t)(rows * K)), *y = malloc(sizeof(float) * (size_t)(rows * N));
  if (!w || !x || !y) return 1;
  for (int64_t i = 0; i < N * rb; i++) w[i] = (uint8_t)rnd();
  for (int64_t b = 0; b < N * K / blk; b++) {
    uint8_t *p = w + b * bb;
    p[d_at] = 0, p[d_at + 1] = 0x20;
    if (m_at >= 0) p[m_at] = 0, p[m_at + 1] = 0x20;
  }
  for (int64_t i = 0; i < rows * K; i++) x[i] = (float)(rnd() % 2001) / 1000.0f - 1.0f;
  int64_t d[QM_LEN];
  memset(d, 0, sizeof d);
  d[QM_ROWS] = rows, d[QM_K] = K, d[QM_XS] = K, d[QM_ACT] = 1, d[QM_NW] = 1;
  d[QM_W0 + QW_T] = t, d[QM_W0 + QW_N] = N, d[QM_W0 + QW_WS] = rb, d[QM_W0 + QW_YS] = N;
  const int rc = cf_qmatmul_f32__neon(d, x, NULL, 0.0f, w, NULL, NULL, y, NULL, NULL, NULL, 1);
  double cs = 0.0;
  for (int64_t i = 0; i < rows * N; i++) cs += y[i];
  printf("rc %d blk %d checksum %.9g\n", rc, blk, cs);
  free(w), free(x), free(y);
  return rc;
}
