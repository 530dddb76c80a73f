/* AMX tile vocabulary for native/kernels/qamx.inc: the tile registers as numbers (0..7, constants),
 * TDPBSSD only (signed x signed int8, exact int32 sums). amx_cfg(kb) configures palette 1 for
 * this use: tiles 0 and 4 = A (16 rows x kb bytes: 16 activation rows, kb K codes), tiles 1 and 5 =
 * B (kb/4 rows x 64 bytes: the VNNI layout of 16 weight columns, i.e. P16 code chunks), tiles 2, 3
 * = C (16 x 16 int32). With CF_AMX_EMULATE the tiles are thread-local arrays and the operations C
 * loops with the same semantics (for testing the kernels on CPUs without AMX). */
#ifndef CF_SIMD_AMX_TILE_H
#define CF_SIMD_AMX_TILE_H
#include <stdint.h>
#include <string.h>

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} cf_tilecfg;

static inline void amx_cfg_fill(cf_tilecfg *c, int kb) {
  memset(c, 0, sizeof *c);
  c->palette = 1;
  for (int t = 0; t < 8; t += 4) {
    c->rows[t] = 16; c->colsb[t] = (uint16_t)kb;
    c->rows[t + 1] = (uint8_t)(kb / 4); c->colsb[t + 1] = 64;
  }
  c->rows[2] = 16; c->colsb[2] = 64;
  c->rows[3] = 16; c->colsb[3] = 64;
}

#ifndef CF_AMX_EMULATE
#include <immintrin.h>
static inline void amx_cfg(int kb) {
  cf_tilecfg c;
  amx_cfg_fill(&c, kb);
  _tile_loadconfig(&c);
}
#define amx_zero(t) _tile_zero(t)
#define amx_load(t, p, stride) _tile_loadd(t, p, stride)
#define amx_store(t, p, stride) _tile_stored(t, p, stride)
#define amx_dp(c, a, b) _tile_dpbssd(c, a, b)
#define amx_release() _tile_release()
#else
static _Thread_local struct { cf_tilecfg cfg; uint8_t t[8][16][64]; } cf_amx_emu;
static inline void amx_cfg(int kb) { amx_cfg_fill(&cf_amx_emu.cfg, kb); memset(cf_amx_emu.t, 0, sizeof cf_amx_emu.t); }
static inline void amx_zero(int t) { memset(cf_amx_emu.t[t], 0, sizeof cf_amx_emu.t[t]); }
static inline void amx_load(int t, const void *p, int64_t stride) {
  for (int r = 0; r < cf_amx_emu.cfg.rows[t]; r++)
    memcpy(cf_amx_emu.t[t][r], (const uint8_t *)p + r * stride, cf_amx_emu.cfg.colsb[t]);
}
static inline void amx_store(int t, void *p, int64_t stride) {
  for (int r = 0; r < cf_amx_emu.cfg.rows[t]; r++)
    memcpy((uint8_t *)p + r * stride, cf_amx_emu.t[t][r], cf_amx_emu.cfg.colsb[t]);
}
/* C[m][n] += sum over k of A[m][k] * B[k/4][4n + k%4], int8 x int8 -> int32 */
static inline void amx_dp(int c, int a, int b) {
  const int kb = cf_amx_emu.cfg.colsb[a];
  for (int m = 0; m < 16; m++)
    for (int n = 0; n < 16; n++) {
      int32_t s;
      memcpy(&s, &cf_amx_emu.t[c][m][4 * n], 4);
      for (int k = 0; k < kb; k++)
        s += (int8_t)cf_amx_emu.t[a][m][k] * (int8_t)cf_amx_emu.t[b][k / 4][4 * n + k % 4];
      memcpy(&cf_amx_emu.t[c][m][4 * n], &s, 4);
    }
}
static inline void amx_release(void) {}
#endif
#endif
