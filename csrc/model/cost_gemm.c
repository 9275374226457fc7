/* Cost terms: token-parallel compute (projections, MLP, output head) at the device's achieved matmul rate, and the
 * memory-bound work beside it at the device's memory bandwidth. */
#include <math.h>

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

/* Bytes per second the memory-bound work moves on a device; 0 where its bandwidth is unknown. */
static double mem_bound_rate(const hexiseq_device_info *d) { return d->mem_bound_gbps * 1e9; }

/* The memory-bound work of a device over the whole step: every layer's (forward, backward, recompute) and the loss
 * for each sequence's tokens, and the optimizer step once over the parameters it updates, seconds. */
double hexiseq_mem_bound_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens, double opt_params) {
    double rate = mem_bound_rate(d);
    if (rate <= 0.0)
        return 0.0;
    const hexiseq_model *m = x->m;
    double per_token = m->layers * layer_mem_elems_per_token(m) * m->dtype_bytes * mem_bound_passes(x->t) +
                       head_vocab(m) * loss_bytes_per_logit(m);
    return (x->t->sequences * (double)tokens * per_token + opt_params * optimizer_bytes_per_param(m)) / rate;
}

/* One layer's memory-bound work, forward + backward, one sequence (no recompute), seconds. */
double hexiseq_layer_mem_bound_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens) {
    double rate = mem_bound_rate(d);
    if (rate <= 0.0 || tokens == 0)
        return 0.0;
    return (double)tokens * layer_mem_elems_per_token(x->m) * x->m->dtype_bytes * (1.0 + MEM_BOUND_BWD_FACTOR) / rate;
}

double hexiseq_tiling_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens, int32_t features) {
    if (tokens == 0 || !(features & (HEXISEQ_TILE_MLP | HEXISEQ_TILE_LOSS)))
        return 0.0;
    const hexiseq_model *m = x->m;
    double n = (double)tokens, tile = fmin(n, HEXISEQ_TILE_TOKENS), rate = mem_bound_rate(d);
    double whole = gemm_rate_flops(d, n), tiled = gemm_rate_flops(d, tile), s = 0.0;
    if (features & HEXISEQ_TILE_MLP) {
        double inner = (m->gated_mlp ? 3.0 : 2.0) * m->ffn, flops = 2.0 * inner * m->hidden; /* forward, per token */
        double passes = gemm_passes(x->t);
        s += m->layers * n * flops * ((passes + 1.0) / tiled - passes / whole);
        if (rate > 0.0)
            s += m->layers * n * inner * m->dtype_bytes / rate; /* the activation once more */
    }
    if (features & HEXISEQ_TILE_LOSS) {
        double flops = head_gemm_flops_per_token(m);
        s += n * flops * ((2.0 + GEMM_BWD_FACTOR) / tiled - (1.0 + GEMM_BWD_FACTOR) / whole);
        if (rate > 0.0)
            s += n * head_vocab(m) * (m->dtype_bytes + 4.0) / rate; /* the logits and their softmax once more */
    }
    return x->t->sequences * s;
}

double hexiseq_offload_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens, double fwd_s,
                              double bwd_s) {
    if (tokens == 0 || !(d->host_gbps > 0))
        return 0.0;
    double copy = (double)tokens * x->m->hidden * x->m->dtype_bytes / (d->host_gbps * 1e9);
    return (double)x->t->sequences * x->m->layers * (fmax(0.0, copy - fwd_s) + fmax(0.0, copy - bwd_s));
}
