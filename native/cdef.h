/* The extension's C interface, read twice from this one file:
 * - native/ffibuild.py gives it to cffi (the cdef, and the declarations of the extension's glue):
 *   the part outside `#ifdef CF_ISA` once, and the part inside once per compiled ISA with CF_FN(name)
 *   written as name__<isa>; comments and preprocessor lines are dropped.
 * - the C compiler: every translation unit that defines one of these functions includes this file
 *   first (native/kernels/body.inc for the per-ISA kernels, with CF_ISA and CF_FN of
 *   native/kernels/common.h set; native/src/cpuinfo.c, pool.c and repack.c for the rest), so a
 *   definition whose signature differs from its declaration here is a compile error ("conflicting
 *   types"), not a wrong call at run time. tests/test_build.py checks that it is.
 * Descriptor layouts (int64 arrays): native/kernels/layouts.h, generated from cpufuse/_layouts.py. */
#ifndef CF_CDEF_H
#define CF_CDEF_H
#include <stdint.h>
uint32_t cf_cpu_features(void);
const char *cf_compiled_isas(void);
void cf_pool_profile(int on, uint64_t *out);
void cf_pool_profile_ext(uint64_t *out);
void cf_pool_cpu_limit(int n);
int64_t cf_p16_bytes(int64_t type, int64_t n_out, int64_t K);
int cf_repack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, int64_t src_row_bytes, uint8_t *dst, int64_t p0, int64_t p1);
int cf_unrepack_p16(int64_t type, int64_t n_out, int64_t K, const uint8_t *src, uint8_t *dst, int64_t dst_row_bytes, int64_t p0, int64_t p1);
#endif

/* One ISA's kernels (no include guard: a test program may declare two ISAs' by including this file
 * twice, with a different CF_ISA each time). */
#ifdef CF_ISA
void CF_FN(cf_exp_f32)(int64_t n, const float *x, float *y);
void CF_FN(cf_exp_le0_f32)(int64_t n, const float *x, float *y);
int CF_FN(cf_softmax_f32)(const int64_t *d, const float *x, const void *mask, const float *slopes, const float *sinks, float scale, float *y, int nth);
int CF_FN(cf_softmax_unfused_f32)(const int64_t *d, const float *x, const void *mask, const float *slopes, const float *sinks, float scale, float *y, int nth);
int CF_FN(cf_rms_norm_rows_f32)(int64_t rows, int64_t n, const float *x, const float *w, float eps, float *y, int nth);
void CF_FN(cf_rms_norm_f32)(const int64_t *d, const float *x, const float *r, const float *w, const float *b, float eps, float *h, float *y, int nth);
void CF_FN(cf_rms_norm_unfused_f32)(const int64_t *d, const float *x, const float *r, const float *w, const float *b, float eps, float *h, float *y, int nth);
const char *CF_FN(cf_build_info)(void);
int CF_FN(cf_flash_attn_f32)(const int64_t *d, const float *q, const void *k, const void *v, const void *mask, const float *slopes, const float *sinks, float scale, float softcap, float *out, int nth);
int CF_FN(cf_flash_attn_unfused_f32)(const int64_t *d, const float *q, const void *k, const void *v, const void *mask, const float *slopes, const float *sinks, float scale, float softcap, float *out, int nth);
double CF_FN(cf_fma_peak)(int64_t iters, float *sink);
double CF_FN(cf_int8_peak)(int64_t iters, int32_t *sink);
double CF_FN(cf_read_sum)(const float *x, int64_t n, int nth);
void CF_FN(cf_add_f32)(int64_t n, const float *a, const float *b, int64_t nb, float *y);
void CF_FN(cf_mul_f32)(int64_t n, const float *a, const float *b, int64_t nb, float *y);
void CF_FN(cf_swiglu_f32)(int64_t n, const float *g, const float *u, int64_t nb, float *y);
void CF_FN(cf_scale_f32)(int64_t n, const float *a, float s, float *y);
void CF_FN(cf_silu_f32)(int64_t n, const float *a, float *y);
int64_t CF_FN(cf_plan_run)(const int64_t *prog, int64_t len, void *const *ptrs, const float *fp, void *const *blas, int ilp64, int nth);
int CF_FN(cf_qmatmul_f32)(const int64_t *d, const float *x, const float *norm_w, float eps, const void *w0, const void *w1, const void *w2, float *y0, float *y1, float *y2, const float *res, int nth);
int64_t CF_FN(cf_qtype_info)(int64_t t, int64_t what);
int CF_FN(cf_dequant_rows_f32)(int64_t t, int64_t K, const uint8_t *w, int64_t n_rows, int64_t row_bytes, const int64_t *ids, int64_t n, float *out);
int CF_FN(cf_quantize_act)(int64_t vtype, int64_t rows, int64_t k, const float *x, int64_t xs, void *out);
int CF_FN(cf_rope_f32)(const int64_t *d, const float *x, const int32_t *pos, const float *freq_factors, const double *fp, void *y, int nth);
#endif
