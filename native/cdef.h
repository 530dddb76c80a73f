/* cffi cdef: one block of prototypes per compiled ISA, with @ISA@ replaced by its name.
 * Descriptor layouts (int64 arrays): native/kernels/layouts.h, generated from cpufuse/_layouts.py. */
void cf_exp_f32__@ISA@(int64_t n, const float *x, float *y);
void cf_exp_le0_f32__@ISA@(int64_t n, const float *x, float *y);
int cf_softmax_f32__@ISA@(const int64_t *d, const float *x, const void *mask, const float *slopes, const float *sinks, float scale, float *y, int nth);
int cf_softmax_unfused_f32__@ISA@(const int64_t *d, const float *x, const void *mask, const float *slopes, const float *sinks, float scale, float *y, int nth);
int cf_rms_norm_rows_f32__@ISA@(int64_t rows, int64_t n, const float *x, const float *w, float eps, float *y, int nth);
void cf_rms_norm_f32__@ISA@(const int64_t *d, const float *x, const float *r, const float *w, const float *b, float eps, float *h, float *y, int nth);
void cf_rms_norm_unfused_f32__@ISA@(const int64_t *d, const float *x, const float *r, const float *w, const float *b, float eps, float *h, float *y, int nth);
const char *cf_build_info__@ISA@(void);
int cf_flash_attn_f32__@ISA@(const int64_t *d, const float *q, const void *k, const void *v, const void *mask, const float *slopes, const float *sinks, float scale, float softcap, float *out, int nth);
int cf_flash_attn_unfused_f32__@ISA@(const int64_t *d, const float *q, const void *k, const void *v, const void *mask, const float *slopes, const float *sinks, float scale, float softcap, float *out, int nth);
double cf_fma_peak__@ISA@(int64_t iters, float *sink);
double cf_int8_peak__@ISA@(int64_t iters, int32_t *sink);
double cf_read_sum__@ISA@(const float *x, int64_t n, int nth);
void cf_add_f32__@ISA@(int64_t n, const float *a, const float *b, int64_t nb, float *y);
void cf_mul_f32__@ISA@(int64_t n, const float *a, const float *b, int64_t nb, float *y);
void cf_swiglu_f32__@ISA@(int64_t n, const float *g, const float *u, int64_t nb, float *y);
void cf_scale_f32__@ISA@(int64_t n, const float *a, float s, float *y);
void cf_silu_f32__@ISA@(int64_t n, const float *a, float *y);
int64_t cf_plan_run__@ISA@(const int64_t *prog, int64_t len, void *const *ptrs, const float *fp, void *const *blas, int ilp64, int nth);
int cf_qmatmul_f32__@ISA@(const int64_t *d, const float *x, const float *norm_w, float eps, const void *w0, const void *w1, const void *w2, float *y0, float *y1, float *y2, const float *res, int nth);
int64_t cf_qtype_info__@ISA@(int64_t t, int64_t what);
int cf_quantize_act__@ISA@(int64_t vtype, int64_t rows, int64_t k, const float *x, int64_t xs, void *out);
int cf_rope_f32__@ISA@(const int64_t *d, const float *x, const int32_t *pos, const float *freq_factors, const double *fp, void *y, int nth);
