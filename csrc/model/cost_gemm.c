/* Cost term: token-parallel compute (projections, MLP, output head) at the device's achieved matmul rate. */
#include "cost_terms.h"

/* Achieved matmul rate (FLOP/s) of a device running an m-row problem: the measured curve when there is
 * one, else the catalog's size curve. */
static double gemm_rate_flops(const hexiseq_device_info *d, double rows) {
    if (d->gemm_curve.n > 0)
        return hexiseq_curve_tflops(&d->gemm_curve, rows) * 1e12;
    return d->peak_tflops * 1e12 * d->gemm_eff * rows / (rows + GEMM_HALF_TOKENS);
}

/* Token-parallel compute of a device over the whole step, seconds. */
double hexiseq_gemm_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens) {
    if (tokens == 0)
        return 0.0;
    double flops_per_token = x->m->layers * layer_gemm_flops_per_token(x->m) * gemm_passes(x->t) +
                             head_gemm_flops_per_token(x->m) * (1.0 + GEMM_BWD_FACTOR);
    return x->t->sequences * (double)tokens * flops_per_token / gemm_rate_flops(d, (double)tokens);
}

/* Token-parallel compute of one layer's forward for one sequence, seconds. */
double hexiseq_layer_gemm_fwd_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens) {
    if (tokens == 0)
        return 0.0;
    return (double)tokens * layer_gemm_flops_per_token(x->m) / gemm_rate_flops(d, (double)tokens);
}
