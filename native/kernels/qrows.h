/* The quantized weight types as rows (what ggml's type_traits is): each type's line names its parts,
 * and the kernels read a type's behaviour from its row, never from a test of its id. Adding a type is
 * adding its line here (with its row of cpufuse/quant/types.py, which generates qtypes.h: ids, block
 * sizes and bytes, the activation type) and the parts it names. tests/test_layouts.py checks that the
 * rows are exactly qtypes.h's CF_QUANT_TYPES.
 *
 *   X(T, HDR, CODES, FLAGS, PANEL, XROWS)
 *   HDR    the f32-mode header reader quant.inc's hdr_<HDR>: the scales (and min multiplier) of each
 *          32-element sub-block of a block
 *   CODES  the f32-mode decoder quant.inc's codes_<CODES>: a sub-block's 32 int8 codes
 *   FLAGS  QR_SPLIT: two scales per sub-block (16-element scales); QR_MIN: a min term, mn * the
 *          sub-block's activation sum; QR_MADD: that min is the header's +m (Q4_1 / Q5_1's
 *          x = d*q + m; without it the K types' -(dmin*m)); QR_MIN16: a min per 16 elements, added in
 *          the vector accumulator
 *   PANEL  the q8-mode tile family on P16 panels (qpanel.inc): LEG(bits, qs, qh) the 32-element legacy
 *          blocks (code bits, byte offsets of the code chunks and of the 5th-bit planes in a panel
 *          block), K45(bits) (Q4_K / Q5_K's code bits), Q6K (these three: one row x several panels
 *          at once), Q2K, Q3K, IQ4NL, IQ4XS, MXFP4 (one panel at a time; Q3K with a decoded form,
 *          p16_q3k_dec; MXFP4: IQ4NL's tile with its own table and E8M0 scales, AMX tiles as IQ4NL's)
 *   XROWS  the ISA hook of its P16_XR-row (two activation groups) tile, where the ISA defines it:
 *          NONE, Q8 (P16_Q8_ROWS), IQ4 (P16_IQ4_ROWS)
 *
 * The offset the q8 activations' offset term removes (p16_offset) is the code offset of
 * cpufuse/quant/types.py (Q4_0, Q5_0), or 128 for the types whose panels store unsigned codes where
 * the ISA dots them so (Q8_0, IQ4_NL and MXFP4: QR_U8). */
#ifndef CF_QROWS_H
#define CF_QROWS_H

enum { QR_SPLIT = 1, QR_MIN = 2, QR_MADD = 4, QR_MIN16 = 8, QR_U8 = 16 };

/* clang-format off */
#define CF_QROWS(X)                                                                 \
  X(Q4_0,   d,      Q4_0,   0,                   LEG(4, 32, 0),   NONE)             \
  X(Q4_1,   dm,     Q4_1,   QR_MIN | QR_MADD,    LEG(4, 64, 0),   NONE)             \
  X(Q5_0,   d,      Q5_0,   0,                   LEG(5, 96, 32),  NONE)             \
  X(Q5_1,   dm,     Q5_1,   QR_MIN | QR_MADD,    LEG(5, 128, 64), NONE)             \
  X(Q8_0,   d,      Q8_0,   QR_U8,               LEG(8, 32, 0),   Q8)               \
  X(Q4_K,   Q4_K,   Q4_K,   QR_MIN,              K45(4),          NONE)             \
  X(Q5_K,   Q4_K,   Q5_K,   QR_MIN,              K45(5),          NONE)             \
  X(Q6_K,   Q6_K,   Q6_K,   QR_SPLIT,            Q6K,             NONE)             \
  X(Q2_K,   Q2_K,   Q2_K,   QR_SPLIT | QR_MIN16, Q2K,             NONE)             \
  X(Q3_K,   Q3_K,   Q3_K,   QR_SPLIT,            Q3K,             NONE)             \
  X(IQ4_NL, d,      IQ4_NL, QR_U8,               IQ4NL,           IQ4)              \
  X(IQ4_XS, IQ4_XS, IQ4_XS, 0,                   IQ4XS,           IQ4)              \
  X(MXFP4,  MXFP4,  MXFP4,  QR_U8,               MXFP4,           IQ4)
/* clang-format on */

/* the panel families (QP_<PANEL>) and a legacy family's parameters (0 for the others) */
enum { QP_NONE, QP_LEG, QP_K45, QP_Q6K, QP_Q2K, QP_Q3K, QP_IQ4NL, QP_IQ4XS, QP_MXFP4 };
#define QP_KIND_LEG(bits, qs, qh) QP_LEG
#define QP_KIND_K45(bits) QP_K45
#define QP_KIND_Q6K QP_Q6K
#define QP_KIND_Q2K QP_Q2K
#define QP_KIND_Q3K QP_Q3K
#define QP_KIND_IQ4NL QP_IQ4NL
#define QP_KIND_IQ4XS QP_IQ4XS
#define QP_KIND_MXFP4 QP_MXFP4
#define QP_BITS_LEG(bits, qs, qh) bits
#define QP_QS_LEG(bits, qs, qh) qs
#define QP_QH_LEG(bits, qs, qh) qh
#define QP_BITS_K45(bits) bits
#define QP_BITS_Q6K 0
#define QP_BITS_Q2K 0
#define QP_BITS_Q3K 0
#define QP_BITS_IQ4NL 0
#define QP_BITS_IQ4XS 0
#define QP_BITS_MXFP4 0
#define QP_QS_K45(bits) 0
#define QP_QS_Q6K 0
#define QP_QS_Q2K 0
#define QP_QS_Q3K 0
#define QP_QS_IQ4NL 0
#define QP_QS_IQ4XS 0
#define QP_QS_MXFP4 0
#define QP_QH_K45(bits) 0
#define QP_QH_Q6K 0
#define QP_QH_Q2K 0
#define QP_QH_Q3K 0
#define QP_QH_IQ4NL 0
#define QP_QH_IQ4XS 0
#define QP_QH_MXFP4 0

/* a row's column as a function of the type id (always inlined: callers pass a constant t, and the
 * switch folds to the value) */
#define CF_QROW_GET(name, expr)                                                                   \
  static inline __attribute__((always_inline)) int name(int64_t t) {                              \
    switch (t) {                                                                                  \
      CF_QROWS(expr)                                                                              \
      default: return 0;                                                                          \
    }                                                                                             \
  }
#define CF_QR_FLAGS(T, H, C, F, P, XR) case GT_##T: return (F);
#define CF_QR_PANEL(T, H, C, F, P, XR) case GT_##T: return QP_KIND_##P;
#define CF_QR_BITS(T, H, C, F, P, XR) case GT_##T: return QP_BITS_##P;
#define CF_QR_QS(T, H, C, F, P, XR) case GT_##T: return QP_QS_##P;
#define CF_QR_QH(T, H, C, F, P, XR) case GT_##T: return QP_QH_##P;
CF_QROW_GET(qr_flags, CF_QR_FLAGS)
CF_QROW_GET(qr_panel, CF_QR_PANEL)
CF_QROW_GET(qr_bits, CF_QR_BITS)
CF_QROW_GET(qr_leg_qs, CF_QR_QS)
CF_QROW_GET(qr_leg_qh, CF_QR_QH)
#undef CF_QR_FLAGS
#undef CF_QR_PANEL
#undef CF_QR_BITS
#undef CF_QR_QS
#undef CF_QR_QH
#undef CF_QROW_GET

/* the row table's size: every row's id is below it */
#define CF_QROW_IDS 64
#define CF_QR_ID_CHECK(T, H, C, F, P, XR) _Static_assert(GT_##T < CF_QROW_IDS, "CF_QROW_IDS: raise it for " #T);
CF_QROWS(CF_QR_ID_CHECK)
#undef CF_QR_ID_CHECK

#endif /* CF_QROWS_H */
