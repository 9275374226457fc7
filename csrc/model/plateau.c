/* Device rates read from the description: a measured curve at a size, and the plateau rates (the largest a
 * device's matmuls and attention reach), below the cluster (its rate sums) and the cost model. */
#include <math.h>

#include "internal.h"

double hexiseq_curve_tflops(const hexiseq_rate_curve *cv, double size) {
    int32_t n = cv->n;
    if (!(size > cv->size[0]))
        return cv->tflops[0];
    if (size >= cv->size[n - 1])
        return cv->tflops[n - 1];
    int32_t i = 1;
    while (cv->size[i] < size) /* size[i - 1] < size <= size[i] */
        ++i;
    double t = (log(size) - log(cv->size[i - 1])) / (log(cv->size[i]) - log(cv->size[i - 1]));
    return cv->tflops[i - 1] + t * (cv->tflops[i] - cv->tflops[i - 1]);
}

double hexiseq_runtime_curve_ns(const hexiseq_rate_curve *cv, double x) {
    int32_t n = cv->n;
    if (!(x > cv->size[0]))
        return x * cv->tflops[0];
    if (x >= cv->size[n - 1])
        return x * cv->tflops[n - 1];
    int32_t i = 1;
    while (cv->size[i] < x) /* size[i - 1] < x <= size[i] */
        ++i;
    double t0 = cv->size[i - 1] * cv->tflops[i - 1], t1 = cv->size[i] * cv->tflops[i];
    return t0 + (x - cv->size[i - 1]) * (t1 - t0) / (cv->size[i] - cv->size[i - 1]);
}

static double curve_max_tflops(const hexiseq_rate_curve *cv) {
    double m = 0.0;
    for (int32_t i = 0; i < cv->n; ++i)
        m = fmax(m, cv->tflops[i]);
    return m;
}

double hexiseq_gemm_plateau(const hexiseq_device_info *d) {
    if (d->gemm_curve.n > 0)
        return curve_max_tflops(&d->gemm_curve) * 1e12;
    return d->peak_tflops * 1e12 * d->gemm_eff;
}

double hexiseq_attn_plateau(const hexiseq_device_info *d, int32_t causal) {
    double r = d->attn_curve.n > 0 ? curve_max_tflops(&d->attn_curve) * 1e12 : d->peak_tflops * 1e12 * d->attn_eff;
    if (causal && d->attn_causal_curve.n > 0) /* the diagonal blocks run at the causal curve's rates */
        r = fmax(r, curve_max_tflops(&d->attn_causal_curve) * 1e12);
    if (causal && d->attn_document_curve.n > 0) /* packed documents at theirs: the bound must cover every rate */
        r = fmax(r, curve_max_tflops(&d->attn_document_curve) * 1e12);
    return r;
}
