/* The hierarchical scheduler: chooses HP groups of any sizes, per-group sequence lengths, per-device token
 * shares and head ranges, and the ring order, for a heterogeneous cluster.
 *
 * Levels (DESIGN.md §4):
 *  1. group structures from the topology: each node whole, in halves, quarters, ... singletons, chosen
 *     per class of identical nodes by coordinate descent; plus groups spanning nodes (consecutive devices,
 *     every size that divides the cluster). The uniform baseline layouts are scored as candidates too, so
 *     the result is never predicted slower than Ring, Ulysses or USP.
 *  2. sequence across groups: the step costs max_g(gemm) + max_g(all-to-all) + max_g(attention+ring),
 *     each roughly linear in S_g. With per-group coefficients c_pg (seconds per token of phase p) and
 *     memory caps U_g, choosing S_g is the LP  min T_gemm + T_rest  s.t. S_g <= min(U_g, T_p / c_pg),
 *     sum S_g = S. We solve it by a golden-section search on the split of T between the two phases
 *     (the inner problem is a monotone 1-D equation), then refit c_pg from a full evaluation and repeat:
 *     the refit captures what is not linear (kernel efficiency on short blocks, exposed ring transfers).
 *  3. inside a group: integer head counts by greedy min-max of heads / attention rate (exact for that
 *     objective), also tried in whole kv-head units; token shares proportional to matmul rate, water-filled
 *     under each device's memory; both rounded to multiples of 64 tokens where the sizes allow.
 *  4. ring order: exhaustive for up to 6 groups, node order beyond (groups of one node stay adjacent, so
 *     the ring crosses each slow link once). Clusters of up to 6 devices also try every partition into
 *     groups, not only the node-aligned ones.
 *  5. parking (a device or a whole group keeps no tokens and no heads when the others are faster without
 *     it): clusters of up to 6 devices try every subset of active devices in every grouping; clusters up
 *     to 64 devices park greedily. Then a bounded local search over single moves (tokens between groups,
 *     a head or tokens between two ranks of a group).
 * Everything is deterministic: no randomness, ties broken by index. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define TOKEN_GRANULE 64    /* kernel tile: shares are multiples of this where sizes allow */
#define REFIT_ROUNDS 4      /* LP solve + full evaluation rounds per structure */
#define MAX_EXACT_ORDER 6   /* groups up to which every ring order is tried */
#define LOCAL_SEARCH_DEVICES 64
#define LOCAL_SEARCH_EVALS 400        /* evaluations of polish for clusters of 17..64 devices */
#define LOCAL_SEARCH_EVALS_SMALL 4000 /* and up to 16 devices, where an evaluation costs microseconds */
#define LOCAL_SEARCH_EVALS_STRUCT 300 /* per near-best structure of a cluster of up to 6 devices */
#define EXACT_PARTITION_DEVICES 6 /* clusters up to this size try every partition into groups */

typedef struct {
    const hexiseq_cluster *c;
    const hexiseq_model *m;
    const hexiseq_training *t;
    int64_t S;
    int32_t causal;
    int32_t n;
    hexiseq_device_cost *per; /* [n] scratch for evaluations */
    double *fgemm, *fattn;    /* [n] effective rates, FLOP/s; 0 for a parked device */
    double *fgemm0, *fattn0;  /* [n] the devices' real rates */
    /* best so far */
    hexiseq_layout best;
    hexiseq_plan_cost best_cost;
    int have_best;
    int64_t evals;
} sched;

/* Candidate ordering: fitting beats not fitting; then faster; among non-fitting, less short. */
static int better(const hexiseq_plan_cost *a, const hexiseq_plan_cost *b) {
    if (a->fits != b->fits)
        return a->fits;
    if (a->fits)
        return a->step_time_s < b->step_time_s * (1.0 - 1e-12);
    return a->short_gib < b->short_gib;
}

static hexiseq_status eval(sched *s, const hexiseq_layout *l, hexiseq_plan_cost *cost) {
    s->evals++;
    return hexiseq_evaluate(s->c, s->m, s->t, s->S, s->causal, l, s->per, cost);
}

/* Keep `l` if it beats the best so far. */
static hexiseq_status offer(sched *s, const hexiseq_layout *l, const hexiseq_plan_cost *cost) {
    if (s->have_best && !better(cost, &s->best_cost))
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

/* ------------------------------------------------------------------ rounding helpers */

/* Round non-negative reals w[0..k) (summing to about `total`) to integers summing exactly to `total`, in
 * multiples of `granule` except for the remainder, which goes to the entry with the largest weight.
 * `min_one` forces every entry >= 1 (group sequence lengths). Largest-remainder method, ties by index. */
static void round_shares(const double *w, int32_t k, int64_t total, int64_t granule, int min_one, int64_t *out,
                         double *scratch) {
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
    while (used < units) { /* hand out the leftover units by largest remainder */
        int32_t best = 0;
        for (int32_t i = 1; i < k; ++i)
            if (scratch[i] > scratch[best])
                best = i;
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

/* A structure: groups in ring order over fixed members. `l` holds group_size and device; this fills
 * group_seq, tokens, head_lo and head_count. */
typedef struct {
    double *gseq;     /* [G] continuous S_g */
    double *cg, *cr;  /* [G] seconds per token: gemm phase, rest (all-to-all + attention + ring) */
    double *ug;       /* [G] memory cap on S_g, tokens */
    int64_t *tmp64;   /* [n] */
    double *tmpd;     /* [n] */
    int32_t *offset;  /* [G + 1] */
    double *free0, *per_tok, *per_gtok; /* [n] memory model per slot: GiB free before tokens, per token */
} shares_ws;

/* Tokens of group g: water-fill s_r = min(cap_r, lambda * fgemm_r) with sum = S_g; caps from memory. */
static void fill_tokens(sched *s, hexiseq_layout *l, const shares_ws *w, int32_t g, const double *capacity) {
    int32_t lo = w->offset[g], k = l->group_size[g];
    double Sg = (double)l->group_seq[g], want[4096], *wv = k <= 4096 ? want : w->tmpd;
    double hi_lambda = 1.0, lo_lambda = 0.0;
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
        hi_lambda = Sg / fsum;
        for (int iter = 0; iter < 60; ++iter) {
            double got = 0;
            for (int32_t i = 0; i < k; ++i)
                got += fmin(capacity[lo + i], hi_lambda * s->fgemm[l->device[lo + i]]);
            if (got >= Sg)
                break;
            lo_lambda = hi_lambda;
            hi_lambda *= 2;
        }
        for (int iter = 0; iter < 60; ++iter) {
            double mid = 0.5 * (lo_lambda + hi_lambda), got = 0;
            for (int32_t i = 0; i < k; ++i)
                got += fmin(capacity[lo + i], mid * s->fgemm[l->device[lo + i]]);
            if (got >= Sg)
                hi_lambda = mid;
            else
                lo_lambda = mid;
        }
        for (int32_t i = 0; i < k; ++i)
            wv[i] = fmin(capacity[lo + i], hi_lambda * s->fgemm[l->device[lo + i]]);
    }
    double scratch[4096], *sc = k <= 4096 ? scratch : NULL;
    if (!sc) { /* very large groups: plain proportional rounding without remainder bookkeeping */
        int64_t used = 0;
        double sum = 0;
        for (int32_t i = 0; i < k; ++i)
            sum += wv[i];
        for (int32_t i = 0; i < k; ++i) {
            l->tokens[lo + i] = sum > 0 ? (int64_t)floor(wv[i] / sum * Sg) : 0;
            used += l->tokens[lo + i];
        }
        l->tokens[lo] += l->group_seq[g] - used;
        return;
    }
    round_shares(wv, k, l->group_seq[g], TOKEN_GRANULE, 0, &l->tokens[lo], sc);
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

/* Memory-derived caps: per device the most tokens it can take given its group's S_g, and per group the
 * largest S_g its members can hold (tokens water-filled onto them). */
static void memory_caps(sched *s, hexiseq_layout *l, shares_ws *w, double ring_block, double *capacity) {
    for (int32_t g = 0; g < l->n_groups; ++g) {
        int32_t lo = w->offset[g], k = l->group_size[g];
        /* per member: free memory before tokens (GiB) and GiB per own token / per group token */
        for (int32_t i = 0; i < k; ++i) {
            int32_t r = lo + i, kv_lo, kv_n;
            hexiseq_kv_range(s->m, l->head_lo[r], l->head_count[r], &kv_lo, &kv_n);
            hexiseq_memory_coeffs_t mc;
            hexiseq_memory_coeffs(s->c, s->m, s->t, l->device[r], l->head_count[r], kv_n,
                                  l->n_groups > 1 ? ring_block : 0.0, &mc);
            w->free0[r] = mc.cap_gib - mc.states_gib - mc.ring_gib - mc.reserved_gib;
            w->per_tok[r] = mc.per_token_gib;
            w->per_gtok[r] = mc.per_group_token_gib;
        }
        /* U_g: largest S with sum_r max(0, (free_r - beta_r S) / alpha_r) >= S over active members, and
         * beta_r S <= free_r for every member */
        double lo_s = 0, hi_s = (double)s->S;
        for (int iter = 0; iter < 60; ++iter) {
            double mid = 0.5 * (lo_s + hi_s), room = 0;
            int ok = 1;
            for (int32_t i = 0; i < k && ok; ++i) {
                int32_t r = lo + i;
                double free_gib = w->free0[r] - w->per_gtok[r] * mid;
                if (free_gib < 0)
                    ok = 0;
                else if (s->fgemm[l->device[r]] > 0) /* parked members hold no tokens */
                    room += free_gib / w->per_tok[r];
            }
            if (ok && room >= mid)
                lo_s = mid;
            else
                hi_s = mid;
        }
        w->ug[g] = lo_s;
        for (int32_t i = 0; i < k; ++i) {
            int32_t r = lo + i;
            double free_gib = w->free0[r] - w->per_gtok[r] * (double)l->group_seq[g];
            capacity[r] = free_gib > 0 ? free_gib / w->per_tok[r] : 0.0;
        }
    }
}

/* sum_g min(U_g, T_gemm / cg, T_rest / cr) for T = (t a, t (1 - a)). */
static double lp_fill(const shares_ws *w, int32_t G, double t, double a, double *out) {
    double total = 0;
    for (int32_t g = 0; g < G; ++g) {
        double x = w->ug[g];
        if (w->cg[g] > 0)
            x = fmin(x, t * a / w->cg[g]);
        if (w->cr[g] > 0)
            x = fmin(x, t * (1 - a) / w->cr[g]);
        if (out)
            out[g] = x;
        total += x;
    }
    return total;
}

/* Smallest t with lp_fill(t, a) >= S (INFINITY when the caps cannot hold S). */
static double lp_time(const shares_ws *w, int32_t G, double S, double a) {
    if (lp_fill(w, G, INFINITY, a, NULL) < S * (1 - 1e-12))
        return INFINITY;
    double lo = 0, hi = 1e-9;
    while (lp_fill(w, G, hi, a, NULL) < S && hi < 1e30)
        hi *= 4;
    for (int iter = 0; iter < 100 && hi - lo > 1e-15 * hi; ++iter) {
        double mid = 0.5 * (lo + hi);
        if (lp_fill(w, G, mid, a, NULL) >= S)
            hi = mid;
        else
            lo = mid;
    }
    return hi;
}

/* Solve the LP for S_g (continuous) into w->gseq. Returns 0 when the memory caps cannot hold S. */
static int lp_solve(const shares_ws *w, int32_t G, double S) {
    double lo = 0.0, hi = 1.0, phi = 0.5 * (sqrt(5.0) - 1.0);
    /* coarse scan first: the objective is unimodal in practice but may be flat near the ends */
    double best_a = 0.5, best_t = INFINITY;
    for (int i = 1; i < 32; ++i) {
        double a = i / 32.0, tt = lp_time(w, G, S, a);
        if (tt < best_t) {
            best_t = tt;
            best_a = a;
        }
    }
    if (!isfinite(best_t))
        return 0;
    lo = fmax(0.0, best_a - 1.0 / 32);
    hi = fmin(1.0, best_a + 1.0 / 32);
    double x1 = hi - phi * (hi - lo), x2 = lo + phi * (hi - lo);
    double f1 = lp_time(w, G, S, x1), f2 = lp_time(w, G, S, x2);
    for (int iter = 0; iter < 40; ++iter) {
        if (f1 <= f2) {
            hi = x2;
            x2 = x1;
            f2 = f1;
            x1 = hi - phi * (hi - lo);
            f1 = lp_time(w, G, S, x1);
        } else {
            lo = x1;
            x1 = x2;
            f1 = f2;
            x2 = lo + phi * (hi - lo);
            f2 = lp_time(w, G, S, x2);
        }
    }
    double a = f1 <= f2 ? x1 : x2, tt = fmin(f1, f2);
    if (best_t < tt) {
        a = best_a;
        tt = best_t;
    }
    lp_fill(w, G, tt, a, w->gseq);
    return 1;
}

/* Per-group phase times of an evaluated layout -> seconds per token coefficients. */
static void refit(sched *s, const hexiseq_layout *l, shares_ws *w) {
    for (int32_t g = 0; g < l->n_groups; ++g) {
        double gemm = 0, rest_a2a = 0, rest_ring = 0;
        for (int32_t r = w->offset[g]; r < w->offset[g + 1]; ++r) {
            gemm = fmax(gemm, s->per[r].gemm_s);
            rest_a2a = fmax(rest_a2a, s->per[r].a2a_s);
            rest_ring = fmax(rest_ring, s->per[r].attn_s + s->per[r].ring_exposed_s);
        }
        double Sg = (double)l->group_seq[g];
        w->cg[g] = gemm / Sg;
        w->cr[g] = (rest_a2a + rest_ring) / Sg;
    }
}

/* Integer S_g from w->gseq. */
static void round_groups(sched *s, hexiseq_layout *l, shares_ws *w) {
    round_shares(w->gseq, l->n_groups, s->S, TOKEN_GRANULE, 1, l->group_seq, w->tmpd);
}

/* Complete and optimise the shares of a structure (l->group_size, l->device set) and offer the result.
 * `unit` is the head granularity (1 or heads per kv head). */
static hexiseq_status optimise_shares(sched *s, hexiseq_layout *l, shares_ws *w, int32_t unit,
                                      hexiseq_plan_cost *out) {
    int32_t G = l->n_groups;
    w->offset[0] = 0;
    for (int32_t g = 0; g < G; ++g)
        w->offset[g + 1] = w->offset[g] + l->group_size[g];
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
        round_groups(s, l, w);
        ring_block = 0;
        for (int32_t g = 0; g < G; ++g)
            ring_block = fmax(ring_block, (double)l->group_seq[g]);
        memory_caps(s, l, w, ring_block, capacity);
        for (int32_t g = 0; g < G; ++g)
            fill_tokens(s, l, w, g, capacity);
        st = eval(s, l, &cost);
        if (st != HEXISEQ_OK)
            break;
        st = offer(s, l, &cost);
        if (st != HEXISEQ_OK)
            break;
        if (!have_local || better(&cost, &best_local)) {
            best_local = cost;
            have_local = 1;
            hexiseq_layout_copy(&keep, l);
        }
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

/* ------------------------------------------------------------------ ring order and local search */

/* Try every ring order of up to MAX_EXACT_ORDER groups (group 0 fixed: rotations are equivalent). */
static hexiseq_status try_orders(sched *s, const hexiseq_layout *base) {
    int32_t G = base->n_groups;
    if (G < 3 || G > MAX_EXACT_ORDER)
        return HEXISEQ_OK;
    int32_t perm[MAX_EXACT_ORDER], offset[MAX_EXACT_ORDER + 1];
    offset[0] = 0;
    for (int32_t g = 0; g < G; ++g) {
        perm[g] = g;
        offset[g + 1] = offset[g] + base->group_size[g];
    }
    hexiseq_layout l;
    HEXISEQ_CHECK(hexiseq_layout_alloc(G, base->n_devices, &l));
    hexiseq_status st = HEXISEQ_OK;
    /* lexicographic next_permutation over perm[1..G) */
    for (;;) {
        int32_t i = G - 2;
        while (i >= 1 && perm[i] >= perm[i + 1])
            --i;
        if (i < 1)
            break;
        int32_t j = G - 1;
        while (perm[j] <= perm[i])
            --j;
        int32_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
        for (int32_t a = i + 1, b = G - 1; a < b; ++a, --b) {
            tmp = perm[a];
            perm[a] = perm[b];
            perm[b] = tmp;
        }
        int32_t r = 0;
        for (int32_t g = 0; g < G; ++g) {
            int32_t src = perm[g];
            l.group_size[g] = base->group_size[src];
            l.group_seq[g] = base->group_seq[src];
            for (int32_t k = offset[src]; k < offset[src + 1]; ++k, ++r) {
                l.device[r] = base->device[k];
                l.tokens[r] = base->tokens[k];
                l.head_lo[r] = base->head_lo[k];
                l.head_count[r] = base->head_count[k];
            }
        }
        hexiseq_plan_cost cost;
        st = eval(s, &l, &cost);
        if (st != HEXISEQ_OK)
            break;
        st = offer(s, &l, &cost);
        if (st != HEXISEQ_OK)
            break;
    }
    hexiseq_layout_free(&l);
    return st;
}

/* Move `amount` tokens from group a to group b, taken from and given to members in proportion to the
 * tokens they hold (to the first member when b holds none). Returns 0 when a cannot give that much. */
static int shift_group_tokens(hexiseq_layout *l, const int32_t *offset, int32_t a, int32_t b, int64_t amount) {
    if (amount < 1 || l->group_seq[a] - amount < 1)
        return 0;
    int64_t Sa = l->group_seq[a], Sb = l->group_seq[b], taken = 0, given = 0;
    for (int32_t r = offset[a]; r < offset[a + 1]; ++r) {
        int64_t take = (int64_t)((double)amount * (double)l->tokens[r] / (double)Sa);
        if (take > l->tokens[r])
            take = l->tokens[r];
        l->tokens[r] -= take;
        taken += take;
    }
    for (int32_t r = offset[a]; r < offset[a + 1] && taken < amount; ++r) {
        int64_t take = l->tokens[r] < amount - taken ? l->tokens[r] : amount - taken;
        l->tokens[r] -= take;
        taken += take;
    }
    for (int32_t r = offset[b]; r < offset[b + 1]; ++r) {
        int64_t give = Sb > 0 ? (int64_t)((double)amount * (double)l->tokens[r] / (double)Sb) : 0;
        l->tokens[r] += give;
        given += give;
    }
    l->tokens[offset[b]] += amount - given;
    l->group_seq[a] -= amount;
    l->group_seq[b] += amount;
    return 1;
}

/* Hill climbing on the best layout. Moves: tokens between two groups, a head or tokens between two ranks
 * of a group; token amounts on a halving ladder from half the giver's share down
 * to one token. The first improving move is taken and the scan restarts, within an evaluation budget. */
static hexiseq_status local_search(sched *s, const hexiseq_layout *start, const hexiseq_plan_cost *start_cost,
                                   int64_t budget) {
    if (s->n > LOCAL_SEARCH_DEVICES)
        return HEXISEQ_OK;
    int32_t G = start->n_groups, n = start->n_devices;
    hexiseq_layout l, cur;
    HEXISEQ_CHECK(hexiseq_layout_alloc(G, n, &l));
    if (hexiseq_layout_alloc(G, n, &cur) != HEXISEQ_OK) {
        hexiseq_layout_free(&l);
        return HEXISEQ_ERR_NOMEM;
    }
    hexiseq_layout_copy(&cur, start);
    hexiseq_plan_cost cur_cost = *start_cost;
    int32_t *offset = malloc(((size_t)G + 1) * sizeof *offset);
    if (!offset) {
        hexiseq_layout_free(&l);
        hexiseq_layout_free(&cur);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch");
    }
    offset[0] = 0;
    for (int32_t g = 0; g < G; ++g)
        offset[g + 1] = offset[g] + cur.group_size[g];
    int32_t *group_of = malloc((size_t)n * sizeof *group_of);
    if (!group_of) {
        free(offset);
        hexiseq_layout_free(&l);
        hexiseq_layout_free(&cur);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch");
    }
    for (int32_t g = 0; g < G; ++g)
        for (int32_t r = offset[g]; r < offset[g + 1]; ++r)
            group_of[r] = g;
    hexiseq_status st = HEXISEQ_OK;
    int improved = 1;
    while (improved && budget > 0 && st == HEXISEQ_OK) {
        improved = 0;
        for (int kind = 0; kind < 3 && !improved && budget > 0 && st == HEXISEQ_OK; ++kind) {
            int32_t limit = kind == 0 ? G : n;
            for (int32_t a = 0; a < limit && !improved && budget > 0 && st == HEXISEQ_OK; ++a)
                for (int32_t b = 0; b < limit && !improved && budget > 0 && st == HEXISEQ_OK; ++b) {
                    if (a == b || (kind > 0 && group_of[a] != group_of[b]))
                        continue;
                    int64_t have = kind == 0 ? cur.group_seq[a] - 1 : cur.tokens[a];
                    int64_t amount = kind == 1 ? 1 : have / 2 > 0 ? have / 2 : have;
                    for (; amount >= 1 && !improved && budget > 0; amount /= 2) {
                        hexiseq_layout_copy(&l, &cur);
                        if (kind == 0) {
                            if (!shift_group_tokens(&l, offset, a, b, amount))
                                continue;
                        } else if (kind == 1) {
                            if (l.head_count[a] < 1)
                                break;
                            l.head_count[a]--;
                            l.head_count[b]++;
                            int32_t next = 0;
                            for (int32_t r = offset[group_of[a]]; r < offset[group_of[a] + 1]; ++r) {
                                l.head_lo[r] = next;
                                next += l.head_count[r];
                            }
                        } else {
                            if (l.tokens[a] < amount)
                                continue;
                            l.tokens[a] -= amount;
                            l.tokens[b] += amount;
                        }
                        hexiseq_plan_cost cost;
                        --budget;
                        st = eval(s, &l, &cost);
                        if (st != HEXISEQ_OK)
                            break;
                        if (better(&cost, &cur_cost)) {
                            hexiseq_layout_copy(&cur, &l);
                            cur_cost = cost;
                            st = offer(s, &l, &cost);
                            improved = 1;
                        }
                        if (kind == 1)
                            break;
                    }
                }
        }
    }
    free(group_of);
    free(offset);
    hexiseq_layout_free(&l);
    hexiseq_layout_free(&cur);
    return st;
}

/* ------------------------------------------------------------------ parking */

static hexiseq_status run_structure(sched *s, hexiseq_layout *l, double *score);
static hexiseq_status run_all_partitions(sched *s);

/* Small clusters: every proper subset of the devices as the active ones, each grouped every way (the parked
 * ones join the first group). With run_all_partitions over all devices this covers every structure. */
static hexiseq_status park_subsets(sched *s) {
    int32_t n = s->n;
    hexiseq_status st = HEXISEQ_OK;
    for (uint32_t mask = 1; mask + 1 < (1u << n) && st == HEXISEQ_OK; ++mask) {
        for (int32_t d = 0; d < n; ++d) {
            int active = (mask >> d) & 1u;
            s->fgemm[d] = active ? s->fgemm0[d] : 0.0;
            s->fattn[d] = active ? s->fattn0[d] : 0.0;
        }
        st = run_all_partitions(s);
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
static hexiseq_status park_search(sched *s) {
    if (!s->have_best || s->n > LOCAL_SEARCH_DEVICES || s->n < 2)
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
            int32_t g_of[LOCAL_SEARCH_DEVICES], new_index[LOCAL_SEARCH_DEVICES], r = 0, active_left = 0;
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
            st = run_structure(s, &l, &score);
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

/* ------------------------------------------------------------------ structures */

/* Node classes: nodes with the same GPU model, size and overrides take the same split. */
typedef struct {
    int32_t n_nodes;
    int32_t *node_first; /* [n_nodes] first device of each node */
    int32_t *node_count; /* [n_nodes] */
    int32_t *node_class; /* [n_nodes] */
    int32_t n_classes;
    int32_t *class_options;  /* [n_classes] number of split options */
    int32_t *choice;         /* [n_classes] current option: node split into 2^choice parts (capped) */
} topo;

static int same_curve(const hexiseq_rate_curve *a, const hexiseq_rate_curve *b) {
    if (a->n != b->n)
        return 0;
    for (int32_t i = 0; i < a->n; ++i)
        if (a->size[i] != b->size[i] || a->tflops[i] != b->tflops[i])
            return 0;
    return 1;
}

/* Same model, memory, rates and measured curves: devices the cost model cannot tell apart. */
static int same_device(const hexiseq_device_info *a, const hexiseq_device_info *b) {
    return a->gpu_index == b->gpu_index && strcmp(a->gpu_name, b->gpu_name) == 0 && a->memory_gib == b->memory_gib &&
           a->peak_tflops == b->peak_tflops && a->gemm_eff == b->gemm_eff && a->attn_eff == b->attn_eff &&
           same_curve(&a->gemm_curve, &b->gemm_curve) && same_curve(&a->attn_curve, &b->attn_curve) &&
           same_curve(&a->attn_causal_curve, &b->attn_causal_curve);
}

/* Devices a .. a + count and b .. b + count alike one by one (measured curves may differ per device). */
static int same_devices(const hexiseq_cluster *c, int32_t a, int32_t b, int32_t count) {
    for (int32_t i = 0; i < count; ++i)
        if (!same_device(&c->dev[a + i], &c->dev[b + i]))
            return 0;
    return 1;
}

/* Parts of a node of `count` devices under option o: min(2^o, count). */
static int32_t parts_of(int32_t count, int32_t o) {
    int64_t p = (int64_t)1 << (o < 30 ? o : 30);
    return p < count ? (int32_t)p : count;
}

static int32_t options_of(int32_t count) {
    int32_t o = 0;
    while (((int64_t)1 << o) < count)
        ++o;
    return o + 1;
}

/* Build groups in node order from the current choices: node k split into parts near-equal pieces. */
static hexiseq_status build_structure(const sched *s, const topo *tp, hexiseq_layout *l) {
    int32_t G = 0;
    for (int32_t k = 0; k < tp->n_nodes; ++k)
        G += parts_of(tp->node_count[k], tp->choice[tp->node_class[k]]);
    HEXISEQ_CHECK(hexiseq_layout_alloc(G, s->n, l));
    int32_t g = 0;
    for (int32_t k = 0; k < tp->n_nodes; ++k) {
        int32_t p = parts_of(tp->node_count[k], tp->choice[tp->node_class[k]]);
        for (int32_t i = 0; i < p; ++i)
            l->group_size[g++] = (int32_t)hexiseq_even_share(tp->node_count[k], p, i);
    }
    for (int32_t r = 0; r < s->n; ++r)
        l->device[r] = r;
    return HEXISEQ_OK;
}

static hexiseq_status alloc_ws(shares_ws *w, int32_t G, int32_t n) {
    memset(w, 0, sizeof *w);
    w->gseq = calloc((size_t)G, sizeof(double));
    w->cg = calloc((size_t)G, sizeof(double));
    w->cr = calloc((size_t)G, sizeof(double));
    w->ug = calloc((size_t)G, sizeof(double));
    w->tmp64 = calloc((size_t)n, sizeof(int64_t));
    w->tmpd = calloc((size_t)(n > G ? n : G), sizeof(double));
    w->offset = calloc((size_t)G + 1, sizeof(int32_t));
    w->free0 = calloc((size_t)n, sizeof(double));
    w->per_tok = calloc((size_t)n, sizeof(double));
    w->per_gtok = calloc((size_t)n, sizeof(double));
    if (!w->gseq || !w->cg || !w->cr || !w->ug || !w->tmp64 || !w->tmpd || !w->offset || !w->free0 || !w->per_tok ||
        !w->per_gtok)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch for %d groups", G);
    return HEXISEQ_OK;
}

static void free_ws(shares_ws *w) {
    free(w->gseq);
    free(w->cg);
    free(w->cr);
    free(w->ug);
    free(w->tmp64);
    free(w->tmpd);
    free(w->offset);
    free(w->free0);
    free(w->per_tok);
    free(w->per_gtok);
}

/* Optimise one structure (head units 1 and, with GQA, whole kv heads) and try its ring orders.
 * `score` gets the best predicted step time found for it (INFINITY if it fits nowhere). */
static hexiseq_status run_structure(sched *s, hexiseq_layout *l, double *score) {
    shares_ws w;
    hexiseq_status st = alloc_ws(&w, l->n_groups, s->n);
    *score = INFINITY;
    int32_t per_kv = s->m->heads / s->m->kv_heads;
    for (int unit_pass = 0; unit_pass < (per_kv > 1 ? 2 : 1) && st == HEXISEQ_OK; ++unit_pass) {
        hexiseq_plan_cost cost;
        cost.fits = 0;
        st = optimise_shares(s, l, &w, unit_pass ? per_kv : 1, &cost);
        if (st == HEXISEQ_OK && cost.fits && cost.step_time_s < *score)
            *score = cost.step_time_s;
        /* small clusters: polish every structure that comes close, not only the winner, so a structure
         * whose LP shares were slightly off is not lost */
        if (st == HEXISEQ_OK && s->n <= EXACT_PARTITION_DEVICES && cost.fits && s->have_best &&
            cost.step_time_s <= s->best_cost.step_time_s * 1.05)
            st = local_search(s, l, &cost, LOCAL_SEARCH_EVALS_STRUCT);
        if (st == HEXISEQ_OK)
            st = try_orders(s, l);
    }
    free_ws(&w);
    return st;
}

/* Groups of `hp` consecutive devices (they may span nodes). */
static hexiseq_status run_consecutive(sched *s, int32_t hp) {
    hexiseq_layout l;
    HEXISEQ_CHECK(hexiseq_layout_alloc(s->n / hp, s->n, &l));
    for (int32_t g = 0; g < l.n_groups; ++g)
        l.group_size[g] = hp;
    for (int32_t r = 0; r < s->n; ++r)
        l.device[r] = r;
    double score;
    hexiseq_status st = run_structure(s, &l, &score);
    hexiseq_layout_free(&l);
    return st;
}

/* Every partition of the active devices of a small cluster into groups (restricted growth strings:
 * device i joins one of the groups opened before it or opens the next); members ascending, groups in
 * order of their first device; parked devices (zero rate in s->fgemm) join the first group. */
static hexiseq_status run_all_partitions(sched *s) {
    int32_t n = s->n, active[EXACT_PARTITION_DEVICES], parked[EXACT_PARTITION_DEVICES], k = 0, p = 0;
    for (int32_t d = 0; d < n; ++d) {
        if (s->fgemm[d] > 0)
            active[k++] = d;
        else
            parked[p++] = d;
    }
    if (k == 0)
        return HEXISEQ_OK;
    int32_t a[EXACT_PARTITION_DEVICES] = {0}, maxv[EXACT_PARTITION_DEVICES] = {0};
    hexiseq_status st = HEXISEQ_OK;
    for (;;) {
        int32_t G = maxv[k - 1] + 1;
        hexiseq_layout l;
        st = hexiseq_layout_alloc(G, n, &l);
        if (st != HEXISEQ_OK)
            return st;
        int32_t r = 0;
        for (int32_t g = 0; g < G; ++g) {
            for (int32_t i = 0; i < k; ++i)
                if (a[i] == g) {
                    l.group_size[g]++;
                    l.device[r++] = active[i];
                }
            if (g == 0)
                for (int32_t i = 0; i < p; ++i) {
                    l.group_size[0]++;
                    l.device[r++] = parked[i];
                }
        }
        double score;
        st = run_structure(s, &l, &score);
        hexiseq_layout_free(&l);
        if (st != HEXISEQ_OK)
            return st;
        /* next restricted growth string */
        int32_t i = k - 1;
        while (i > 0 && a[i] == maxv[i - 1] + 1)
            --i;
        if (i == 0)
            break;
        a[i]++;
        maxv[i] = a[i] > maxv[i - 1] ? a[i] : maxv[i - 1];
        for (int32_t j = i + 1; j < k; ++j) {
            a[j] = 0;
            maxv[j] = maxv[i];
        }
    }
    return st;
}

static hexiseq_status run_topology(sched *s) {
    const hexiseq_cluster *c = s->c;
    topo tp;
    memset(&tp, 0, sizeof tp);
    tp.n_nodes = c->n_nodes;
    tp.node_first = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.node_count = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.node_class = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.class_options = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.choice = calloc((size_t)c->n_nodes, sizeof(int32_t));
    hexiseq_status st = HEXISEQ_OK;
    if (!tp.node_first || !tp.node_count || !tp.node_class || !tp.class_options || !tp.choice) {
        st = hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch");
        goto out;
    }
    for (int32_t r = 0; r < s->n; ++r) {
        int32_t k = c->dev[r].node;
        if (tp.node_count[k]++ == 0)
            tp.node_first[k] = r;
    }
    for (int32_t k = 0; k < tp.n_nodes; ++k) {
        int32_t cls = -1;
        for (int32_t j = 0; j < k && cls < 0; ++j)
            if (tp.node_count[j] == tp.node_count[k] && c->intra_gbps[j] == c->intra_gbps[k] &&
                same_devices(c, tp.node_first[j], tp.node_first[k], tp.node_count[k]))
                cls = tp.node_class[j];
        if (cls < 0) {
            cls = tp.n_classes++;
            tp.class_options[cls] = options_of(tp.node_count[k]);
        }
        tp.node_class[k] = cls;
    }
    int32_t max_options = 0;
    for (int32_t cl = 0; cl < tp.n_classes; ++cl)
        if (tp.class_options[cl] > max_options)
            max_options = tp.class_options[cl];
    /* uniform starts: every class split the same way; keep the best as the descent's start */
    double best_score = INFINITY;
    int32_t best_uniform = 0;
    for (int32_t o = 0; o < max_options && st == HEXISEQ_OK; ++o) {
        for (int32_t cl = 0; cl < tp.n_classes; ++cl)
            tp.choice[cl] = o < tp.class_options[cl] ? o : tp.class_options[cl] - 1;
        hexiseq_layout l;
        st = build_structure(s, &tp, &l);
        if (st != HEXISEQ_OK)
            break;
        double score;
        st = run_structure(s, &l, &score);
        hexiseq_layout_free(&l);
        if (score < best_score) {
            best_score = score;
            best_uniform = o;
        }
    }
    for (int32_t cl = 0; cl < tp.n_classes; ++cl)
        tp.choice[cl] = best_uniform < tp.class_options[cl] ? best_uniform : tp.class_options[cl] - 1;
    /* coordinate descent over the classes' splits */
    for (int round = 0; round < 3 && tp.n_classes > 1 && st == HEXISEQ_OK; ++round) {
        int moved = 0;
        for (int32_t cl = 0; cl < tp.n_classes && st == HEXISEQ_OK; ++cl) {
            int32_t keep = tp.choice[cl];
            for (int32_t o = 0; o < tp.class_options[cl] && st == HEXISEQ_OK; ++o) {
                if (o == keep)
                    continue;
                tp.choice[cl] = o;
                hexiseq_layout l;
                st = build_structure(s, &tp, &l);
                if (st != HEXISEQ_OK)
                    break;
                double score;
                st = run_structure(s, &l, &score);
                hexiseq_layout_free(&l);
                if (score < best_score * (1.0 - 1e-9)) {
                    best_score = score;
                    keep = o;
                    moved = 1;
                }
            }
            tp.choice[cl] = keep;
        }
        if (!moved)
            break;
    }
out:
    free(tp.node_first);
    free(tp.node_count);
    free(tp.node_class);
    free(tp.class_options);
    free(tp.choice);
    return st;
}

hexiseq_status hexiseq_schedule(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                int64_t seq_len, int32_t causal, hexiseq_layout *out, hexiseq_plan_cost *cost) {
    sched s;
    memset(&s, 0, sizeof s);
    s.c = c;
    s.m = m;
    s.t = t;
    s.S = seq_len;
    s.causal = causal;
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
    /* 0. the uniform baselines, exactly as their strategies build them */
    for (int strat = 0; strat < HEXISEQ_STRATEGY_HEXISEQ && st == HEXISEQ_OK; ++strat) {
        hexiseq_layout l;
        hexiseq_plan_cost pc;
        hexiseq_status bs = hexiseq_plan_strategy(c, m, t, seq_len, causal, (hexiseq_strategy)strat, &l, &pc);
        if (bs == HEXISEQ_OK || bs == HEXISEQ_ERR_MEMORY)
            st = offer(&s, &l, &pc);
        else if (bs != HEXISEQ_ERR_UNSUPPORTED)
            st = bs;
        hexiseq_layout_free(&l);
    }
    /* 1-4. structures from the topology, and groups spanning nodes; every partition when small */
    if (st == HEXISEQ_OK && s.n <= EXACT_PARTITION_DEVICES)
        st = run_all_partitions(&s);
    if (st == HEXISEQ_OK)
        st = run_topology(&s);
    int32_t max_node = 0;
    for (int32_t r = 0, k = -1, cnt = 0; r < s.n; ++r) {
        cnt = c->dev[r].node == k ? cnt + 1 : 1;
        k = c->dev[r].node;
        if (cnt > max_node)
            max_node = cnt;
    }
    for (int32_t hp = max_node + 1; hp <= s.n && st == HEXISEQ_OK; ++hp)
        if (s.n % hp == 0)
            st = run_consecutive(&s, hp);
    /* 5. polish: park devices that only slow the others down (every subset when small), then single moves */
    if (st == HEXISEQ_OK)
        st = s.n <= EXACT_PARTITION_DEVICES ? park_subsets(&s) : park_search(&s);
    if (st == HEXISEQ_OK && s.have_best) {
        hexiseq_layout start;
        st = hexiseq_layout_alloc(s.best.n_groups, s.n, &start);
        if (st == HEXISEQ_OK) {
            hexiseq_layout_copy(&start, &s.best);
            hexiseq_plan_cost start_cost = s.best_cost;
            st = local_search(&s, &start, &start_cost, s.n <= 16 ? LOCAL_SEARCH_EVALS_SMALL : LOCAL_SEARCH_EVALS);
            hexiseq_layout_free(&start);
        }
    }
    if (st == HEXISEQ_OK && !s.have_best)
        st = hexiseq_fail(HEXISEQ_ERR_INTERNAL, "scheduler found no candidate");
    if (st == HEXISEQ_OK) {
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
