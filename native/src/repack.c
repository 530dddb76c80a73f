/* The P16 weight layout: GGUF quantized rows repacked into panels of 16 rows (docs/quant-design.md,
 * "Repacked weights"). Portable C, compiled with the baseline flags; every ISA's panel kernels
 * (native/kernels/qpanel.inc) read this one layout, and the kernels for weights still in GGUF
 * layout repack a panel at a time into a scratch with the same functions, so both run the same
 * arithmetic and give bit-identical results.
 *
 * A panel holds weight rows 16p..16p+15 (rows past n_out are zero bytes) as one "panel block" per
 * GGUF block along K, in K order; a panel block is exactly 16 GGUF blocks long, so the repacked
 * tensor has the file's size (plus the padding rows of the last panel). Within a panel block:
 * first the f16 scales of the 16 rows side by side (d[16], then dmin[16] or m[16] where the type
 * has them), then the types' other header fields regrouped by column, then the codes in "chunks"
 * of 64 bytes: byte 4n+t of a chunk belongs to column n, and holds codes of 4 consecutive K
 * elements (t = 0..3) of one group, i.e. the operand layout of a 16-lane u8 x s8 dot (VPDPBUSD)
 * whose activation operand is 4 bytes broadcast to every lane. 4-bit codes pack two groups per
 * chunk (low and high nibbles); 5th bits are bit planes (one bit per chunk byte) and Q6_K's two
 * high bits are 2-bit planes (four chunks per 64 bytes). */
#include <stdint.h>
#include <string.h>

#include "../kernels/repack.h"

static int64_t blk_elems(int64_t t) {
  switch (t) {
    case 2: case 3: case 6: case 7: case 8: return 32;
    case 12: case 13: case 14: return 256;
    default: return 0;
  }
}
static int64_t blk_bytes(int64_t t) {
  switch (t) {
    case 2: return 18;
    case 3: return 20;
    case 6: return 22;
    case 7: return 24;
    case 8: return 34;
    case 12: return 144;
    case 13: return 176;
    case 14: return 210;
    default: return 0;
  }
}

int64_t cf_p16_bytes(int64_t type, int64_t n_out, int64_t K) {
  const int64_t be = blk_elems(type), bb = blk_bytes(type);
  if (!be || n_out < 0 || K <= 0 || K % be) return -1;
  return (n_out + 15) / 16 * 16 * (K / be) * bb;
}

/* The 6-bit scale/min of sub-block j of a Q4_K/Q5_K block (the 12-byte packing) */
static void k4_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}
/* ...and the inverse: write sc/m (6-bit) of sub-block j into the 12-byte packing */
static void k4_put_scale_min(uint8_t *s, int j, uint8_t sc, uint8_t m) {
  if (j < 4) {
    s[j] = (uint8_t)((s[j] & 0xC0) | (sc & 63));
    s[j + 4] = (uint8_t)((s[j + 4] & 0xC0) | (m & 63));
  } else {
    s[j + 4] = (uint8_t)((sc & 15) | ((m & 15) << 4));
    s[j - 4] = (uint8_t)((s[j - 4] & 63) | ((sc >> 4) << 6));
    s[j] = (uint8_t)((s[j] & 63) | ((m >> 4) << 6));
  }
}

static void put_bit(uint8_t *plane, int bit, int v) {
  if (v) plane[bit >> 3] |= (uint8_t)(1u << (bit & 7));
}
static int get_bit(const uint8_t *plane, int bit) { return (plane[bit >> 3] >> (bit & 7)) & 1; }

/* Each field helper moves one field between the 16 GGUF blocks r[n] (NULL: a padding row) and the
 * panel block p: dir 0 packs (r -> p, p pre-zeroed), dir 1 unpacks (p -> r, r pre-zeroed). */

/* the 2-byte field at r offset off <-> p[2n] */
static void f_half(int dir, uint8_t *const *r, int off, uint8_t *p) {
  for (int n = 0; n < 16; n++)
    if (r[n]) {
      if (dir) memcpy(r[n] + off, p + 2 * n, 2);
      else memcpy(p + 2 * n, r[n] + off, 2);
    }
}
/* nc code chunks: chunk c, byte 4n+t <-> r[n][off + 4c + t] ^ x */
static void f_chunks(int dir, uint8_t *const *r, int off, int nc, uint8_t x, uint8_t *p) {
  for (int c = 0; c < nc; c++)
    for (int n = 0; n < 16; n++)
      if (r[n])
        for (int t = 0; t < 4; t++) {
          if (dir) r[n][off + 4 * c + t] = (uint8_t)(p[64 * c + 4 * n + t] ^ x);
          else p[64 * c + 4 * n + t] = (uint8_t)(r[n][off + 4 * c + t] ^ x);
        }
}
/* Q5_0/Q5_1 5th bits: qh (uint32 LE at off) bit e = element e <-> bit planes: chunk c, 8 bytes for
 * the low-nibble group (elements 4c+t), 8 bytes for the high one (16+4c+t), bit 4n+t */
static void f_qh32(int dir, uint8_t *const *r, int off, uint8_t *p) {
  for (int n = 0; n < 16; n++) {
    if (!r[n]) continue;
    uint32_t qh = 0;
    if (!dir) memcpy(&qh, r[n] + off, 4);
    for (int c = 0; c < 4; c++)
      for (int t = 0; t < 4; t++)
        for (int h = 0; h < 2; h++) {
          const int e = 16 * h + 4 * c + t;
          if (dir) qh |= (uint32_t)get_bit(p + 16 * c + 8 * h, 4 * n + t) << e;
          else put_bit(p + 16 * c + 8 * h, 4 * n + t, (qh >> e) & 1);
        }
    if (dir) memcpy(r[n] + off, &qh, 4);
  }
}
/* Q4_K/Q5_K scales and mins (r offset 4, 12 bytes) <-> 128 bytes of low nibbles (byte 16j+n:
 * sc[n][j] & 15 | (m[n][j] & 15) << 4) then 64 bytes of high bits (byte i < 64: bits 0-1 of value
 * i, 2-3 of value 64+i, 4-5 of value 128+i, 6-7 of value 192+i, where values 0..127 are sc[16j+n]
 * and 128..255 are m[16j+n], >> 4) */
static void f_scm(int dir, uint8_t *const *r, uint8_t *p) {
  uint8_t v[256];
  memset(v, 0, sizeof v);
  if (dir)
    for (int i = 0; i < 256; i++) {
      const int lo = i < 128 ? p[i] & 15 : p[i - 128] >> 4;
      v[i] = (uint8_t)(lo | (((p[128 + (i & 63)] >> (2 * (i >> 6))) & 3) << 4));
    }
  for (int n = 0; n < 16; n++)
    if (r[n])
      for (int j = 0; j < 8; j++) {
        if (dir) k4_put_scale_min(r[n] + 4, j, v[16 * j + n], v[128 + 16 * j + n]);
        else k4_scale_min(r[n] + 4, j, &v[16 * j + n], &v[128 + 16 * j + n]);
      }
  if (!dir) {
    for (int i = 0; i < 128; i++) p[i] = (uint8_t)((v[i] & 15) | ((v[128 + i] & 15) << 4));
    for (int i = 0; i < 64; i++)
      p[128 + i] = (uint8_t)((v[i] >> 4) | ((v[64 + i] >> 4) << 2) | ((v[128 + i] >> 4) << 4) | ((v[192 + i] >> 4) << 6));
  }
}
/* Q5_K 5th bits (r offset 16: qh[l] bit j = element 32j + l) <-> per pair record g (at p + rec*g):
 * after its 8 code chunks, per chunk c 8 bytes for sub-block 2g and 8 for 2g+1, bit 4n+t */
static void f_q5k_planes(int dir, uint8_t *const *r, uint8_t *p, int rec) {
  for (int n = 0; n < 16; n++) {
    if (!r[n]) continue;
    for (int g = 0; g < 4; g++)
      for (int c = 0; c < 8; c++)
        for (int t = 0; t < 4; t++)
          for (int h = 0; h < 2; h++) {
            uint8_t *hp = p + rec * g + 512 + 16 * c + 8 * h, *q = &r[n][16 + 4 * c + t];
            if (dir) *q = (uint8_t)(*q | (get_bit(hp, 4 * n + t) << (2 * g + h)));
            else put_bit(hp, 4 * n + t, (*q >> (2 * g + h)) & 1);
          }
  }
}
/* Q6_K codes and scales <-> per 32-element sub-block s a 416-byte record at p + 416 s: low
 * nibbles (4 chunks: group c low, group c+4 high), 2-bit high planes (2 x 64 bytes: bits 2c..2c+1
 * of byte 4n+t for groups c / c+4), the int8 scales of its two 16-element groups (2 x 16) */
static void f_q6k(int dir, uint8_t *const *r, uint8_t *p) {
  for (int n = 0; n < 16; n++) {
    if (!r[n]) continue;
    for (int gr = 0; gr < 16; gr++) {
      uint8_t *ps = p + 416 * (gr >> 1) + 384 + 16 * (gr & 1) + n;
      if (dir) r[n][192 + gr] = *ps;
      else *ps = r[n][192 + gr];
    }
    for (int e = 0; e < 256; e++) {
      const int h = e >> 7, rr = e & 127, l = rr & 31, gq = rr >> 5;
      const int s = e >> 5, k = e & 31, hi = k >> 4, c = (k & 15) >> 2, t = k & 3;
      uint8_t *ql = &r[n][64 * h + 32 * (gq & 1) + l], *qh = &r[n][128 + 32 * h + l];
      uint8_t *pl = p + 416 * s + 64 * c + 4 * n + t, *ph = p + 416 * s + 256 + 64 * hi + 4 * n + t;
      if (dir) {
        *ql = (uint8_t)(*ql | (((*pl >> (4 * hi)) & 15) << (4 * (gq >> 1))));
        *qh = (uint8_t)(*qh | (((*ph >> (2 * c)) & 3) << (2 * gq)));
      } else {
        *pl = (uint8_t)(*pl | (((*ql >> (4 * (gq >> 1))) & 15) << (4 * hi)));
        *ph = (uint8_t)(*ph | (((*qh >> (2 * gq)) & 3) << (2 * c)));
      }
    }
  }
}

/* One panel block of type t, both directions: the one declaration of each type's P16 layout */
static void xfer_block(int64_t t, int dir, uint8_t *const *r, uint8_t *p) {
  if (dir) {
    for (int n = 0; n < 16; n++)
      if (r[n]) memset(r[n], 0, (size_t)blk_bytes(t));
  } else {
    memset(p, 0, (size_t)(16 * blk_bytes(t)));
  }
  switch (t) {
    case 2: /* Q4_0 (d, qs[16]): d | 4 code chunks */
      f_half(dir, r, 0, p);
      f_chunks(dir, r, 2, 4, 0, p + 32);
      break;
    case 3: /* Q4_1 (d, m, qs[16]): d | m | 4 code chunks */
      f_half(dir, r, 0, p);
      f_half(dir, r, 2, p + 32);
      f_chunks(dir, r, 4, 4, 0, p + 64);
      break;
    case 6: /* Q5_0 (d, qh, qs[16]): d | bit planes | 4 code chunks */
      f_half(dir, r, 0, p);
      f_qh32(dir, r, 2, p + 32);
      f_chunks(dir, r, 6, 4, 0, p + 96);
      break;
    case 7: /* Q5_1 (d, m, qh, qs[16]): d | m | bit planes | 4 code chunks */
      f_half(dir, r, 0, p);
      f_half(dir, r, 2, p + 32);
      f_qh32(dir, r, 4, p + 64);
      f_chunks(dir, r, 8, 4, 0, p + 128);
      break;
    case 8: /* Q8_0 (d, qs[32]): d | 8 chunks of codes + 128 (unsigned) */
      f_half(dir, r, 0, p);
      f_chunks(dir, r, 2, 8, 0x80, p + 32);
      break;
    case 12: case 13: { /* Q4_K/Q5_K (d, dmin, scales[12], Q5_K: qh[32], qs[128]): d | dmin |
                         * scales+mins, then per pair of sub-blocks g (2g in the low nibbles, 2g+1
                         * in the high ones) a record: 8 code chunks (+ Q5_K's 5th-bit planes) */
      const int q5 = t == 13, rec = q5 ? 640 : 512;
      f_half(dir, r, 0, p);
      f_half(dir, r, 2, p + 32);
      f_scm(dir, r, p + 64);
      for (int g = 0; g < 4; g++) f_chunks(dir, r, (q5 ? 48 : 16) + 32 * g, 8, 0, p + 256 + rec * g);
      if (q5) f_q5k_planes(dir, r, p + 256, rec);
      break;
    }
    case 14: /* Q6_K (ql[128], qh[64], scales[16], d): d | 8 sub-block records */
      f_half(dir, r, 208, p);
      f_q6k(dir, r, p + 32);
      break;
  }
}

int cf_repack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, int64_t src_row_bytes,
                  uint8_t *dst, int64_t p0, int64_t p1) {
  const int64_t be = blk_elems(type), bb = blk_bytes(type);
  if (!be || K % be) return 1;
  const int64_t nb = K / be, pbytes = 16 * bb * nb;
  for (int64_t p = p0; p < p1; p++) {
    uint8_t *d = dst + (p - p0) * pbytes;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t *r[16];
      for (int n = 0; n < 16; n++) {
        const int64_t row = 16 * p + n;
        r[n] = row < n_out ? src + row * src_row_bytes + b * bb : NULL;
      }
      xfer_block(type, 0, (uint8_t *const *)r, d + b * 16 * bb);
    }
  }
  return 0;
}

int cf_unrepack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, uint8_t *dst,
                    int64_t dst_row_bytes, int64_t p0, int64_t p1) {
  const int64_t be = blk_elems(type), bb = blk_bytes(type);
  if (!be || K % be) return 1;
  const int64_t nb = K / be, pbytes = 16 * bb * nb;
  for (int64_t p = p0; p < p1; p++) {
    const uint8_t *s = src + p * pbytes;
    for (int64_t b = 0; b < nb; b++) {
      uint8_t *r[16];
      for (int n = 0; n < 16; n++) {
        const int64_t row = 16 * p + n;
        r[n] = row < n_out ? dst + (row - 16 * p0) * dst_row_bytes + b * bb : NULL;
      }
      xfer_block(type, 1, r, (uint8_t *)(s + b * 16 * bb));
    }
  }
  return 0;
}
