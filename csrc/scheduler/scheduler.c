/* The hierarchical scheduler's driver: chooses HP groups of any sizes, per-group sequence lengths, per-device token
 * shares and head ranges, and the ring order, for a heterogeneous cluster.
 *
 * Stages (numbered as the search runs them; levels.h says which file calls which):
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
 *     under each device's memory; both rounded to multiples of 64 tokens where the sizes allow, and again
 *     within the memory caps when that rounding leaves a device short (so a length that fits, fits shorter).
 *  4. ring order: exhaustive for up to 6 groups, node order beyond (groups of one node stay adjacent, so
 *     the ring crosses each slow link once). Clusters of up to 6 devices also try every partition into
 *     groups, not only the node-aligned ones.
 *  5. parking (a device or a whole group keeps no tokens and no heads when the others are faster without
 *     it): clusters of up to 6 devices try every subset of active devices in every grouping; clusters up
 *     to 64 devices park greedily. Then, up to 256 devices, a bounded local search over single moves
 *     (tokens between groups, a head or tokens between two ranks of a group).
 * Everything is deterministic: no randomness, ties broken by index. The levels live in park.c, structures.c,
 * search.c and shares.c (see levels.h), above evaluate.c; a time limit or a cancel request, polled at every
 * evaluation, stops the search with the best plan so far. */
#include <stdlib.h>
#include <string.h>

#include "levels.h"

static hexiseq_status sched_init(sched *s, const hexiseq_cluster *c, const hexiseq_model *m,
                                 const hexiseq_training *t, int64_t seq_len, int32_t causal, hexiseq_budget *b) {
    memset(s, 0, sizeof *s);
    s->c = c;
    s->m = m;
    s->t = t;
    s->S = seq_len;
    s->causal = causal;
    s->budget = b;
    s->n = c->n_devices;
    s->per = malloc((size_t)s->n * sizeof *s->per);
    s->fgemm = malloc((size_t)s->n * sizeof *s->fgemm);
    s->fattn = malloc((size_t)s->n * sizeof *s->fattn);
    s->fgemm0 = malloc((size_t)s->n * sizeof *s->fgemm0);
    s->fattn0 = malloc((size_t)s->n * sizeof *s->fattn0);
    if (!s->per || !s->fgemm || !s->fattn || !s->fgemm0 || !s->fattn0)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch for %d devices", s->n);
    for (int32_t r = 0; r < s->n; ++r) {
        s->fgemm[r] = hexiseq_gemm_plateau(&c->dev[r]);
        s->fattn[r] = hexiseq_attn_plateau(&c->dev[r], causal);
        s->fgemm0[r] = s->fgemm[r];
        s->fattn0[r] = s->fattn[r];
    }
    return HEXISEQ_OK;
}

/* Hands the best layout to out/cost when the call succeeded (or ran out of time with one), frees the rest. */
static hexiseq_status sched_finish(sched *s, hexiseq_status st, hexiseq_layout *out, hexiseq_plan_cost *cost) {
    if (st == HEXISEQ_OK && !s->have_best)
        st = hexiseq_fail(HEXISEQ_ERR_INTERNAL, "scheduler found no candidate");
    int out_of_time = st == HEXISEQ_ERR_CANCELLED && s->budget->stopped == HEXISEQ_BUDGET_TIME && s->have_best;
    if (st == HEXISEQ_OK || out_of_time) {
        *out = s->best;
        *cost = s->best_cost;
        s->have_best = 0;
    }
    if (s->have_best)
        hexiseq_layout_free(&s->best);
    free(s->per);
    free(s->fgemm);
    free(s->fattn);
    free(s->fgemm0);
    free(s->fattn0);
    return st;
}

/* Stages 1-5 under the memory caps s->relax gives. */
static hexiseq_status search(sched *s) {
    hexiseq_status st = HEXISEQ_OK;
    const hexiseq_cluster *c = s->c;
    /* 1-4. structures from the topology, and groups spanning nodes; every partition when small */
    if (s->n <= EXACT_PARTITION_DEVICES)
        st = hexiseq_sched_run_all_partitions(s);
    if (st == HEXISEQ_OK)
        st = hexiseq_sched_run_topology(s);
    int32_t max_node = 0;
    for (int32_t r = 0, k = -1, cnt = 0; r < s->n; ++r) {
        cnt = c->dev[r].node == k ? cnt + 1 : 1;
        k = c->dev[r].node;
        if (cnt > max_node)
            max_node = cnt;
    }
    for (int32_t hp = max_node + 1; hp <= s->n && st == HEXISEQ_OK; ++hp)
        if (s->n % hp == 0)
            st = hexiseq_sched_run_consecutive(s, hp);
    /* 5. polish: park devices that only slow the others down (every subset when small), then single moves */
    if (st == HEXISEQ_OK)
        st = s->n <= EXACT_PARTITION_DEVICES ? hexiseq_sched_park_subsets(s) : hexiseq_sched_park_search(s);
    if (st == HEXISEQ_OK && s->have_best) {
        hexiseq_layout start;
        st = hexiseq_layout_alloc(s->best.n_groups, s->n, &start);
        if (st == HEXISEQ_OK) {
            hexiseq_layout_copy(&start, &s->best);
            hexiseq_plan_cost start_cost = s->best_cost;
            st = hexiseq_sched_local_search(s, &start, &start_cost,
                                            s->n <= 16 ? LOCAL_SEARCH_EVALS_SMALL : LOCAL_SEARCH_EVALS);
            hexiseq_layout_free(&start);
        }
    }
    return st;
}

/* Whether the best plan so far is short of memory or close to it on some device (MEMORY_TIGHT of its memory), or
 * fits only because some device uses memory features (its shares were water-filled under caps without them, so
 * the devices the caps held back are left short of tokens): then shares that need memory features may fit or be
 * faster. Re-scores the best (fills s->per). */
#define MEMORY_TIGHT 0.95
static hexiseq_status memory_tight(sched *s, int *tight) {
    *tight = 0;
    if (!s->have_best)
        return HEXISEQ_OK;
    hexiseq_plan_cost cost;
    HEXISEQ_CHECK(hexiseq_sched_eval(s, &s->best, &cost));
    *tight = !cost.fits;
    for (int32_t r = 0; r < s->n && !*tight; ++r)
        *tight = s->best.tokens[r] > 0 &&
                 (s->per[r].mem_total_gib > MEMORY_TIGHT * s->per[r].mem_cap_gib || s->per[r].features != 0);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_schedule(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                int64_t seq_len, int32_t causal, const hexiseq_layout *seed,
                                const hexiseq_plan_cost *seed_cost, hexiseq_budget *b, hexiseq_layout *out,
                                hexiseq_plan_cost *cost) {
    sched s;
    hexiseq_status st = sched_init(&s, c, m, t, seq_len, causal, b);
    if (st != HEXISEQ_OK)
        return sched_finish(&s, st, out, cost);
    /* 0. the best uniform baseline, scored by the dispatcher */
    if (seed)
        st = hexiseq_sched_offer(&s, seed, seed_cost);
    /* 1-5 with the caps of devices that use no memory features: where everything fits so with room to spare, the
     * plan of a training without them */
    if (st == HEXISEQ_OK)
        st = search(&s);
    /* then, when memory binds, again with caps that assume the features the training allows: shares the features
     * make room for are tried, and kept where predicted faster (or where nothing fitted before) */
    int tight = 0;
    if (st == HEXISEQ_OK && t->memory_features)
        st = memory_tight(&s, &tight);
    if (st == HEXISEQ_OK && tight) {
        s.relax = t->memory_features;
        st = search(&s);
    }
    return sched_finish(&s, st, out, cost);
}

/* heads: also hand the groups' heads out again (units of 1 and, with GQA, of a kv head's query heads). */
static hexiseq_status rebalance(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                int64_t seq_len, int32_t causal, const hexiseq_layout *in, int heads,
                                hexiseq_layout *out, hexiseq_plan_cost *cost) {
    hexiseq_clear_error();
    if (!in || !out || !cost)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "in, out and cost must not be NULL");
    memset(out, 0, sizeof *out);
    HEXISEQ_CHECK(hexiseq_check_inputs(c, m, t, seq_len));
    if (causal != 0 && causal != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "causal must be 0 or 1, got %d", causal);
    HEXISEQ_CHECK(hexiseq_check_documents(t, seq_len, causal));
    if (in->n_devices != c->n_devices)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "layout must place every one of the cluster's %d devices, it lists %d",
                            c->n_devices, in->n_devices);
    int64_t members = 0;
    for (int32_t g = 0; g < in->n_groups && members <= in->n_devices; ++g)
        members += in->group_size[g] >= 1 ? in->group_size[g] : in->n_devices + 1;
    if (in->n_groups < 1 || members != in->n_devices)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "layout groups must be non-empty and hold the %d devices",
                            in->n_devices);
    hexiseq_budget b;
    hexiseq_budget_init(&b, NULL);
    sched s;
    hexiseq_status st = sched_init(&s, c, m, t, seq_len, causal, &b);
    s.relax = t->memory_features; /* the kept layout may use them: its shares may too */
    hexiseq_layout l;
    memset(&l, 0, sizeof l);
    shares_ws w;
    memset(&w, 0, sizeof w);
    if (st == HEXISEQ_OK)
        st = hexiseq_layout_alloc(in->n_groups, in->n_devices, &l);
    if (st == HEXISEQ_OK)
        st = hexiseq_sched_ws_alloc(&w, in->n_groups, in->n_devices);
    if (st == HEXISEQ_OK) {
        hexiseq_layout_copy(&l, in);
        /* the layout as it is, first: re-balancing never predicts worse than keeping it (this also
         * validates it against the new sequence) */
        hexiseq_plan_cost kept;
        int64_t sum = 0;
        for (int32_t g = 0; g < in->n_groups; ++g)
            sum += in->group_seq[g];
        if (sum == seq_len) {
            st = hexiseq_sched_eval(&s, &l, &kept);
            if (st == HEXISEQ_OK)
                st = hexiseq_sched_offer(&s, &l, &kept);
        }
        /* parked members stay parked; head ranges stay as they are */
        for (int32_t r = 0; r < in->n_devices && st == HEXISEQ_OK; ++r) {
            int32_t d = in->device[r];
            if (d < 0 || d >= s.n) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "layout lists device %d, not in [0, %d)", d, s.n);
                break;
            }
            if (in->tokens[r] == 0)
                s.fgemm[d] = 0.0;
            if (in->head_count[r] == 0)
                s.fattn[d] = 0.0;
        }
        if (st == HEXISEQ_OK) {
            hexiseq_plan_cost got;
            st = hexiseq_sched_optimise_shares(&s, &l, &w, 0, &got);
        }
        int32_t per_kv = m->heads / m->kv_heads;
        for (int pass = 0; heads && pass < (per_kv > 1 ? 2 : 1) && st == HEXISEQ_OK; ++pass) {
            hexiseq_plan_cost got;
            hexiseq_layout_copy(&l, in);
            st = hexiseq_sched_optimise_shares(&s, &l, &w, pass ? per_kv : 1, &got);
        }
    }
    hexiseq_sched_ws_free(&w);
    hexiseq_layout_free(&l);
    return sched_finish(&s, st, out, cost);
}

hexiseq_status hexiseq_rebalance(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                 int64_t seq_len, int32_t causal, const hexiseq_layout *in, hexiseq_layout *out,
                                 hexiseq_plan_cost *cost) {
    return rebalance(c, m, t, seq_len, causal, in, 0, out, cost);
}

hexiseq_status hexiseq_rebalance_heads(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                       int64_t seq_len, int32_t causal, const hexiseq_layout *in,
                                       hexiseq_layout *out, hexiseq_plan_cost *cost) {
    return rebalance(c, m, t, seq_len, causal, in, 1, out, cost);
}

