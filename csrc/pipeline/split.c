/* A model's layers split over a pipeline's stages of unequal speed and memory: the fewest seconds for the slowest
 * stage, each stage's time its fixed part plus its layers times its time per layer. The optimum is one of the times
 * fixed_s + k x layer_s the stages can take, so a binary search over those candidates, each tested by giving every
 * stage as many layers as fit under it, finds it exactly. */
#include <math.h>
#include <stdlib.h>

#include "hexiseq.h"

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The layers stage s can take within `limit` seconds: at most its cap (and the layers there are), 0 when not one. */
static int64_t take(double fixed, double per, int64_t cap, double limit) {
    if (fixed + per > limit * (1 + 1e-12))
        return 0;
    if (per <= 0)
        return cap;
    double k = floor((limit * (1 + 1e-12) - fixed) / per);
    return k < (double)cap ? (int64_t)k : cap;
}

static int feasible(int32_t P, int32_t L, const double *fixed, const double *per, const int64_t *cap, double limit) {
    int64_t total = 0;
    for (int32_t s = 0; s < P; ++s) {
        int64_t k = take(fixed[s], per[s], cap[s], limit);
        if (k < 1)
            return 0;
        total += k;
    }
    return total >= L;
}

hexiseq_status hexiseq_pipeline_split(int32_t n_stages, int32_t layers, const double *fixed_s, const double *layer_s,
                                      const int32_t *most_layers, int32_t *layers_out, double *max_stage_s) {
    hexiseq_clear_error();
    if (!fixed_s || !layer_s || !layers_out || !max_stage_s)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "fixed_s, layer_s, layers_out and max_stage_s must not be NULL");
    const int32_t P = n_stages, L = layers;
    if (P < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "n_stages must be >= 1, got %d", (int)P);
    if (L < P)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "layers must be >= n_stages (%d: a layer per stage at least), got %d",
                            (int)P, (int)L);
    int64_t room = 0;
    int64_t *cap = malloc((size_t)P * sizeof *cap);
    if (!cap)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "pipeline split of %d stages: out of memory", (int)P);
    for (int32_t s = 0; s < P; ++s) {
        hexiseq_status bad = HEXISEQ_OK;
        if (!isfinite(fixed_s[s]) || fixed_s[s] < 0)
            bad = hexiseq_fail(HEXISEQ_ERR_INVALID, "fixed_s[%d] must be a finite time >= 0, got %g", (int)s,
                               fixed_s[s]);
        else if (!isfinite(layer_s[s]) || layer_s[s] < 0)
            bad = hexiseq_fail(HEXISEQ_ERR_INVALID, "layer_s[%d] must be a finite time >= 0, got %g", (int)s,
                               layer_s[s]);
        else if (most_layers && most_layers[s] < 1)
            bad = hexiseq_fail(HEXISEQ_ERR_INVALID, "most_layers[%d] must be >= 1, got %d", (int)s, (int)most_layers[s]);
        if (bad != HEXISEQ_OK) {
            free(cap);
            return bad;
        }
        cap[s] = most_layers ? (most_layers[s] < L - (P - 1) ? most_layers[s] : L - (P - 1)) : L - (P - 1);
        room += cap[s];
    }
    if (room < L) {
        free(cap);
        return hexiseq_fail(HEXISEQ_ERR_MEMORY, "the stages hold at most %lld layers (most_layers), the model has %d",
                            (long long)room, (int)L);
    }
    /* every time a stage can take: fixed + k per layer, k = 1 .. cap */
    size_t n = (size_t)room;
    double *cand = malloc(n * sizeof *cand);
    if (!cand) {
        free(cap);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "pipeline split of %d layers: out of memory", (int)L);
    }
    size_t at = 0;
    for (int32_t s = 0; s < P; ++s)
        for (int64_t k = 1; k <= cap[s]; ++k)
            cand[at++] = fixed_s[s] + (double)k * layer_s[s];
    qsort(cand, n, sizeof *cand, by_value);
    size_t lo = 0, hi = n - 1; /* the largest candidate is feasible: every stage at its cap */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (feasible(P, L, fixed_s, layer_s, cap, cand[mid]))
            hi = mid;
        else
            lo = mid + 1;
    }
    double limit = cand[lo];
    int64_t total = 0;
    for (int32_t s = 0; s < P; ++s) {
        layers_out[s] = (int32_t)take(fixed_s[s], layer_s[s], cap[s], limit);
        total += layers_out[s];
    }
    /* more layers fit under the limit than the model has: take them off the slowest stages */
    for (; total > L; --total) {
        int32_t worst = -1;
        double worst_t = -1.0;
        for (int32_t s = 0; s < P; ++s) {
            double t = fixed_s[s] + layers_out[s] * layer_s[s];
            if (layers_out[s] > 1 && t > worst_t) {
                worst_t = t;
                worst = s;
            }
        }
        --layers_out[worst]; /* some stage holds 2 or more: total > L >= P */
    }
    double slowest = 0.0;
    for (int32_t s = 0; s < P; ++s) {
        double t = fixed_s[s] + layers_out[s] * layer_s[s];
        if (t > slowest)
            slowest = t;
    }
    *max_stage_s = slowest;
    free(cand);
    free(cap);
    return HEXISEQ_OK;
}
