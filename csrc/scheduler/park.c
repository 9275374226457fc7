/* Stage 5 of the scheduler (scheduler.c): parking, i.e. devices or groups that keep no tokens and no heads when the others
 * are faster without them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "levels.h"

/* ------------------------------------------------------------------ parking */

/* Small clusters: every proper subset of the devices as the active ones, each grouped every way (the parked
 * ones join the first group). With run_all_partitions over all devices this covers every structure. */
hexiseq_status hexiseq_sched_park_subsets(sched *s) {
    int32_t n = s->n;
    hexiseq_status st = HEXISEQ_OK;
    for (uint32_t mask = 1; mask + 1 < (1u << n) && st == HEXISEQ_OK; ++mask) {
        for (int32_t d = 0; d < n; ++d) {
            int active = (mask >> d) & 1u;
            s->fgemm[d] = active ? s->fgemm0[d] : 0.0;
            s->fattn[d] = active ? s->fattn0[d] : 0.0;
        }
        st = hexiseq_sched_run_all_partitions(s);
    }
    for (int32_t d = 0; d < n; ++d) {
        s->fgemm[d] = s->fgemm0[d];
        s->fattn[d] = s->fattn0[d];
    }
    return st;
}

/* A parked device holds no tokens and no heads: it only keeps its share of the model states. Parking a
 * slow device, or one behind a slow link, can shorten the step (the others stop waiting for it). Greedy:
 * starting from the best plan, try parking each active device alone and each group as a whole (its
 * devices join the first other group); re-optimise shares; keep the first change that improves; repeat. */
hexiseq_status hexiseq_sched_park_search(sched *s) {
    if (!s->have_best || s->n > PARK_SEARCH_DEVICES || s->n < 2)
        return HEXISEQ_OK;
    hexiseq_status st = HEXISEQ_OK;
    int32_t n = s->n;
    for (int round = 0; round < n && st == HEXISEQ_OK; ++round) {
        hexiseq_layout base;
        st = hexiseq_layout_alloc(s->best.n_groups, n, &base);
        if (st != HEXISEQ_OK)
            break;
        hexiseq_layout_copy(&base, &s->best);
        int32_t G = base.n_groups;
        int improved = 0;
        /* candidates: 0..n-1 park slot c's device; n..n+G-1 park group c-n; then park node c-n-G; then
         * keep only the k fastest devices (by matmul + attention rate), k = 1..n-1 */
        int32_t n_nodes = s->c->n_nodes;
        for (int32_t cand = 0; cand < n + G + n_nodes + n - 1 && !improved && st == HEXISEQ_OK; ++cand) {
            int32_t park_group = cand >= n && cand < n + G ? cand - n : -1;
            int32_t park_node = cand >= n + G && cand < n + G + n_nodes ? cand - n - G : -1;
            int32_t keep_fastest = cand >= n + G + n_nodes ? cand - n - G - n_nodes + 1 : 0;
            int32_t slot = cand < n ? cand : -1;
            if (slot >= 0 && base.tokens[slot] == 0 && base.head_count[slot] == 0)
                continue; /* already parked */
            if (park_group >= 0 && G < 2)
                continue;
            /* group membership after the move: g_of[r] */
            int32_t g_of[PARK_SEARCH_DEVICES], new_index[PARK_SEARCH_DEVICES], r = 0, active_left = 0;
            for (int32_t g = 0; g < G; ++g)
                for (int32_t i = 0; i < base.group_size[g]; ++i, ++r)
                    g_of[r] = g;
            for (int32_t q = 0; q < n; ++q) {
                int parked = (base.tokens[q] == 0 && base.head_count[q] == 0) || q == slot || g_of[q] == park_group ||
                             s->c->dev[base.device[q]].node == park_node;
                if (keep_fastest) { /* rank of this device by rate; parked when not among the k fastest */
                    int32_t d = base.device[q], faster = 0;
                    double rate = s->fgemm0[d] + s->fattn0[d];
                    for (int32_t e = 0; e < n; ++e) {
                        double re = s->fgemm0[e] + s->fattn0[e];
                        faster += re > rate || (re == rate && e < d);
                    }
                    parked = faster >= keep_fastest;
                }
                s->fgemm[base.device[q]] = parked ? 0.0 : s->fgemm0[base.device[q]];
                s->fattn[base.device[q]] = parked ? 0.0 : s->fattn0[base.device[q]];
                active_left += !parked;
            }
            if (active_left == 0)
                continue;
            double before = s->best_cost.step_time_s;
            int fit_before = s->best_cost.fits;
            /* groups that keep an active member stay, in order; parked devices of vanished groups join the
             * first surviving group */
            int32_t keep = 0, first_keep = -1;
            for (int32_t g = 0; g < G; ++g) {
                int has_active = 0;
                for (int32_t q = 0; q < n; ++q)
                    if (g_of[q] == g && s->fgemm[base.device[q]] > 0)
                        has_active = 1;
                new_index[g] = has_active ? keep++ : -1;
                if (has_active && first_keep < 0)
                    first_keep = g;
            }
            hexiseq_layout l;
            st = hexiseq_layout_alloc(keep, n, &l);
            if (st != HEXISEQ_OK)
                break;
            int32_t out = 0;
            for (int32_t g = 0; g < G; ++g) {
                if (new_index[g] < 0)
                    continue;
                for (int32_t q = 0; q < n; ++q)
                    if (g_of[q] == g || (g == first_keep && new_index[g_of[q]] < 0)) {
                        l.device[out++] = base.device[q];
                        l.group_size[new_index[g]]++;
                    }
            }
            double score;
            st = hexiseq_sched_run_structure(s, &l, &score);
            hexiseq_layout_free(&l);
            if (s->best_cost.fits != fit_before || s->best_cost.step_time_s < before)
                improved = 1;
        }
        for (int32_t q = 0; q < n; ++q) {
            s->fgemm[q] = s->fgemm0[q];
            s->fattn[q] = s->fattn0[q];
        }
        hexiseq_layout_free(&base);
        if (!improved)
            break;
    }
    return st;
}
