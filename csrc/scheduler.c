/* The hierarchical scheduler's driver: chooses HP groups of any sizes, per-group sequence lengths, per-device token
 * shares and head ranges, and the ring order, for a heterogeneous cluster.
 *
 * Levels (DESIGN.md §4):
 *  1. group structures from the topology: each node whole, in halves, quarters, ... singletons, chosen
 *     per class of identical nodes by coordinate descent; plus groups spanning nodes (consecutive devices,
 *     every size that divides the cluster). The best uniform baseline layout (from the dispatcher in
 *     strategy.c) is the first candidate, so the result is never predicted slower than Ring, Ulysses or USP.
 *  2. sequence across groups: the step costs max_g(gemm) + max_g(all-to-all) + max_g(attention+ring),
 *     each roughly linear in S_g. With per-group coefficients c_pg (seconds per token of phase p) and
 *     memory caps U_g, choosing S_g is the LP  min T_gemm + T_rest  s.t. S_g <= min(U_g, T_p / c_pg),
 *     sum S_g = S. We solve it by a golden-section search on the split of T between the two phases
 *     (the inner problem, a concave piecewise-linear equation, takes a few Newton steps), then refit c_pg
 *     from a full evaluation and repeat:
 *     the refit captures what is not linear (kernel efficiency on short blocks, exposed ring transfers).
 *  3. inside a group: integer head counts by greedy min-max of heads / attention rate (exact for that
 *     objective), also tried in whole kv-head units; token shares proportional to matmul rate, water-filled
 *     under each device's memory; both rounded to multiples of 64 tokens where the sizes allow.
 *  4. ring order: exhaustive for up to 6 groups, node order beyond (groups of one node stay adjacent, so
 *     the ring crosses each slow link once). Clusters of up to 6 devices also try every partition into
 *     groups, not only the node-aligned ones.
 *  5. parking (a device or a whole group keeps no tokens and no heads when the others are faster without
 *     it): clusters of up to 6 devices try every subset of active devices in every grouping; clusters up
 *     to 64 devices park greedily. Then, up to 256 devices, a bounded local search over single moves
 *     (tokens between groups, a head or tokens between two ranks of a group).
 * Everything is deterministic: no randomness, ties broken by index. The levels live in csrc/sched_*.c (see
 * scheduler.h); a time limit or a cancel request, polled at every evaluation, stops the search with the best
 * plan so far. */
#include <stdlib.h>
#include <string.h>

#include "scheduler.h"

hexiseq_status hexiseq_sched_eval(sched *s, const hexiseq_layout *l, hexiseq_plan_cost *cost) {
    HEXISEQ_CHECK(hexiseq_budget_tick(s->budget, s->have_best && s->best_cost.fits));
    return hexiseq_evaluate(s->c, s->m, s->t, s->S, s->causal, l, s->per, cost);
}

hexiseq_status hexiseq_sched_offer(sched *s, const hexiseq_layout *l, const hexiseq_plan_cost *cost) {
    if (s->have_best && !hexiseq_cost_better(cost, &s->best_cost))
        return HEXISEQ_OK;
    if (s->have_best && (s->best.n_groups != l->n_groups)) {
        hexiseq_layout_free(&s->best);
        s->have_best = 0;
    }
    if (!s->have_best)
        HEXISEQ_CHECK(hexiseq_layout_alloc(l->n_groups, l->n_devices, &s->best));
    hexiseq_layout_copy(&s->best, l);
    s->best_cost = *cost;
    s->have_best = 1;
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_schedule(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                int64_t seq_len, int32_t causal, const hexiseq_layout *seed,
                                const hexiseq_plan_cost *seed_cost, hexiseq_budget *b, hexiseq_layout *out,
                                hexiseq_plan_cost *cost) {
    sched s;
    memset(&s, 0, sizeof s);
    s.c = c;
    s.m = m;
    s.t = t;
    s.S = seq_len;
    s.causal = causal;
    s.budget = b;
    s.n = c->n_devices;
    s.per = malloc((size_t)s.n * sizeof *s.per);
    s.fgemm = malloc((size_t)s.n * sizeof *s.fgemm);
    s.fattn = malloc((size_t)s.n * sizeof *s.fattn);
    s.fgemm0 = malloc((size_t)s.n * sizeof *s.fgemm0);
    s.fattn0 = malloc((size_t)s.n * sizeof *s.fattn0);
    hexiseq_status st = HEXISEQ_OK;
    if (!s.per || !s.fgemm || !s.fattn || !s.fgemm0 || !s.fattn0) {
        st = hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch for %d devices", s.n);
        goto out;
    }
    for (int32_t r = 0; r < s.n; ++r) {
        s.fgemm[r] = hexiseq_gemm_plateau(&c->dev[r]);
        s.fattn[r] = hexiseq_attn_plateau(&c->dev[r], causal);
        s.fgemm0[r] = s.fgemm[r];
        s.fattn0[r] = s.fattn[r];
    }
    /* 0. the best uniform baseline, scored by the dispatcher */
    if (seed)
        st = hexiseq_sched_offer(&s, seed, seed_cost);
    /* 1-4. structures from the topology, and groups spanning nodes; every partition when small */
    if (st == HEXISEQ_OK && s.n <= EXACT_PARTITION_DEVICES)
        st = hexiseq_sched_run_all_partitions(&s);
    if (st == HEXISEQ_OK)
        st = hexiseq_sched_run_topology(&s);
    int32_t max_node = 0;
    for (int32_t r = 0, k = -1, cnt = 0; r < s.n; ++r) {
        cnt = c->dev[r].node == k ? cnt + 1 : 1;
        k = c->dev[r].node;
        if (cnt > max_node)
            max_node = cnt;
    }
    for (int32_t hp = max_node + 1; hp <= s.n && st == HEXISEQ_OK; ++hp)
        if (s.n % hp == 0)
            st = hexiseq_sched_run_consecutive(&s, hp);
    /* 5. polish: park devices that only slow the others down (every subset when small), then single moves */
    if (st == HEXISEQ_OK)
        st = s.n <= EXACT_PARTITION_DEVICES ? hexiseq_sched_park_subsets(&s) : hexiseq_sched_park_search(&s);
    if (st == HEXISEQ_OK && s.have_best) {
        hexiseq_layout start;
        st = hexiseq_layout_alloc(s.best.n_groups, s.n, &start);
        if (st == HEXISEQ_OK) {
            hexiseq_layout_copy(&start, &s.best);
            hexiseq_plan_cost start_cost = s.best_cost;
            st = hexiseq_sched_local_search(&s, &start, &start_cost, s.n <= 16 ? LOCAL_SEARCH_EVALS_SMALL : LOCAL_SEARCH_EVALS);
            hexiseq_layout_free(&start);
        }
    }
    if (st == HEXISEQ_OK && !s.have_best)
        st = hexiseq_fail(HEXISEQ_ERR_INTERNAL, "scheduler found no candidate");
    int out_of_time = st == HEXISEQ_ERR_CANCELLED && b->stopped == HEXISEQ_BUDGET_TIME && s.have_best;
    if (st == HEXISEQ_OK || out_of_time) {
        *out = s.best;
        *cost = s.best_cost;
        s.have_best = 0;
    }
out:
    if (s.have_best)
        hexiseq_layout_free(&s.best);
    free(s.per);
    free(s.fgemm);
    free(s.fattn);
    free(s.fgemm0);
    free(s.fattn0);
    return st;
}

