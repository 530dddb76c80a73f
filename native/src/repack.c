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
 * high bits are 2-bit planes (four chunks per 64 bytes).
 *
 * A panel block is a permutation of the bits of its 16 blocks (Q8_0 also flips its codes' top
 * bits), so every byte is written once in either direction and nothing is cleared first. The moves
 * are word-level: each field is a few transposes of bit matrices held in 64-bit words (swap_index),
 * each its own inverse, so unpacking runs the same steps in reverse order; padding rows are read
 * from a neutral block or written to a sink, so no loop tests rows. GGUF's little-endian fields are
 * moved as host words (every target of this library is little-endian). tests/test_repack.py checks
 * both directions bit for bit against a reference of the layout. */
#include <stdint.h>
#include <string.h>

#include "../kernels/qtypes.h"
#include "../kernels/repack.h"
#include "../cdef.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "repack.c moves GGUF's little-endian fields as host words"
#endif

/* The per-field helpers are inlined into the two directions' loops (dir a constant there), and
 * their short fixed loops unrolled (baseline -O2 would keep them, and their word arrays in memory). */
#if defined(__GNUC__)
#define INL static inline __attribute__((always_inline))
#define NOINL static __attribute__((noinline))
#define UNROLL _Pragma("GCC unroll 16")
#else
#define INL static inline
#define NOINL static
#define UNROLL
#endif

/* elements and bytes per GGUF block of a quantized type t, 0 for any other (qtypes.h: the type table
 * of cpufuse/quant/types.py) */
static int64_t blk_elems(int64_t t) { return cf_qtype_block(t) > 1 ? cf_qtype_block(t) : 0; }
static int64_t blk_bytes(int64_t t) { return cf_qtype_block(t) > 1 ? cf_qtype_bytes(t) : 0; }

int64_t cf_p16_bytes(int64_t type, int64_t n_out, int64_t K) {
  const int64_t be = blk_elems(type), bb = blk_bytes(type);
  if (!be || n_out < 0 || K <= 0 || K % be) return -1;
  return (n_out + 15) / 16 * 16 * (K / be) * bb;
}

/* ------------------------------------------------------------------------------------------------
 * words and transposes */

INL uint32_t ld32(const uint8_t *s) { uint32_t v; memcpy(&v, s, 4); return v; }
INL uint64_t ld64(const uint8_t *s) { uint64_t v; memcpy(&v, s, 8); return v; }
INL void st32(uint8_t *d, uint32_t v) { memcpy(d, &v, 4); }
INL void st64(uint8_t *d, uint64_t v) { memcpy(d, &v, 8); }

/* Every field below is a permutation of bits, done as transposes of bit matrices held in 64-bit
 * words: bit j of word x[i] is element (i, j). The step: exchange one bit of the word index i with
 * one bit of the bit index j, for every pair of words (delta swaps: the bits of *a at m << sh with
 * those of *b at m); a field is a few such steps, each its own inverse. */
INL void swap_bits(uint64_t *a, uint64_t *b, int sh, uint64_t m) {
  const uint64_t t = (*a >> sh ^ *b) & m;
  *a ^= t << sh;
  *b ^= t;
}
/* x[nw]: word-index bit w <-> bit-index bit p */
INL void swap_index(uint64_t *x, int nw, int w, int p) {
  static const uint64_t m[6] = {0x5555555555555555ull, 0x3333333333333333ull, 0x0F0F0F0F0F0F0F0Full,
                                0x00FF00FF00FF00FFull, 0x0000FFFF0000FFFFull, 0x00000000FFFFFFFFull};
  UNROLL for (int i = 0; i < nw; i++)
    if (!(i >> w & 1)) swap_bits(&x[i], &x[i | 1 << w], 1 << p, m[p]);
}
/* 4-byte words: (a0, a1), (b0, b1) -> (a0, b0), (a1, b1) */
INL void tr_words(uint64_t *a, uint64_t *b) { swap_bits(a, b, 32, 0x00000000FFFFFFFFull); }
/* nibbles, per byte: (a.lo, a.hi), (b.lo, b.hi) -> (a.lo, b.lo), (a.hi, b.hi) */
INL void tr_nibbles(uint64_t *a, uint64_t *b) { swap_bits(a, b, 4, 0x0F0F0F0F0F0F0F0Full); }
/* 8x8 bytes: byte j of x[i] <-> byte i of x[j] */
INL void tr_bytes(uint64_t *x) {
  swap_index(x, 8, 2, 5);
  swap_index(x, 8, 1, 4);
  swap_index(x, 8, 0, 3);
}
/* 2-bit fields, per byte: field j of x[i] <-> field i of x[j] (i, j < 4) */
INL void tr_pairs(uint64_t *x) {
  swap_index(x, 4, 1, 2);
  swap_index(x, 4, 0, 1);
}

/* ------------------------------------------------------------------------------------------------
 * fields. Each helper moves one field of one panel block between the GGUF blocks of its rows and
 * the panel block q: dir 0 packs (rows -> q), dir 1 unpacks (q -> rows). Most move the two rows
 * 2m, 2m+1 (their blocks a, b); the others all 16 rows of the block (r[16]). */

/* the 2-byte field at row offset off <-> q[2n] */
INL void f_half(int dir, uint8_t *a, uint8_t *b, int m, int off, uint8_t *q) {
  if (dir) {
    memcpy(a + off, q + 4 * m, 2);
    memcpy(b + off, q + 4 * m + 2, 2);
  } else {
    uint16_t u, v;
    memcpy(&u, a + off, 2);
    memcpy(&v, b + off, 2);
    st32(q + 4 * m, u | (uint32_t)v << 16);
  }
}
/* nch code chunks: chunk i, byte 4n+t <-> row byte off + 4i + t, ^ x; chunk i is chunk i % per of
 * record i / per, at q + rec * (i / per) + 64 * (i % per). 2 rows x 2 chunks are 2 words each. */
INL void f_chunks(int dir, uint8_t *a, uint8_t *b, int m, int off, int nch, int per, int rec, uint64_t x,
                  uint8_t *q) {
  UNROLL for (int i = 0; i < nch; i += 2) {
    uint8_t *qa = q + rec * (i / per) + 64 * (i % per) + 8 * m, *qb = qa + 64;
    uint8_t *ra = a + off + 4 * i, *rb = b + off + 4 * i;
    uint64_t u = ld64(dir ? qa : ra) ^ x, v = ld64(dir ? qb : rb) ^ x;
    tr_words(&u, &v);
    st64(dir ? ra : qa, u);
    st64(dir ? rb : qb, v);
  }
}
/* Q5_0/Q5_1 5th bits: qh (uint32 LE at off) bit e = element e <-> bit planes: chunk c, 8 bytes for
 * the low-nibble group (elements 4c+t), 8 bytes for the high one (16+4c+t), bit 4n+t. As words
 * x[m] = qh of rows 2m, 2m+1, the bit index is (n0 h c1 c0 t1 t0) and the word index (n3 n2 n1); four
 * index swaps give word (c0 h c1) with bit index (n3 n2 n1 n0 t1 t0): the plane at 16c + 8h. */
INL void f_qh32(int dir, uint8_t *const *r, int off, uint8_t *q) {
  uint64_t x[8];
  if (dir) {
    UNROLL for (int i = 0; i < 8; i++) x[i] = ld64(q + 16 * ((i >> 2) + 2 * (i & 1)) + 8 * (i >> 1 & 1));
    swap_index(x, 8, 2, 2);
    swap_index(x, 8, 2, 5);
    swap_index(x, 8, 1, 4);
    swap_index(x, 8, 0, 3);
    UNROLL for (int m = 0; m < 8; m++) {
      st32(r[2 * m] + off, (uint32_t)x[m]);
      st32(r[2 * m + 1] + off, (uint32_t)(x[m] >> 32));
    }
  } else {
    UNROLL for (int m = 0; m < 8; m++)
      x[m] = ld32(r[2 * m] + off) | (uint64_t)ld32(r[2 * m + 1] + off) << 32;
    swap_index(x, 8, 0, 3);
    swap_index(x, 8, 1, 4);
    swap_index(x, 8, 2, 5);
    swap_index(x, 8, 2, 2);
    UNROLL for (int i = 0; i < 8; i++) st64(q + 16 * ((i >> 2) + 2 * (i & 1)) + 8 * (i >> 1 & 1), x[i]);
  }
}
/* Q4_K/Q5_K scales and mins (row offset 4, 12 bytes) <-> 128 bytes of low nibbles (byte 16j+n:
 * sc[n][j] & 15 | (m[n][j] & 15) << 4) then 64 bytes of high bits (byte i < 64: bits 0-1 of value
 * i, 2-3 of value 64+i, 4-5 of value 128+i, 6-7 of value 192+i, where values 0..127 are sc[16j+n]
 * and 128..255 are m[16j+n], >> 4). With the 12 bytes of row n as words S0, S1, S2 that is: (S0,
 * S1) nibble-transposed to (N, H), then byte j of N | S2 << 32 -> q[16j + n], byte j of H ->
 * q[128 + 16j + n] (byte transposes of rows 0-7 and 8-15, and of H of row i | H of row i+8 << 32). */
INL void f_scm(int dir, uint8_t *const *r, uint8_t *q) {
  uint64_t w[2][8], h[8];
  if (dir) {
    UNROLL for (int j = 0; j < 8; j++) {
      w[0][j] = ld64(q + 16 * j);
      w[1][j] = ld64(q + 16 * j + 8);
      h[j] = ld64(q + 128 + 16 * (j & 3) + 8 * (j >> 2));
    }
  } else {
    UNROLL for (int n = 0; n < 16; n++) {
      uint64_t s0 = ld32(r[n] + 4), s1 = ld32(r[n] + 8);
      tr_nibbles(&s0, &s1);
      w[n >> 3][n & 7] = s0 | (uint64_t)ld32(r[n] + 12) << 32;
      h[n & 7] = n < 8 ? s1 : h[n & 7] | s1 << 32;
    }
  }
  tr_bytes(w[0]);
  tr_bytes(w[1]);
  tr_bytes(h);
  if (dir) {
    UNROLL for (int n = 0; n < 16; n++) {
      const uint64_t nw = w[n >> 3][n & 7];
      uint64_t s0 = nw & 0xFFFFFFFFull, s1 = h[n & 7] >> (n < 8 ? 0 : 32) & 0xFFFFFFFFull;
      tr_nibbles(&s0, &s1);
      st32(r[n] + 4, (uint32_t)s0);
      st32(r[n] + 8, (uint32_t)s1);
      st32(r[n] + 12, (uint32_t)(nw >> 32));
    }
  } else {
    UNROLL for (int j = 0; j < 8; j++) {
      st64(q + 16 * j, w[0][j]);
      st64(q + 16 * j + 8, w[1][j]);
      st64(q + 128 + 16 * (j & 3) + 8 * (j >> 2), h[j]);
    }
  }
}
/* Q5_K 5th bits (row offset 16: qh[l] bit j = element 32j + l) <-> per pair record g (at q + rec*g):
 * after its 8 code chunks, per chunk c 8 bytes for sub-block 2g and 8 for 2g+1, bit 4n+t. Per 8
 * bytes qh[8k..8k+7] of the 16 rows (chunks 2k+u), as words x[n]: bit index (u t1 t0 s2 s1 s0) (byte
 * 4u+t, bit s), word index (n3 n2 n1 n0); six index swaps give word (u s1 s0 s2) with bit index
 * (n3 n2 n1 n0 t1 t0): the plane of chunk 2k+u, sub-block s = 2g+h (t moves out and back in). */
INL void f_q5k_planes(int dir, uint8_t *const *r, int rec, uint8_t *q) {
  for (int k = 0; k < 4; k++) {
    uint64_t x[16];
    uint8_t *pk = q + 512 + 32 * k;
    if (dir) {
      UNROLL for (int i = 0; i < 16; i++) {
        const int s = (i >> 1 & 1) | (i >> 2 & 1) << 1 | (i & 1) << 2;
        x[i] = ld64(pk + rec * (s >> 1) + 16 * (i >> 3) + 8 * (s & 1));
      }
      UNROLL for (int h = 0; h < 16; h += 8) { /* the same swaps in reverse order */
        swap_index(x + h, 8, 0, 2);
        swap_index(x + h, 8, 2, 1);
        swap_index(x + h, 8, 2, 4);
        swap_index(x + h, 8, 1, 0);
        swap_index(x + h, 8, 1, 3);
      }
      swap_index(x, 16, 3, 5);
      UNROLL for (int n = 0; n < 16; n++) st64(r[n] + 16 + 8 * k, x[n]);
    } else {
      UNROLL for (int n = 0; n < 16; n++) x[n] = ld64(r[n] + 16 + 8 * k);
      swap_index(x, 16, 3, 5); /* first: the other swaps keep to each half of x (8 words) */
      UNROLL for (int h = 0; h < 16; h += 8) {
        swap_index(x + h, 8, 1, 3);
        swap_index(x + h, 8, 1, 0);
        swap_index(x + h, 8, 2, 4);
        swap_index(x + h, 8, 2, 1);
        swap_index(x + h, 8, 0, 2);
      }
      UNROLL for (int i = 0; i < 16; i++) {
        const int s = (i >> 1 & 1) | (i >> 2 & 1) << 1 | (i & 1) << 2;
        st64(pk + rec * (s >> 1) + 16 * (i >> 3) + 8 * (s & 1), x[i]);
      }
    }
  }
}
/* Q6_K codes <-> per 32-element sub-block s a 416-byte record at q + 416 s: low nibbles (4 chunks:
 * group c low, group c+4 high), 2-bit high planes (2 x 64 bytes: bits 2c..2c+1 of byte 4n+t for
 * groups c / c+4), then the scales (f_q6k_scales). GGUF: sub-block s = 4h+g (g < 4), element l: low
 * 4 bits in nibble g >> 1 of ql[64h + 32(g&1) + l], high 2 bits at bit 2g of qh[32h + l] (row offset
 * 128). So per (h, g&1) the ql bytes of sub-blocks s and s+2 are a nibble transpose of their
 * records' chunks, and per h the qh bytes a 2-bit-field transpose of 4 records' planes. */
INL void f_q6k_codes(int dir, uint8_t *a, uint8_t *b, int m, uint8_t *q) {
  UNROLL for (int s = 0; s < 8; s += 4) /* low nibbles: records s+g, s+g+2 */
    UNROLL for (int g = 0; g < 2; g++)
      UNROLL for (int c = 0; c < 4; c += 2) {
        uint8_t *qa = a + 64 * (s >> 2) + 32 * g + 4 * c, *qb = b + 64 * (s >> 2) + 32 * g + 4 * c;
        uint8_t *c0 = q + 416 * (s + g) + 64 * c + 8 * m, *c1 = c0 + 2 * 416;
        uint64_t w[4]; /* rows 2m, 2m+1 x (s+g, s+g+2), chunks c, c+1 */
        if (dir) {
          uint64_t a0 = ld64(c0), a1 = ld64(c0 + 64), b0 = ld64(c1), b1 = ld64(c1 + 64);
          tr_words(&a0, &a1);
          tr_words(&b0, &b1);
          w[0] = a0, w[1] = b0, w[2] = a1, w[3] = b1;
          tr_nibbles(&w[0], &w[1]);
          tr_nibbles(&w[2], &w[3]);
          st64(qa, w[0]);
          st64(qa + 16, w[1]);
          st64(qb, w[2]);
          st64(qb + 16, w[3]);
        } else {
          w[0] = ld64(qa), w[1] = ld64(qa + 16), w[2] = ld64(qb), w[3] = ld64(qb + 16);
          tr_nibbles(&w[0], &w[1]);
          tr_nibbles(&w[2], &w[3]);
          tr_words(&w[0], &w[2]);
          tr_words(&w[1], &w[3]);
          st64(c0, w[0]);
          st64(c0 + 64, w[2]);
          st64(c1, w[1]);
          st64(c1 + 64, w[3]);
        }
      }
  UNROLL for (int h = 0; h < 2; h++) /* high bits: qh bytes of rows 2m, 2m+1 <-> records 4h..4h+3 */
    UNROLL for (int hi = 0; hi < 2; hi++) {
      const int qh = 128 + 32 * h + 16 * hi;
      uint8_t *pl = q + 416 * 4 * h + 256 + 64 * hi + 8 * m;
      uint64_t w[4]; /* dir 0: qh bytes 4c..4c+3 of rows 2m, 2m+1; dir 1: record 4h+g's plane */
      UNROLL for (int i = 0; i < 4; i++)
        w[i] = dir ? ld64(pl + 416 * i) : ld32(a + qh + 4 * i) | (uint64_t)ld32(b + qh + 4 * i) << 32;
      tr_pairs(w);
      UNROLL for (int i = 0; i < 4; i++) {
        if (dir) {
          st32(a + qh + 4 * i, (uint32_t)w[i]);
          st32(b + qh + 4 * i, (uint32_t)(w[i] >> 32));
        } else {
          st64(pl + 416 * i, w[i]);
        }
      }
    }
}
/* Q6_K scales (row offset 192: the int8 scale of 16-element group 2s+u) <-> per record s, after
 * its planes, 16 bytes for u = 0 and 16 for u = 1, byte n: a 16x16 byte transpose */
INL void f_q6k_scales(int dir, uint8_t *const *r, uint8_t *q) {
  UNROLL for (int n0 = 0; n0 < 16; n0 += 8)
    UNROLL for (int g0 = 0; g0 < 16; g0 += 8) {
      uint64_t w[8];
      UNROLL for (int i = 0; i < 8; i++) {
        uint8_t *sc = q + 416 * ((g0 + i) >> 1) + 384 + 16 * (i & 1) + n0;
        w[i] = ld64(dir ? sc : r[n0 + i] + 192 + g0);
      }
      tr_bytes(w);
      UNROLL for (int i = 0; i < 8; i++) {
        uint8_t *sc = q + 416 * ((g0 + i) >> 1) + 384 + 16 * (i & 1) + n0;
        st64(dir ? r[n0 + i] + 192 + g0 : sc, w[i]);
      }
    }
}

/* The scale fields of Q2_K, Q3_K and IQ4_XS below move bytes one at a time (plain loops, not the
 * word transposes above): simple, and a permutation like the others. */

/* nb bytes at row offset off <-> q[16j + n] = byte j of row n (a 16 x nb byte transpose) */
INL void f_bytes16(int dir, uint8_t *const *r, int off, int nb, uint8_t *q) {
  for (int j = 0; j < nb; j++)
    UNROLL for (int n = 0; n < 16; n++) {
      if (dir) r[n][off + j] = q[16 * j + n];
      else q[16 * j + n] = r[n][off + j];
    }
}
/* IQ4_XS scales (row offset 2: scales_h u16, bits 2j..2j+1 = high 2 bits of ls_j; offset 4:
 * scales_l[4], nibble j%2 of byte j/2 = low 4 bits of ls_j) <-> 64 bytes L (byte 16k + n, k < 4:
 * ls_k & 15 | (ls_k+4 & 15) << 4) then 32 bytes H (byte 16i + n, i < 2: bits 2k..2k+1 = ls_2k+i >> 4) */
INL void f_xs_scales(int dir, uint8_t *const *r, uint8_t *q) {
  UNROLL for (int n = 0; n < 16; n++) {
    int ls[8];
    if (dir) {
      for (int j = 0; j < 8; j++)
        ls[j] = ((q[16 * (j & 3) + n] >> (4 * (j >> 2))) & 15) | (((q[64 + 16 * (j & 1) + n] >> (2 * (j >> 1))) & 3) << 4);
      uint32_t sh = 0;
      for (int j = 0; j < 8; j++) sh |= (uint32_t)(ls[j] >> 4) << (2 * j);
      r[n][2] = (uint8_t)sh;
      r[n][3] = (uint8_t)(sh >> 8);
      for (int k = 0; k < 4; k++) r[n][4 + k] = (uint8_t)((ls[2 * k] & 15) | (ls[2 * k + 1] & 15) << 4);
    } else {
      const uint32_t sh = r[n][2] | (uint32_t)r[n][3] << 8;
      for (int j = 0; j < 8; j++) ls[j] = ((r[n][4 + j / 2] >> (4 * (j & 1))) & 15) | (int)(((sh >> (2 * j)) & 3) << 4);
      for (int k = 0; k < 4; k++) q[16 * k + n] = (uint8_t)((ls[k] & 15) | (ls[k + 4] & 15) << 4);
      for (int i = 0; i < 2; i++)
        q[64 + 16 * i + n] = (uint8_t)((ls[i] >> 4) | (ls[2 + i] >> 4) << 2 | (ls[4 + i] >> 4) << 4 | (ls[6 + i] >> 4) << 6);
    }
  }
}
/* ------------------------------------------------------------------------------------------------
 * panels. Block k of row n is at row[n] + k * step[n] (step 0 for a padding row: packing reads a
 * neutral block, unpacking writes a sink), panel block k at p + k * pstep. */
typedef struct {
  uint8_t *row[16];
  int64_t step[16], nb, pstep;
} panel;

/* In xfer_panel, PAIRS(fields) runs the fields for blocks k0 <= k < k1 (panel block q) of every
 * pair of rows 2m, 2m+1 (blocks a, b), row pair after row pair; ROWS(fields) for the 16 rows (blocks
 * r[16]) of each of those blocks (panel blocks are ps bytes apart). */
#define KSPAN 8192
#define PAIRS(...)                                                                              \
  for (int m = 0; m < 8; m++) {                                                                 \
    uint8_t *const ra = P->row[2 * m], *const rb = P->row[2 * m + 1];                           \
    const int64_t sa = P->step[2 * m], sb = P->step[2 * m + 1];                                 \
    for (int64_t k = k0; k < k1; k++) {                                                         \
      uint8_t *a = ra + k * sa, *b = rb + k * sb, *q = p + k * ps;                              \
      __VA_ARGS__;                                                                              \
    }                                                                                           \
  }
#define ROWS(...)                                                                               \
  for (int64_t k = k0; k < k1; k++) {                                                           \
    uint8_t *r[16], *q = p + k * ps;                                                            \
    UNROLL for (int n = 0; n < 16; n++) r[n] = P->row[n] + k * P->step[n];                      \
    __VA_ARGS__;                                                                                \
  }

/* The panel blocks of type t, both directions: the one declaration of each type's P16 layout. A
 * panel is moved about KSPAN bytes of panel blocks at a time, so that both sides stay in L1 while
 * the row pairs take their turns. */
INL void xfer_panel(int64_t t, int dir, const panel *P, uint8_t *p) {
  const int64_t nb = P->nb, ps = P->pstep, span = 1 + KSPAN / ps; /* (locals: stores may alias *P) */
  for (int64_t k0 = 0; k0 < nb; k0 += span) {
    const int64_t k1 = k0 + span < nb ? k0 + span : nb;
    switch (t) {
      case GT_Q4_0: case GT_IQ4_NL: /* (d, qs[16]): d | 4 code chunks */
        PAIRS(f_half(dir, a, b, m, 0, q); f_chunks(dir, a, b, m, 2, 4, 4, 0, 0, q + 32));
        break;
      case GT_MXFP4: /* (e, qs[16]): e (16 bytes) | 4 code chunks */
        ROWS(f_bytes16(dir, r, 0, 1, q));
        PAIRS(f_chunks(dir, a, b, m, 1, 4, 4, 0, 0, q + 16));
        break;
      case GT_Q4_1: /* (d, m, qs[16]): d | m | 4 code chunks */
        PAIRS(f_half(dir, a, b, m, 0, q); f_half(dir, a, b, m, 2, q + 32);
              f_chunks(dir, a, b, m, 4, 4, 4, 0, 0, q + 64));
        break;
      case GT_Q5_0: /* (d, qh, qs[16]): d | bit planes | 4 code chunks */
        PAIRS(f_half(dir, a, b, m, 0, q); f_chunks(dir, a, b, m, 6, 4, 4, 0, 0, q + 96));
        ROWS(f_qh32(dir, r, 2, q + 32));
        break;
      case GT_Q5_1: /* (d, m, qh, qs[16]): d | m | bit planes | 4 code chunks */
        PAIRS(f_half(dir, a, b, m, 0, q); f_half(dir, a, b, m, 2, q + 32);
              f_chunks(dir, a, b, m, 8, 4, 4, 0, 0, q + 128));
        ROWS(f_qh32(dir, r, 4, q + 64));
        break;
      case GT_Q8_0: /* (d, qs[32]): d | 8 chunks of codes + 128 (unsigned) */
        PAIRS(f_half(dir, a, b, m, 0, q);
              f_chunks(dir, a, b, m, 2, 8, 8, 0, 0x8080808080808080ull, q + 32));
        break;
      case GT_Q4_K: case GT_Q5_K: { /* (d, dmin, scales[12], Q5_K: qh[32], qs[128]): d | dmin |
                                     * scales+mins, then per pair of sub-blocks g (2g in the low
                                     * nibbles, 2g+1 in the high ones) a record: 8 code chunks (+
                                     * Q5_K's 5th-bit planes) */
        const int q5 = t == GT_Q5_K, rec = q5 ? 640 : 512;
        PAIRS(f_half(dir, a, b, m, 0, q); f_half(dir, a, b, m, 2, q + 32);
              f_chunks(dir, a, b, m, q5 ? 48 : 16, 32, 8, rec, 0, q + 256));
        ROWS(f_scm(dir, r, q + 64));
        if (q5) ROWS(f_q5k_planes(dir, r, rec, q + 256));
        break;
      }
      case GT_Q6_K: /* (ql[128], qh[64], scales[16], d): d | 8 sub-block records: codes, scales */
        PAIRS(f_half(dir, a, b, m, 208, q); f_q6k_codes(dir, a, b, m, q + 32));
        ROWS(f_q6k_scales(dir, r, q + 32));
        break;
      case GT_Q2_K: /* (scales[16], qs[64], d, dmin): d | dmin | scales (16 x 16 transpose) | 16 code chunks */
        PAIRS(f_half(dir, a, b, m, 80, q); f_half(dir, a, b, m, 82, q + 32);
              f_chunks(dir, a, b, m, 16, 16, 16, 0, 0, q + 320));
        ROWS(f_bytes16(dir, r, 0, 16, q + 64));
        break;
      case GT_Q3_K: /* (hmask[32], qs[64], scales[12], d): d | scales (16 x 12 transpose) | 16 code
                     * chunks of the low 2 bits | 8 chunks of hmask */
        PAIRS(f_half(dir, a, b, m, 108, q); f_chunks(dir, a, b, m, 32, 16, 16, 0, 0, q + 224);
              f_chunks(dir, a, b, m, 0, 8, 8, 0, 0, q + 1248));
        ROWS(f_bytes16(dir, r, 96, 12, q + 32));
        break;
      case GT_IQ4_XS: /* (d, scales_h, scales_l[4], qs[128]): d | scales (L, H) | 32 code chunks:
                       * sub-block j's 4 at 256j (low nibbles elements 0-15, high 16-31) */
        PAIRS(f_half(dir, a, b, m, 0, q); f_chunks(dir, a, b, m, 8, 32, 32, 0, 0, q + 128));
        ROWS(f_xs_scales(dir, r, q + 32));
        break;
    }
  }
}
#undef PAIRS
#undef ROWS
#undef KSPAN

/* The two directions, a panel per call (kept out of line: the entry points' own loops stay small) */
NOINL void pack_panel(int64_t t, const panel *P, uint8_t *p) { xfer_panel(t, 0, P, p); }
NOINL void unpack_panel(int64_t t, const panel *P, const uint8_t *p) {
  xfer_panel(t, 1, P, (uint8_t *)p); /* only read */
}

/* Padding rows: packing reads them from a block whose panel bytes are all zero (Q8_0's codes are
 * stored + 128), unpacking writes them into a sink. */
#define X8 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80
static const uint8_t pad_zero[256], pad_q8_0[QB_Q8_0] = {0, 0, X8, X8, X8, X8};
#undef X8

int cf_repack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, int64_t src_row_bytes,
                  uint8_t *dst, int64_t p0, int64_t p1) {
  const int64_t be = blk_elems(type), bb = blk_bytes(type);
  if (!be || K % be) return 1;
  const int64_t nb = K / be, pbytes = 16 * bb * nb;
  const uint8_t *pad = type == GT_Q8_0 ? pad_q8_0 : pad_zero;
  for (int64_t p = p0; p < p1; p++) {
    panel P = {.nb = nb, .pstep = 16 * bb};
    for (int n = 0; n < 16; n++) {
      const int64_t row = 16 * p + n;
      P.row[n] = (uint8_t *)(row < n_out ? src + row * src_row_bytes : pad); /* only read */
      P.step[n] = row < n_out ? bb : 0;
    }
    pack_panel(type, &P, dst + (p - p0) * pbytes);
  }
  return 0;
}

int cf_unrepack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, uint8_t *dst,
                    int64_t dst_row_bytes, int64_t p0, int64_t p1) {
  const int64_t be = blk_elems(type), bb = blk_bytes(type);
  if (!be || K % be) return 1;
  const int64_t nb = K / be, pbytes = 16 * bb * nb;
  uint8_t sink[256];
  for (int64_t p = p0; p < p1; p++) {
    panel P = {.nb = nb, .pstep = 16 * bb};
    for (int n = 0; n < 16; n++) {
      const int64_t row = 16 * p + n;
      P.row[n] = row < n_out ? dst + (row - 16 * p0) * dst_row_bytes : sink;
      P.step[n] = row < n_out ? bb : 0;
    }
    unpack_panel(type, &P, src + p * pbytes);
  }
  return 0;
}
