/* Stages 2-3 of the scheduler (scheduler.c): the shares of one structure. S_g across groups by an LP (solved in
 * lp.c) on per-token phase coefficients refit from full evaluations; inside a group, head counts by greedy min-max on
 * attention rate and token shares water-filled on matmul rate under memory; all rounded to kernel-friendly sizes. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "levels.h"
#include "lp.h"

/* ------------------------------------------------------------------ rounding helpers */

static _Thread_local const double *rem_keys; /* the remainders cmp_remainder orders by */

/* Larger remainder first, then lower index. */
static int cmp_remainder(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (rem_keys[i] != rem_keys[j])
        return rem_keys[i] > rem_keys[j] ? -1 : 1;
    return (i > j) - (i < j);
}

/* Whether entry i, holding `units` granules, has room under its cap for one more (no cap: always). */
static int has_room(const double *cap, int32_t i, int64_t units, int64_t granule) {
    return !cap || (double)((units + 1) * granule) <= floor(cap[i]);
}

/* Round non-negative reals w[0..k) (summing to about `total`) to integers summing exactly to `total`, in
 * multiples of `granule` except for the remainder, which goes to the entry with the largest weight.
 * `min_one` forces every entry >= 1 (group sequence lengths). Largest-remainder method, ties by index.
 * `cap` (k entries, or NULL for none): the most each entry may take (its memory). Then leftover granules go, by
 * largest remainder, only to entries with room for a whole granule, what no granule fits goes out in single tokens
 * to the entries with the most room, and only when no entry has room left (nothing fits) does it go where it would
 * without caps. Where no cap binds the result is the one without caps.
 * `scratch` has k doubles; `order` (k ints, or NULL) lets many leftover units go out in one sort. */
static void round_shares(const double *w, int32_t k, int64_t total, int64_t granule, int min_one, const double *cap,
                         int64_t *out, double *scratch, int32_t *order) {
    double sum = 0;
    for (int32_t i = 0; i < k; ++i)
        sum += w[i] > 0 ? w[i] : 0;
    if (granule < 1 || total < granule * k * 2)
        granule = 1;
    int64_t units = total / granule, rem = total - units * granule;
    int64_t used = 0;
    for (int32_t i = 0; i < k; ++i) {
        double share = sum > 0 ? (w[i] > 0 ? w[i] : 0) / sum * (double)units : (double)units / k;
        out[i] = (int64_t)floor(share);
        scratch[i] = share - (double)out[i];
        used += out[i];
    }
    if (units - used > 8 && order) { /* many leftover units: one sort, largest remainder first, ties by index */
        for (int32_t i = 0; i < k; ++i)
            order[i] = i;
        rem_keys = scratch;
        qsort(order, (size_t)k, sizeof *order, cmp_remainder);
        for (int32_t i = 0; used < units && i < k; ++i) {
            if (!has_room(cap, order[i], out[order[i]], granule))
                continue;
            out[order[i]]++;
            scratch[order[i]] = -1.0;
            used++;
        }
    }
    while (used < units) { /* hand out the leftover units by largest remainder */
        int32_t best = -1;
        for (int32_t i = 0; i < k; ++i)
            if (has_room(cap, i, out[i], granule) && (best < 0 || scratch[i] > scratch[best]))
                best = i;
        if (best < 0)
            break; /* no entry has room for a whole granule: the rest goes out in tokens below */
        out[best]++;
        scratch[best] = -1.0;
        used++;
    }
    int32_t heavy = 0;
    for (int32_t i = 0; i < k; ++i) {
        out[i] *= granule;
        if (w[i] > w[heavy])
            heavy = i;
    }
    rem += (units - used) * granule;
    while (cap && rem > 0 && (double)(out[heavy] + rem) > floor(cap[heavy])) {
        /* the heaviest entry cannot take the rest: single tokens to the entry with the most room */
        int32_t most = 0;
        for (int32_t i = 1; i < k; ++i)
            if (floor(cap[i]) - (double)out[i] > floor(cap[most]) - (double)out[most])
                most = i;
        double room = floor(cap[most]) - (double)out[most];
        if (room < 1.0)
            break; /* no room anywhere: nothing fits; the rest goes where it would without caps */
        int64_t give = room < (double)rem ? (int64_t)room : rem;
        out[most] += give;
        rem -= give;
    }
    out[heavy] += rem;
    if (min_one) { /* steal single tokens from the largest entries for any empty one */
        for (int32_t i = 0; i < k; ++i)
            while (out[i] < 1) {
                int32_t big = 0;
                for (int32_t j = 1; j < k; ++j)
                    if (out[j] > out[big])
                        big = j;
                if (out[big] <= 1)
                    break;
                out[big]--;
                out[i]++;
            }
    }
}

/* Greedy min-max of h_r / rate_r with sum h_r = heads, handed out in units of `unit` heads (1, or a kv
 * head's worth). Exact for the min-max objective; ties go to the lower rank. */
static void assign_heads(const double *rate, int32_t k, int32_t heads, int32_t unit, int32_t *count) {
    for (int32_t i = 0; i < k; ++i)
        count[i] = 0;
    int32_t left = heads;
    while (left > 0) {
        int32_t step = left < unit ? left : unit, best = 0;
        double best_t = INFINITY;
        for (int32_t i = 0; i < k; ++i) {
            double t = (count[i] + step) / rate[i];
            if (t < best_t) {
                best_t = t;
                best = i;
            }
        }
        count[best] += step;
        left -= step;
    }
}

/* ------------------------------------------------------------------ shares for one structure */


/* Tokens of group g: water-fill s_r = min(cap_r, lambda * fgemm_r) with sum = S_g; caps from memory. `capped`:
 * the rounding to granules keeps to the caps too (round_shares). */
static void fill_tokens(sched *s, hexiseq_layout *l, const shares_ws *w, int32_t g, const double *capacity,
                        int capped) {
    int32_t lo = w->offset[g], k = l->group_size[g];
    double Sg = (double)l->group_seq[g], *wv = w->tmpd;
    double hi_lambda = 1.0;
    /* find lambda with sum_r min(cap_r, lambda f_r) = S_g, or saturate at the caps */
    double total_cap = 0;
    for (int32_t i = 0; i < k; ++i)
        total_cap += capacity[lo + i];
    if (total_cap <= Sg) {
        for (int32_t i = 0; i < k; ++i)
            wv[i] = capacity[lo + i] > 0 ? capacity[lo + i] : 0;
    } else {
        double fsum = 0;
        for (int32_t i = 0; i < k; ++i)
            fsum += s->fgemm[l->device[lo + i]];
        if (fsum <= 0) { /* every member parked: cannot happen for structures we build; stay defined */
            for (int32_t i = 0; i < k; ++i)
                l->tokens[lo + i] = i == 0 ? l->group_seq[g] : 0;
            return;
        }
        /* the members whose cap binds at lambda are capped; lambda spreads the rest over the others' rates.
         * Capping only grows as lambda grows, so this settles in at most k passes (one or two in practice). */
        unsigned char *at_cap = w->flags;
        memset(at_cap, 0, (size_t)k);
        for (int pass = 0; pass <= k; ++pass) {
            double rest = Sg, rate = 0;
            for (int32_t i = 0; i < k; ++i) {
                if (at_cap[i])
                    rest -= capacity[lo + i];
                else
                    rate += s->fgemm[l->device[lo + i]];
            }
            hi_lambda = rate > 0 ? rest / rate : 0.0;
            int grew = 0;
            for (int32_t i = 0; i < k; ++i)
                if (!at_cap[i] && hi_lambda * s->fgemm[l->device[lo + i]] > capacity[lo + i]) {
                    at_cap[i] = 1;
                    grew = 1;
                }
            if (!grew)
                break;
        }
        for (int32_t i = 0; i < k; ++i)
            wv[i] = fmin(capacity[lo + i], hi_lambda * s->fgemm[l->device[lo + i]]);
    }
    round_shares(wv, k, l->group_seq[g], TOKEN_GRANULE, 0, capped ? &capacity[lo] : NULL, &l->tokens[lo], w->spare,
                 w->order);
}

/* Heads of every group: greedy on attention rate, in units of `unit` heads. */
static void fill_heads(sched *s, hexiseq_layout *l, const shares_ws *w, int32_t unit) {
    for (int32_t g = 0; g < l->n_groups; ++g) {
        int32_t lo = w->offset[g], k = l->group_size[g];
        double *rate = w->tmpd;
        for (int32_t i = 0; i < k; ++i)
            rate[i] = s->fattn[l->device[lo + i]];
        assign_heads(rate, k, s->m->heads, unit, &l->head_count[lo]);
        int32_t next = 0;
        for (int32_t i = 0; i < k; ++i) {
            l->head_lo[lo + i] = next;
            next += l->head_count[lo + i];
        }
    }
}

/* Most tokens member r can hold with free_gib left for them (the group's attention tensors already taken out): the
 * best of the memory-feature sets it may use, each charging its GiB per token, a tile's worth per token up to
 * HEXISEQ_TILE_TOKENS tokens, and offloading no more tokens than host memory takes. These are the sets the cost
 * model chooses from (hexiseq_memory_choose), so a device given no more than this fits with one of them. A member
 * holding fewer tokens than a tile may fit best with fewer features: one with less memory beside its attention
 * tensors (GQA heads held by few devices) is then not given nothing. */
static double member_capacity(const shares_ws *w, int32_t r, double free_gib) {
    double best = 0.0; /* comparisons, not fmin/fmax: no NaN reaches here, and this runs in the bisection's loop */
    for (int32_t j = 0; j < w->n_sets[r]; ++j) {
        const double *set = &w->sets[((size_t)r * FEATURE_SETS + (size_t)j) * 3];
        double per_tok = set[0], tile = set[1], t = free_gib / (per_tok + tile);
        if (t > HEXISEQ_TILE_TOKENS)
            t = (free_gib - tile * HEXISEQ_TILE_TOKENS) / per_tok;
        t = t < set[2] ? t : set[2];
        best = t > best ? t : best;
    }
    return best * (1.0 - 1e-12); /* below every inequality after rounding */
}

/* Member r's memory coefficients (with its neighbour r - 1's when `alike`): per_gtok and room0 with every
 * feature it may use, and each feature set's. */
static void member_coeffs(sched *s, hexiseq_layout *l, shares_ws *w, int32_t r, int32_t kv_n, double ring_block,
                          int alike) {
    w->alike[r] = (unsigned char)alike;
    if (alike) {
        w->room0[r] = w->room0[r - 1];
        w->per_gtok[r] = w->per_gtok[r - 1];
        w->n_sets[r] = w->n_sets[r - 1];
        memcpy(&w->sets[(size_t)r * FEATURE_SETS * 3], &w->sets[(size_t)(r - 1) * FEATURE_SETS * 3],
               sizeof(double) * 3 * FEATURE_SETS);
        return;
    }
    int32_t allowed = s->relax & hexiseq_memory_features_allowed(s->t, &s->c->dev[l->device[r]]);
    w->n_sets[r] = 0;
    for (int32_t f = 0; f <= HEXISEQ_MEMORY_FEATURES_ALL; ++f) {
        if (f & ~allowed)
            continue;
        hexiseq_memory_coeffs_t mc;
        hexiseq_memory_coeffs(s->c, s->m, s->t, l->device[r], l->head_count[r], kv_n, ring_block, f, &mc);
        double *set = &w->sets[((size_t)r * FEATURE_SETS + (size_t)w->n_sets[r]++) * 3];
        set[0] = mc.per_token_gib;
        set[1] = mc.tile_per_token_gib;
        set[2] = mc.host_per_token_gib > 0 ? mc.host_cap_gib / mc.host_per_token_gib : INFINITY;
        if (f == allowed) {
            w->room0[r] = mc.cap_gib - mc.states_gib - mc.ring_gib - mc.reserved_gib;
            w->per_gtok[r] = mc.per_group_token_gib;
        }
    }
}

/* Whole tokens the active members of the group at slots lo .. lo + k can hold when it holds S tokens (each
 * member's rounded down, as its share will be). A member alike its active neighbour holds what it holds: the
 * bisection below calls this some 20 times a group, and groups are mostly runs of one GPU class. */
static double group_room(const sched *s, const hexiseq_layout *l, const shares_ws *w, int32_t lo, int32_t k,
                         double S) {
    double sum = 0.0, last = 0.0;
    for (int32_t r = lo; r < lo + k; ++r) {
        if (!(s->fgemm[l->device[r]] > 0))
            continue; /* parked: holds no tokens */
        if (r == lo || !w->alike[r] || !(s->fgemm[l->device[r - 1]] > 0)) {
            double free_gib = w->room0[r] - w->per_gtok[r] * S;
            last = free_gib > 0 ? floor(member_capacity(w, r, free_gib)) : 0.0;
        }
        sum += last;
    }
    return sum;
}

/* Memory-derived caps: per device the most tokens it can take given its group's S_g, and per group the
 * largest S_g its members can hold (tokens water-filled onto them). */
static void memory_caps(sched *s, hexiseq_layout *l, shares_ws *w, double ring_block, double *capacity) {
    for (int32_t g = 0; g < l->n_groups; ++g) {
        int32_t lo = w->offset[g], k = l->group_size[g];
        /* per member: free memory before tokens (GiB) and GiB per own token / per group token */
        for (int32_t i = 0, prev_kv = -1; i < k; ++i) {
            int32_t r = lo + i, kv_lo, kv_n;
            hexiseq_kv_range(s->m, l->head_lo[r], l->head_count[r], &kv_lo, &kv_n);
            int alike = i > 0 && s->c->dev_class[l->device[r]] == s->c->dev_class[l->device[r - 1]] &&
                        l->head_count[r] == l->head_count[r - 1] && kv_n == prev_kv;
            prev_kv = kv_n;
            member_coeffs(s, l, w, r, kv_n, l->n_groups > 1 ? ring_block : 0.0, alike);
        }
        /* U_g: largest S in [0, seq_len] with beta_r S <= room_r for every member and room for S tokens on
         * the active ones. Where each member has one linear memory figure alpha_r (one feature set, no tile, no
         * host limit), sum_r (room_r - beta_r S) / alpha_r >= S is linear while every member has room,
         * so U_g = min(seq_len, min_r room_r / beta_r, A / (1 + B)) with A = sum room_r / alpha_r and
         * B = sum beta_r / alpha_r over active members. Otherwise the sum of the members' capacities at S
         * (member_capacity) falls as S grows, and U_g is found by bisection. Shrunk by 1e-12 so it keeps every
         * inequality after rounding. */
        double u = (double)s->S, A = 0, B = 0;
        int linear = 1;
        for (int32_t i = 0; i < k; ++i) {
            int32_t r = lo + i;
            if (w->room0[r] < 0)
                u = -1.0; /* short even without tokens */
            else if (w->per_gtok[r] > 0)
                u = fmin(u, w->room0[r] / w->per_gtok[r]); /* a member holding no tokens holds no tile */
            if (s->fgemm[l->device[r]] > 0) { /* parked members hold no tokens */
                const double *set = &w->sets[(size_t)r * FEATURE_SETS * 3];
                A += w->room0[r] / set[0];
                B += w->per_gtok[r] / set[0];
                linear &= w->n_sets[r] == 1 && set[1] == 0.0 && isinf(set[2]);
            }
        }
        if (linear)
            u = fmin(u, A / (1.0 + B));
        else if (u > 0 && group_room(s, l, w, lo, k, u) < u) {
            double below = 0.0, above = u;
            for (int it = 0; it < 48 && above - below > 0.25; ++it) {
                double mid = 0.5 * (below + above);
                if (group_room(s, l, w, lo, k, mid) >= mid)
                    below = mid;
                else
                    above = mid;
            }
            u = below;
        }
        w->ug[g] = u > 0 ? u * (1.0 - 1e-12) : 0.0;
        for (int32_t i = 0; i < k; ++i) {
            int32_t r = lo + i;
            double free_gib = w->room0[r] - w->per_gtok[r] * (double)l->group_seq[g];
            capacity[r] = i > 0 && w->alike[r] ? capacity[r - 1] : free_gib > 0 ? member_capacity(w, r, free_gib) : 0.0;
        }
    }
}

/* Solve the LP for S_g (continuous) into w->gseq, groups alike in U_g, c_g and c_r merged past
 * hexiseq_grouped_above groups as the cost model merges them. Returns 0 when the memory caps cannot hold S. */
static int lp_solve(const shares_ws *w, int32_t G, double S) {
    return hexiseq_lp_solve(G, w->ug, w->cg, w->cr, S, hexiseq_grouped_above, w->gseq);
}

/* Per-group phase times of an evaluated layout -> seconds per token coefficients. */
static void refit(sched *s, const hexiseq_layout *l, shares_ws *w) {
    for (int32_t g = 0; g < l->n_groups; ++g) {
        double gemm = 0, rest_a2a = 0, rest_ring = 0;
        for (int32_t r = w->offset[g]; r < w->offset[g + 1]; ++r) {
            gemm = fmax(gemm, s->per[r].gemm_s + s->per[r].mem_bound_s); /* the token-parallel phase */
            rest_a2a = fmax(rest_a2a, s->per[r].a2a_s);
            rest_ring = fmax(rest_ring, s->per[r].attn_s + s->per[r].ring_exposed_s + s->per[r].runtime_s);
        }
        double Sg = (double)l->group_seq[g];
        w->cg[g] = gemm / Sg;
        w->cr[g] = (rest_a2a + rest_ring) / Sg;
    }
}

/* Integer S_g from w->gseq, then each group's token shares water-filled under its members' memory caps. `capped`:
 * both roundings keep to the memory caps (round_shares), for a split whose plain rounding did not fit. */
static void split(sched *s, hexiseq_layout *l, shares_ws *w, double *capacity, int capped) {
    round_shares(w->gseq, l->n_groups, s->S, TOKEN_GRANULE, 1, capped ? w->ug : NULL, l->group_seq, w->tmpd,
                 w->order);
    double ring_block = 0;
    for (int32_t g = 0; g < l->n_groups; ++g)
        ring_block = fmax(ring_block, (double)l->group_seq[g]);
    memory_caps(s, l, w, ring_block, capacity);
    for (int32_t g = 0; g < l->n_groups; ++g)
        fill_tokens(s, l, w, g, capacity, capped);
}

/* Scores a split, offers it to the search and keeps it in `keep` when it is this structure's best so far. */
static hexiseq_status score_split(sched *s, hexiseq_layout *l, hexiseq_plan_cost *cost, hexiseq_plan_cost *best,
                                  int *have, hexiseq_layout *keep) {
    HEXISEQ_CHECK(hexiseq_sched_eval(s, l, cost));
    HEXISEQ_CHECK(hexiseq_sched_offer(s, l, cost));
    if (!*have || hexiseq_cost_better(cost, best)) {
        *best = *cost;
        *have = 1;
        hexiseq_layout_copy(keep, l);
    }
    return HEXISEQ_OK;
}

/* Complete and optimise the shares of a structure under its chunking (l->chunking). */
static hexiseq_status optimise_chunking(sched *s, hexiseq_layout *l, shares_ws *w, int32_t unit,
                                        hexiseq_plan_cost *out) {
    int32_t G = l->n_groups;
    w->offset[0] = 0;
    for (int32_t g = 0; g < G; ++g)
        w->offset[g + 1] = w->offset[g] + l->group_size[g];
    if (unit > 0)
        fill_heads(s, l, w, unit);
    double *capacity = malloc((size_t)s->n * sizeof *capacity);
    if (!capacity)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch");
    /* first round: S_g in proportion to the group's combined rate; later rounds solve the LP on
     * coefficients measured from the previous round's full evaluation */
    double total_rate = 0;
    for (int32_t g = 0; g < G; ++g) {
        w->gseq[g] = 0;
        for (int32_t r = w->offset[g]; r < w->offset[g + 1]; ++r)
            w->gseq[g] += s->fgemm[l->device[r]] + s->fattn[l->device[r]];
        total_rate += w->gseq[g];
    }
    for (int32_t g = 0; g < G; ++g)
        w->gseq[g] *= (double)s->S / total_rate;
    hexiseq_status st = HEXISEQ_OK;
    hexiseq_plan_cost cost, best_local;
    int have_local = 0;
    hexiseq_layout keep; /* the best round's layout, handed back in l */
    st = hexiseq_layout_alloc(G, l->n_devices, &keep);
    if (st != HEXISEQ_OK) {
        free(capacity);
        return st;
    }
    double ring_block = (double)s->S / G;
    for (int round = 0; round < REFIT_ROUNDS; ++round) {
        for (int32_t g = 0; g < G; ++g)
            w->ug[g] = INFINITY;
        for (int32_t g = 0; g < G; ++g)
            l->group_seq[g] = (int64_t)fmax(1.0, floor(w->gseq[g]));
        memory_caps(s, l, w, ring_block, capacity);
        if (round == 0) {
            for (int32_t g = 0; g < G; ++g)
                w->gseq[g] = fmin(w->gseq[g], w->ug[g]);
        } else if (!lp_solve(w, G, (double)s->S)) {
            /* memory cannot hold the sequence: spread by caps so the report names the shortest device */
            for (int32_t g = 0; g < G; ++g)
                w->gseq[g] = fmax(w->ug[g], 1.0);
        }
        /* rounded as the kernels like it (granules of 64 tokens); where that puts a granule past a device whose
         * memory binds, the layout is short by a few tokens' worth, and a length was refused where a longer one
         * fitted: then the same split again, rounded within the memory caps */
        split(s, l, w, capacity, 0);
        st = score_split(s, l, &cost, &best_local, &have_local, &keep);
        if (st == HEXISEQ_OK && !cost.fits) {
            split(s, l, w, capacity, 1);
            st = score_split(s, l, &cost, &best_local, &have_local, &keep);
        }
        if (st != HEXISEQ_OK)
            break;
        ring_block = 0;
        for (int32_t g = 0; g < G; ++g)
            ring_block = fmax(ring_block, (double)l->group_seq[g]);
        refit(s, l, w);
    }
    if (have_local)
        hexiseq_layout_copy(l, &keep);
    hexiseq_layout_free(&keep);
    free(capacity);
    if (out && have_local)
        *out = best_local;
    return st;
}

/* Complete and optimise the shares of a structure (l->group_size, l->device set) and offer the result.
 * `unit` is the head granularity (1 or heads per kv head). One causal document is balanced by the zigzag
 * chunks alone. Packed documents may favour contiguous chunks (short documents keep the work near the
 * diagonal, where contiguous ranges split it by length and meet fewer remote keys), so under documents both
 * chunkings are optimised and the faster kept; so too for a model with sliding-window layers, whose work also sits
 * near the diagonal and whose ring, in contiguous chunks, stops after the few steps that meet its windows. */
hexiseq_status hexiseq_sched_optimise_shares(sched *s, hexiseq_layout *l, shares_ws *w, int32_t unit,
                                             hexiseq_plan_cost *out) {
    l->chunking = HEXISEQ_CHUNK_ZIGZAG;
    hexiseq_plan_cost zig;
    zig.fits = 0;
    zig.step_time_s = INFINITY;
    HEXISEQ_CHECK(optimise_chunking(s, l, w, unit, &zig));
    if (!s->t->documents && !(s->m->window > 0 && s->m->window_layers > 0 && s->causal)) {
        if (out)
            *out = zig;
        return HEXISEQ_OK;
    }
    hexiseq_layout alt;
    HEXISEQ_CHECK(hexiseq_layout_alloc(l->n_groups, l->n_devices, &alt));
    hexiseq_layout_copy(&alt, l);
    alt.chunking = HEXISEQ_CHUNK_CONTIGUOUS;
    hexiseq_plan_cost con;
    con.fits = 0;
    con.step_time_s = INFINITY;
    hexiseq_status st = optimise_chunking(s, &alt, w, unit, &con);
    int take = st == HEXISEQ_OK && hexiseq_cost_better(&con, &zig);
    if (take)
        hexiseq_layout_copy(l, &alt);
    hexiseq_layout_free(&alt);
    if (out)
        *out = take ? con : zig;
    return st;
}

hexiseq_status hexiseq_sched_ws_alloc(shares_ws *w, int32_t G, int32_t n) {
    memset(w, 0, sizeof *w);
    w->gseq = calloc((size_t)G, sizeof(double));
    w->cg = calloc((size_t)G, sizeof(double));
    w->cr = calloc((size_t)G, sizeof(double));
    w->ug = calloc((size_t)G, sizeof(double));
    w->spare = calloc((size_t)n, sizeof(double));
    w->flags = calloc((size_t)n, 1);
    w->tmpd = calloc((size_t)(n > G ? n : G), sizeof(double));
    w->offset = calloc((size_t)G + 1, sizeof(int32_t));
    w->order = calloc((size_t)(n > G ? n : G), sizeof(int32_t));
    w->alike = calloc((size_t)n, 1);
    w->room0 = calloc((size_t)n, sizeof(double));
    w->sets = calloc((size_t)n * FEATURE_SETS * 3, sizeof(double));
    w->n_sets = calloc((size_t)n, sizeof(int32_t));
    w->per_gtok = calloc((size_t)n, sizeof(double));
    if (!w->gseq || !w->cg || !w->cr || !w->ug || !w->spare || !w->flags || !w->tmpd || !w->offset || !w->order ||
        !w->alike || !w->room0 || !w->sets || !w->n_sets || !w->per_gtok)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch for %d groups", G);
    return HEXISEQ_OK;
}

void hexiseq_sched_ws_free(shares_ws *w) {
    free(w->gseq);
    free(w->cg);
    free(w->cr);
    free(w->ug);
    free(w->spare);
    free(w->flags);
    free(w->tmpd);
    free(w->offset);
    free(w->order);
    free(w->alike);
    free(w->room0);
    free(w->sets);
    free(w->n_sets);
    free(w->per_gtok);
}

