/* The timing of a pipeline's one-forward-one-backward schedule with stages of unequal speed, by simulation: every
 * forward and backward of every micro-batch placed on its stage's timeline in the stage's order, each starting when
 * its stage is free and what it depends on has arrived. Exact under the model hexiseq.h states (times per stage
 * per micro-batch, sends that overlap compute); O(P x M) work over a few sweeps of the stages. */
#include <math.h>
#include <stdlib.h>

#include "hexiseq.h"

/* Op k of stage s in its 1F1B order: forward or backward of which micro-batch. w = warm-up forwards. */
static void op_at(int32_t k, int32_t w, int32_t M, int *backward, int32_t *mb) {
    if (k < w) { /* warm-up forwards */
        *backward = 0;
        *mb = k;
    } else if (k < w + 2 * (M - w)) { /* steady state: forward w + j, then backward j */
        int32_t j = (k - w) / 2;
        *backward = (k - w) % 2;
        *mb = *backward ? j : w + j;
    } else { /* cool-down backwards */
        *backward = 1;
        *mb = (M - w) + (k - w - 2 * (M - w));
    }
}

static hexiseq_status check_times(const double *t, int32_t n, const char *field) {
    for (int32_t i = 0; i < n; ++i)
        if (!isfinite(t[i]) || t[i] < 0)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s[%d] must be a finite time >= 0, got %g", field, (int)i, t[i]);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_pipeline_schedule(const hexiseq_pipeline *p, double *idle_s, int32_t *in_flight,
                                         hexiseq_pipeline_timing *out) {
    hexiseq_clear_error();
    if (!p || !out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "pipeline and out must not be NULL");
    if (p->n_stages < 1 || p->n_stages > (1 << 16))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "n_stages must be in [1, 65536], got %d", (int)p->n_stages);
    if (p->micro_batches < 1 || p->micro_batches > (1 << 20))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "micro_batches must be in [1, 1048576], got %d",
                            (int)p->micro_batches);
    if (!p->forward_s || !p->backward_s)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "forward_s and backward_s must not be NULL");
    const int32_t P = p->n_stages, M = p->micro_batches;
    HEXISEQ_CHECK(check_times(p->forward_s, P, "forward_s"));
    HEXISEQ_CHECK(check_times(p->backward_s, P, "backward_s"));
    if (p->send_s)
        HEXISEQ_CHECK(check_times(p->send_s, P - 1, "send_s"));

    /* end times of every forward and backward, [s * M + i]; NAN: not placed yet */
    size_t n = (size_t)P * (size_t)M;
    double *fwd = malloc(n * sizeof *fwd), *bwd = malloc(n * sizeof *bwd), *free_at = calloc((size_t)P, sizeof *free_at);
    int32_t *next = calloc((size_t)P, sizeof *next), *held = calloc((size_t)P, sizeof *held),
            *most = calloc((size_t)P, sizeof *most);
    if (!fwd || !bwd || !free_at || !next || !held || !most) {
        free(fwd), free(bwd), free(free_at), free(next), free(held), free(most);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "pipeline of %d stages x %d micro-batches: out of memory", (int)P,
                            (int)M);
    }
    for (size_t i = 0; i < n; ++i)
        fwd[i] = bwd[i] = NAN;

    /* Sweeps down then up the stages, each stage advancing as far as its next ops are ready: forwards flow down and
     * backwards up, so each pair of sweeps moves every dependency chain on; a sweep that places nothing while ops
     * remain would be a cycle, which 1F1B does not have (checked, not assumed). */
    int64_t left = 2 * (int64_t)n;
    hexiseq_status status = HEXISEQ_OK;
    for (int pass = 0; left > 0; ++pass) {
        int64_t placed = 0;
        for (int32_t q = 0; q < P; ++q) {
            int32_t s = (pass % 2 == 0) ? q : P - 1 - q;
            int32_t w = P - 1 - s < M ? P - 1 - s : M;
            for (;;) {
                if (next[s] >= 2 * M)
                    break;
                int backward;
                int32_t i;
                op_at(next[s], w, M, &backward, &i);
                double ready;
                if (!backward) {
                    ready = s == 0 ? 0.0 : fwd[(size_t)(s - 1) * M + i];
                    if (isnan(ready))
                        break;
                    if (s > 0 && p->send_s)
                        ready += p->send_s[s - 1];
                } else if (s == P - 1) {
                    ready = fwd[(size_t)s * M + i]; /* placed earlier on this stage */
                } else {
                    ready = bwd[(size_t)(s + 1) * M + i];
                    if (isnan(ready))
                        break;
                    if (p->send_s)
                        ready += p->send_s[s];
                }
                double start = ready > free_at[s] ? ready : free_at[s];
                double end = start + (backward ? p->backward_s[s] : p->forward_s[s]);
                if (backward) {
                    bwd[(size_t)s * M + i] = end;
                    --held[s];
                } else {
                    fwd[(size_t)s * M + i] = end;
                    if (++held[s] > most[s])
                        most[s] = held[s];
                }
                free_at[s] = end;
                ++next[s];
                ++placed;
            }
        }
        left -= placed;
        if (placed == 0 && left > 0) {
            status = hexiseq_fail(HEXISEQ_ERR_INTERNAL, "pipeline schedule stalled with %lld ops left",
                                  (long long)left);
            break;
        }
    }
    if (status == HEXISEQ_OK) {
        double step = 0.0, work = -1.0;
        int32_t bottleneck = 0;
        for (int32_t s = 0; s < P; ++s) {
            if (free_at[s] > step)
                step = free_at[s];
            double w = (double)M * (p->forward_s[s] + p->backward_s[s]);
            if (w > work) {
                work = w;
                bottleneck = s;
            }
        }
        out->step_s = step;
        out->work_s = work;
        out->bubble_s = step - work;
        out->bottleneck = bottleneck;
        for (int32_t s = 0; s < P; ++s) {
            if (idle_s)
                idle_s[s] = step - (double)M * (p->forward_s[s] + p->backward_s[s]);
            if (in_flight)
                in_flight[s] = most[s];
        }
    }
    free(fwd), free(bwd), free(free_at), free(next), free(held), free(most);
    return status;
}
