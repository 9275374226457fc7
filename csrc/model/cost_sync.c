/* Cost term: gradient and parameter collectives over all devices, and what of them layer compute does not hide. */
#include <math.h>

#include "cost_terms.h"

/* Exposed time of L per-layer collectives of c seconds each that overlap L per-layer compute phases of b
 * seconds each: collective l can start when compute l has finished and the previous collective is done.
 * If the collective chain never waits for compute after the first layer, the last one ends at
 * b + L c; if it always waits, at L b + c; in general at max_i (i b + (L - i + 1) c), which is attained at
 * one of the ends, i = 1 or i = L. Compute ends at L b, so the exposed time is
 * max(L b + c, b + L c) - L b = max(c, L c - (L - 1) b). */
static double pipelined_exposed_s(double c, double b, double L) { return fmax(c, L * c - (L - 1.0) * b); }

/* Gradient and parameter collectives of one step over all N devices, as rings in device order 0 .. N-1
 * (bandwidth: the slowest link of that ring, latency: its largest). Every collective runs layer by layer:
 * a reduce-scatter or all-gather of all P parameters moves (N - 1) / N * P * b bytes per device and pays
 * (N - 1) latencies per layer. `b_fwd`, `b_bwd`: one layer's forward and backward (with recompute)
 * compute of the slowest device, one sequence. Gradients are reduced once per step, in the backward of
 * the last sequence; ZeRO-3 gathers parameters for every sequence. */
void hexiseq_grad_sync_s(const cost_ctx *x, double b_fwd, double b_bwd, double *sync_s, double *exposed_s) {
    *sync_s = 0.0;
    *exposed_s = 0.0;
    int32_t N = x->c->n_devices;
    if (N == 1)
        return;
    double bw = x->c->ring_bw_min, lat = x->c->ring_lat_max_s; /* the ring 0 -> 1 -> ... -> N-1 -> 0 */
    double L = x->m->layers, seqs = x->t->sequences, ck = x->t->checkpointing ? 1.0 : 0.0;
    double P = hexiseq_total_params(x->m);
    /* one reduce-scatter or all-gather of every parameter (A), and its per-layer part (a). Under uneven state
     * shares every rank's piece is padded to the largest share (or, as a ring, every step waits for the
     * largest piece): N - 1 steps of the largest share instead of (N - 1) / N of the whole. */
    double moved = (N - 1.0) / N;
    if (x->t->state_shares == HEXISEQ_STATES_BY_MEMORY && x->t->sharding != HEXISEQ_SHARD_NONE) {
        hexiseq_states_t largest;
        hexiseq_states(x->c, x->m, x->t, -1, &largest);
        moved = (N - 1.0) * largest.share;
    }
    double A = moved * P * x->m->dtype_bytes / bw + L * (N - 1.0) * lat;
    double a = A / L;
    switch (x->t->sharding) {
    case HEXISEQ_SHARD_FULL:
        /* per sequence: gather in the forward (hidden by forward compute), gather in the backward and again
         * for the recompute; the last sequence's backward also reduce-scatters the gradients */
        *sync_s = seqs * (2.0 + ck) * A + A;
        *exposed_s = seqs * pipelined_exposed_s(a, b_fwd, L) +
                     (seqs - 1.0) * pipelined_exposed_s((1.0 + ck) * a, b_bwd, L) +
                     pipelined_exposed_s((2.0 + ck) * a, b_bwd, L);
        break;
    case HEXISEQ_SHARD_GRAD_OPT:
        /* reduce-scatter of gradients behind the last backward, then an exposed gather of the parameters */
        *sync_s = 2.0 * A;
        *exposed_s = pipelined_exposed_s(a, b_bwd, L) + A;
        break;
    default:
        /* all-reduce (reduce-scatter + all-gather) of gradients behind the last backward */
        *sync_s = 2.0 * A;
        *exposed_s = pipelined_exposed_s(2.0 * a, b_bwd, L);
        break;
    }
}
