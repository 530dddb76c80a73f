/* RoPE descriptor layout (int64 and double arrays), shared by native/kernels/rope.inc,
 * cpufuse/ops/rope.py and native/tests/neon_test.c. No intrinsics here. */
#ifndef CF_KERNELS_ROPE_H
#define CF_KERNELS_ROPE_H
enum {
  RP_T, RP_H, RP_D,           /* x shape (tokens, heads, head_dim) */
  RP_NDIMS,                   /* rotated dims (even, <= D); dims >= n_dims are copied */
  RP_MODE,                    /* 0 norm: pairs (2k, 2k+1); 1 neox: pairs (k, k + n_dims/2) */
  RP_COMPAT,                  /* 0 accurate (f64 angles), 1 ggml's f32 chain */
  RP_YF16,                    /* output element: 0 float32, 1 float16 (RNE) */
  RP_XS0, RP_XS1,             /* x strides (elements) for tokens, heads; last axis unit */
  RP_YS0, RP_YS1,             /* y strides (elements of y's type) */
  RP_NCTX_ORIG,               /* YaRN n_ctx_orig */
  RP_LEN
};
enum { RPF_BASE, RPF_SCALE, RPF_EXT, RPF_ATTN, RPF_BETA_FAST, RPF_BETA_SLOW, RPF_LEN };
#endif
