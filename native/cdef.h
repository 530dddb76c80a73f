/* cffi cdef: one block of prototypes per compiled ISA, with @ISA@ replaced by its name.
 * Descriptor layouts (int64 arrays) are in native/kernels/common.h. */
void cf_exp_f32__@ISA@(int64_t n, const float *x, float *y);
void cf_softmax_f32__@ISA@(const int64_t *d, const float *x, const void *mask, const float *slopes, const float *sinks, float scale, float *y);
void cf_softmax_unfused_f32__@ISA@(const int64_t *d, const float *x, const void *mask, const float *slopes, const float *sinks, float scale, float *y);
void cf_rms_norm_rows_f32__@ISA@(int64_t rows, int64_t n, const float *x, const float *w, float eps, float *y);
void cf_rms_norm_f32__@ISA@(const int64_t *d, const float *x, const float *r, const float *w, const float *b, float eps, float *h, float *y);
void cf_rms_norm_unfused_f32__@ISA@(const int64_t *d, const float *x, const float *r, const float *w, const float *b, float eps, float *h, float *y);
const char *cf_build_info__@ISA@(void);
int cf_flash_attn_f32__@ISA@(const int64_t *d, const float *q, const void *k, const void *v, const void *mask, const float *slopes, const float *sinks, float scale, float softcap, float *out);
int cf_flash_attn_unfused_f32__@ISA@(const int64_t *d, const float *q, const void *k, const void *v, const void *mask, const float *slopes, const float *sinks, float scale, float softcap, float *out);
