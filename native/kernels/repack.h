/* The P16 panel layout of quantized weights (native/src/repack.c; docs/quant-design.md). */
#ifndef CF_REPACK_H
#define CF_REPACK_H
#include <stdint.h>
/* bytes of a repacked (n_out, K) tensor of ggml type `type`, or -1 for a type/K it cannot hold */
int64_t cf_p16_bytes(int64_t type, int64_t n_out, int64_t K);
/* panels p0..p1-1 of the GGUF rows `src` (row stride src_row_bytes; rows past n_out are padding)
 * into dst, which receives (p1 - p0) panels; 0, or 1 for an unsupported type */
int cf_repack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, int64_t src_row_bytes,
                  uint8_t *dst, int64_t p0, int64_t p1);
/* the inverse: panels p0..p1-1 of the repacked tensor src -> GGUF rows 16*p0.. of dst (row 16*p0
 * at dst, stride dst_row_bytes; padding rows are not written) */
int cf_unrepack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, uint8_t *dst,
                    int64_t dst_row_bytes, int64_t p0, int64_t p1);
#endif
