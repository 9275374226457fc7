/* The assignment of one training step's sequences to groups of devices: which group runs each sequence, so that
 * the slowest group finishes as early as the groups' token capacities allow, with a lower bound beside it.
 *
 * The problem is scheduling on unrelated machines (R||Cmax) with a fixed time per machine and, with capacities,
 * bin packing on top. A group's time is fixed_s[g] + the sum of cost_s[g][i] over the sequences it holds.
 *
 * 1. Exhaustive, when G^N <= EXHAUSTIVE_LEAVES: branch and bound over the sequences in decreasing order of their
 *    cheapest cost, each tried in every group that can run it within its capacity; a branch is cut as soon as one
 *    group's time reaches the incumbent (which starts as the heuristic's assignment when it has one), and the
 *    search ends when the incumbent meets the lower bound. The result is optimal: exact = 1.
 * 2. Otherwise greedy: the sequences in decreasing order of their cheapest cost (longest first), each to the group
 *    where fixed + load + cost is smallest among those that can run it and have room (earliest finish, the
 *    standard rule for unrelated machines). A second placement takes them in decreasing order of tokens (largest
 *    first, as bin packing does); each placement is followed by the local search and the better result is kept
 *    (the second is skipped when the first meets the lower bound or the time limit has passed). When neither
 *    placement finds room for every sequence, the call fails with HEXISEQ_ERR_MEMORY naming the sequence the
 *    largest-first one left out and the room left.
 * 3. Local search from the greedy: each round takes the bottleneck group b (the slowest; the lowest index among
 *    equals) and looks at every move of one of its sequences to another group with room; when no move improves,
 *    at every swap of one of its sequences with one of another group's (while fewer than SWAP_WORK swap
 *    candidates have been scanned in all: past that the search moves only); when neither helps, b and one other
 *    group holding at most PAIR_ITEMS sequences together divide them anew, every way (pair_repartition). A
 *    candidate improves when the larger of the two groups' new times is below the makespan by more than a
 *    relative 1e-12; the round applies the best (the smallest such pair maximum, ties by the smaller sum of the
 *    two). Every applied change lowers the vector of group times sorted in decreasing order lexicographically (one
 *    time at the maximum drops below it, one below it stays below it, the rest do not change), so the search
 *    cannot cycle; it stops when a round finds nothing, after 50 N + 1000 rounds, or at the time limit. The swap
 *    scan prunes: b's sequences are taken costliest first, and once a candidate with pair maximum B is known, a
 *    sequence whose removal alone leaves b above B ends the scan; a partner j must have cost_s[b][j] <= B - (time
 *    of b without i), tested on the contiguous row of b before anything else is read.
 * 4. Lower bound, valid for every feasible assignment. Let A_i be the groups that can run sequence i within their
 *    capacity (finite cost, tokens[i] <= capacity); every feasible assignment puts i in some g(i) in A_i, and its
 *    makespan M is at least every group's time T_g = fixed_g + sum over i in g of cost_s[g][i].
 *    (a) M >= T_g(i) >= fixed_g(i) + cost_s[g(i)][i] >= min over g in A_i of (fixed_g + cost_s[g][i]), for every i;
 *        and M >= fixed_g for every g (a group holding nothing still pays it).
 *    (b) For any weights w_g >= 0 summing to 1, M = sum_g w_g M >= sum_g w_g T_g
 *        = sum_g w_g fixed_g + sum_i w_g(i) cost_s[g(i)][i] >= sum_g w_g fixed_g + sum_i min over g in A_i of
 *        w_g cost_s[g][i]. Any w gives a valid bound, so searching over w only tightens it. The search starts
 *        from w_g proportional to the group's speed, 1 / (sum of its finite costs over the sequences it can run),
 *        which is the best w when costs are uniform-related (cost_s[g][i] = f_i / s_g: the bound is then
 *        sum f / sum s), and takes a few exponentiated-gradient steps (the gradient of the bound in w_g is group
 *        g's fixed time plus the costs of the sequences whose minimum it attains: the fractional relaxation's
 *        load), keeping the best value. The value of (b) is lowered by a relative (N + G + 8) * DBL_EPSILON so
 *        that rounding in its sums cannot lift it above a true optimum.
 *    The bound reported is the larger of (a) and (b); exact = 1 also when the makespan is within a relative 1e-12
 *    of it. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "assign.h"
#include "clock.h"

#define EXHAUSTIVE_LEAVES 200000  /* G^N at most this: branch and bound, exact */
#define IMPROVE_REL 1e-12         /* a move must lower the makespan by more than this, relatively */
#define POLL_ROUNDS 1             /* the clock is read every this many rounds (or 4096 branch-and-bound nodes): a
                                     round costs far more than a clock read, and a short limit must be kept */
#define PAIR_ITEMS 14              /* two groups holding at most this many together may divide them anew */
#define PAIR_BUDGET 2000000       /* Gray-code steps of those divisions, in all */
#define SWAP_WORK 20000000         /* swap candidates scanned, in all: past it the search moves only */
#define BOUND_WORK 8e6            /* cost entries the weight search of the lower bound reads, in all */
#define BOUND_STEPS_MIN 4         /* weight-search steps, at least and at most */
#define BOUND_STEPS_MAX 40

/* The problem and the state of one assignment. */
typedef struct {
    int32_t G, N;
    const double *cost_s;      /* [G * N] row-major by group */
    const double *fixed_s;     /* [G] or NULL */
    const int64_t *tokens;     /* [N] */
    const int64_t *capacity;   /* [G] or NULL */
    int32_t *group_of;         /* [N] the group of each sequence (the caller's array) */
    double *load_s;            /* [G] fixed plus the costs held, seconds */
    int64_t *used;             /* [G] tokens held */
    int32_t *head;             /* [G] first sequence a group holds, -1: none */
    int32_t *next, *prev;      /* [N] the sequences a group holds, as a doubly linked list (-1 ends it) */
    double *own_s;             /* [N] cost of each sequence in the group that holds it (the swap scan reads it in order) */
    double *column_s;          /* [G] the costs of one sequence in every group, gathered (scratch) */
    int32_t *held;             /* [N] the bottleneck's sequences, costliest first (scratch) */
    int32_t *order;            /* [N] sequences in placement order */
    double *cheapest_s;        /* [N] min over the groups that can hold it of its cost, seconds */
    double deadline_s;         /* monotonic clock; INFINITY: no limit */
    int64_t max_rounds;        /* rounds of one local search at most, beside its own cap; 0: its own cap only */
    int64_t swap_budget;       /* swap candidates the local search may still scan (SWAP_WORK in all) */
} batch_state;

static double fixed_of(const batch_state *s, int32_t g) { return s->fixed_s ? s->fixed_s[g] : 0.0; }

/* Tokens group g has room for, beside what it holds (INT64_MAX without capacities). */
static int64_t room_of(const batch_state *s, int32_t g) {
    return s->capacity ? s->capacity[g] - s->used[g] : INT64_MAX;
}

/* Group g has room for `tokens` more once sequence `leaving` (-1: none), which it holds, has left. */
static int has_room(const batch_state *s, int32_t g, int64_t tokens, int32_t leaving) {
    if (!s->capacity)
        return 1;
    return tokens <= s->capacity[g] - (s->used[g] - (leaving >= 0 ? s->tokens[leaving] : 0));
}

/* Group g can run sequence i at all and has room for it. */
static int can_take(const batch_state *s, int32_t g, int32_t i) {
    return isfinite(s->cost_s[(size_t)g * s->N + i]) && has_room(s, g, s->tokens[i], -1);
}

static void state_reset(batch_state *s) {
    for (int32_t g = 0; g < s->G; ++g) {
        s->load_s[g] = fixed_of(s, g);
        s->used[g] = 0;
        s->head[g] = -1;
    }
}

static void state_put(batch_state *s, int32_t i, int32_t g) {
    s->group_of[i] = g;
    s->own_s[i] = s->cost_s[(size_t)g * s->N + i];
    s->load_s[g] += s->own_s[i];
    s->used[g] += s->tokens[i];
    s->prev[i] = -1;
    s->next[i] = s->head[g];
    if (s->head[g] >= 0)
        s->prev[s->head[g]] = i;
    s->head[g] = i;
}

static void state_take(batch_state *s, int32_t i) {
    int32_t g = s->group_of[i];
    s->load_s[g] -= s->cost_s[(size_t)g * s->N + i];
    s->used[g] -= s->tokens[i];
    if (s->prev[i] >= 0)
        s->next[s->prev[i]] = s->next[i];
    else
        s->head[g] = s->next[i];
    if (s->next[i] >= 0)
        s->prev[s->next[i]] = s->prev[i];
}

/* The times from scratch (fixed, then the costs in sequence order), so incremental rounding never reaches the
 * caller: group_time_s [G] out; returns the makespan. */
static double state_times(const batch_state *s, double *group_time_s) {
    for (int32_t g = 0; g < s->G; ++g)
        group_time_s[g] = fixed_of(s, g);
    for (int32_t i = 0; i < s->N; ++i)
        group_time_s[s->group_of[i]] += s->cost_s[(size_t)s->group_of[i] * s->N + i];
    double makespan_s = 0.0;
    for (int32_t g = 0; g < s->G; ++g)
        makespan_s = fmax(makespan_s, group_time_s[g]);
    return makespan_s;
}

static hexiseq_status batch_check(const hexiseq_batch_problem *p, double time_limit_s, const int32_t *group_of,
                                  const double *group_time_s, const hexiseq_batch_result *result) {
    if (!p || !group_time_s || !result)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "problem, group_time_s and result must not be NULL");
    if (p->n_groups < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "n_groups must be >= 1, got %d", (int)p->n_groups);
    if (p->n_seqs < 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "n_seqs must be >= 0, got %d", (int)p->n_seqs);
    if (isnan(time_limit_s))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "time_limit_s must be a number (<= 0: no limit), got NaN");
    int32_t G = p->n_groups, N = p->n_seqs;
    if (N > 0 && !p->cost_s)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "cost_s must not be NULL (n_seqs = %d)", (int)N);
    if (N > 0 && !p->tokens)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "tokens must not be NULL (n_seqs = %d)", (int)N);
    if (N > 0 && !group_of)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "group_of must not be NULL (n_seqs = %d)", (int)N);
    if ((size_t)G > SIZE_MAX / sizeof(double) / ((size_t)N + 1))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "n_groups * n_seqs too large: %d x %d", (int)G, (int)N);
    for (int32_t g = 0; p->fixed_s && g < G; ++g)
        if (!(isfinite(p->fixed_s[g]) && p->fixed_s[g] >= 0.0))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "fixed_s[%d] must be finite and >= 0, got %g", (int)g,
                                p->fixed_s[g]);
    for (int32_t g = 0; p->capacity && g < G; ++g)
        if (p->capacity[g] < 1)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "capacity[%d] must be >= 1, got %lld", (int)g,
                                (long long)p->capacity[g]);
    for (int32_t i = 0; i < N; ++i)
        if (p->tokens[i] < 1)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "tokens[%d] must be >= 1, got %lld", (int)i,
                                (long long)p->tokens[i]);
    for (int32_t g = 0; g < G; ++g)
        for (int32_t i = 0; i < N; ++i) {
            double c = p->cost_s[(size_t)g * N + i];
            if (!(c >= 0.0)) /* negative, -INFINITY or NaN */
                return hexiseq_fail(HEXISEQ_ERR_INVALID, "cost_s[%d][%d] must be >= 0 or INFINITY, got %g", (int)g,
                                    (int)i, c);
        }
    return HEXISEQ_OK;
}

/* Every sequence has a group that can run it within its whole capacity; fills cheapest_s. */
static hexiseq_status batch_check_fits(batch_state *s) {
    for (int32_t i = 0; i < s->N; ++i) {
        double cheapest = INFINITY;
        int64_t most_capacity = 0;
        int runnable = 0;
        for (int32_t g = 0; g < s->G; ++g) {
            double c = s->cost_s[(size_t)g * s->N + i];
            if (!isfinite(c))
                continue;
            runnable = 1;
            int64_t cap = s->capacity ? s->capacity[g] : INT64_MAX;
            if (cap > most_capacity)
                most_capacity = cap;
            if (s->tokens[i] <= cap && c < cheapest)
                cheapest = c;
        }
        if (!runnable)
            return hexiseq_fail(HEXISEQ_ERR_MEMORY, "no group can hold sequence %d (%lld tokens): cost_s is INFINITY "
                                "for it in every group", (int)i, (long long)s->tokens[i]);
        if (!isfinite(cheapest))
            return hexiseq_fail(HEXISEQ_ERR_MEMORY, "no group can hold sequence %d (%lld tokens): the groups that "
                                "can run it have a capacity of at most %lld tokens", (int)i,
                                (long long)s->tokens[i], (long long)most_capacity);
        s->cheapest_s[i] = cheapest;
    }
    return HEXISEQ_OK;
}

/* The sequences in the order `first` says (a stable merge sort: qsort has no context argument and planning calls
 * may run on several threads at once). order [N] out, tmp [N] scratch. */
static void sort_order(const batch_state *s, int32_t *order, int32_t *tmp, int (*less)(const batch_state *, int32_t,
                                                                                      int32_t)) {
    int32_t N = s->N;
    for (int32_t i = 0; i < N; ++i)
        order[i] = i;
    for (int32_t width = 1; width < N; width *= 2) {
        for (int32_t lo = 0; lo < N; lo += 2 * width) {
            int32_t mid = lo + width < N ? lo + width : N, hi = lo + 2 * width < N ? lo + 2 * width : N;
            int32_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi)
                tmp[k++] = less(s, order[b], order[a]) ? order[b++] : order[a++];
            while (a < mid)
                tmp[k++] = order[a++];
            while (b < hi)
                tmp[k++] = order[b++];
        }
        memcpy(order, tmp, (size_t)N * sizeof *order);
    }
}

static int cost_first(const batch_state *s, int32_t i, int32_t j) {
    if (s->cheapest_s[i] != s->cheapest_s[j])
        return s->cheapest_s[i] > s->cheapest_s[j];
    if (s->tokens[i] != s->tokens[j])
        return s->tokens[i] > s->tokens[j];
    return i < j;
}

static int tokens_first(const batch_state *s, int32_t i, int32_t j) {
    if (s->tokens[i] != s->tokens[j])
        return s->tokens[i] > s->tokens[j];
    if (s->cheapest_s[i] != s->cheapest_s[j])
        return s->cheapest_s[i] > s->cheapest_s[j];
    return i < j;
}

/* Earliest finish in s->order; returns -1 when everything was placed, else the sequence that found no room. */
static int32_t greedy_place(batch_state *s) {
    state_reset(s);
    for (int32_t k = 0; k < s->N; ++k) {
        int32_t i = s->order[k], best = -1;
        double best_finish = INFINITY, best_cost = INFINITY;
        for (int32_t g = 0; g < s->G; ++g) {
            if (!can_take(s, g, i))
                continue;
            double c = s->cost_s[(size_t)g * s->N + i], finish = s->load_s[g] + c;
            if (best < 0 || finish < best_finish || (finish == best_finish && c < best_cost)) {
                best = g;
                best_finish = finish;
                best_cost = c;
            }
        }
        if (best < 0)
            return i;
        state_put(s, i, best);
    }
    return -1;
}

/* The error of a sequence the greedy placement found no room for. */
static hexiseq_status greedy_error(const batch_state *s, int32_t i) {
    int64_t most_room = 0, all_room = 0;
    for (int32_t g = 0; g < s->G; ++g) {
        int64_t room = room_of(s, g);
        if (room > INT64_MAX - all_room)
            all_room = INT64_MAX;
        else
            all_room += room;
        if (isfinite(s->cost_s[(size_t)g * s->N + i]) && room > most_room)
            most_room = room;
    }
    return hexiseq_fail(HEXISEQ_ERR_MEMORY, "the greedy placement found no group with room for sequence %d (%lld "
                        "tokens): the groups that can run it have at most %lld tokens free (%lld free in all "
                        "groups); capacities make this bin packing, so a fit may exist that the greedy missed",
                        (int)i, (long long)s->tokens[i], (long long)most_room, (long long)all_room);
}

/* The second neighbourhood of the local search, for when no move or swap helps: the bottleneck b and one other
 * group h divide the sequences they hold between them anew, every way (a Gray code flips one sequence per step),
 * when they hold at most PAIR_ITEMS together. Applies the best division whose larger time is below the makespan by
 * more than a relative 1e-12 (over every such h; ties by the smaller sum); returns 1 when it applied one.
 * *budget: Gray-code steps left to the whole search, lowered by what this call takes. */
static int pair_repartition(batch_state *s, int32_t b, int64_t *budget) {
    const int32_t N = s->N;
    const double M = s->load_s[b];
    double best_max = M * (1.0 - IMPROVE_REL), best_sum = INFINITY;
    int32_t best_h = -1, items[PAIR_ITEMS], best_items[PAIR_ITEMS], best_k = 0;
    uint32_t best_mask = 0;
    for (int32_t h = 0; h < s->G; ++h) {
        if (h == b)
            continue;
        int32_t k = 0;
        for (int32_t i = s->head[b]; i >= 0 && k <= PAIR_ITEMS; i = s->next[i])
            if (k < PAIR_ITEMS)
                items[k++] = i;
            else
                k = PAIR_ITEMS + 1;
        for (int32_t i = s->head[h]; i >= 0 && k <= PAIR_ITEMS; i = s->next[i])
            if (k < PAIR_ITEMS)
                items[k++] = i;
            else
                k = PAIR_ITEMS + 1;
        if (k > PAIR_ITEMS || k < 2 || *budget < ((int64_t)1 << k))
            continue;
        *budget -= (int64_t)1 << k;
        /* each side's time over the sequences it can run, how many it holds that it cannot, its tokens */
        double t[2] = {fixed_of(s, b), fixed_of(s, h)};
        int32_t bad[2] = {0, 0}, side_group[2] = {b, h};
        int64_t used[2] = {0, 0};
        int side[PAIR_ITEMS];
        for (int32_t x = 0; x < k; ++x) {
            side[x] = s->group_of[items[x]] == h;
            t[side[x]] += s->cost_s[(size_t)side_group[side[x]] * N + items[x]];
            used[side[x]] += s->tokens[items[x]];
        }
        for (uint32_t step = 1; step < (1u << k); ++step) {
            int32_t x = __builtin_ctz(step), from = side[x], to = 1 - from;
            double c_from = s->cost_s[(size_t)side_group[from] * N + items[x]];
            double c_to = s->cost_s[(size_t)side_group[to] * N + items[x]];
            if (isfinite(c_from))
                t[from] -= c_from;
            else
                bad[from]--;
            if (isfinite(c_to))
                t[to] += c_to;
            else
                bad[to]++;
            used[from] -= s->tokens[items[x]];
            used[to] += s->tokens[items[x]];
            side[x] = to;
            if (bad[0] || bad[1])
                continue;
            if (s->capacity && (used[0] > s->capacity[b] || used[1] > s->capacity[h]))
                continue;
            double nmax = fmax(t[0], t[1]), nsum = t[0] + t[1];
            if (nmax < best_max || (best_h >= 0 && nmax == best_max && nsum < best_sum)) {
                best_max = nmax;
                best_sum = nsum;
                best_h = h;
                best_k = k;
                best_mask = step ^ (step >> 1); /* the Gray code of step: which sequences changed side */
                memcpy(best_items, items, (size_t)k * sizeof *items);
            }
        }
    }
    if (best_h < 0)
        return 0;
    /* the times above were kept incrementally: check the division from scratch before applying it */
    double t_b = fixed_of(s, b), t_h = fixed_of(s, best_h);
    for (int32_t x = 0; x < best_k; ++x) {
        int32_t i = best_items[x], g = s->group_of[i];
        if (best_mask >> x & 1u)
            g = g == b ? best_h : b;
        if (g == b)
            t_b += s->cost_s[(size_t)b * N + i];
        else
            t_h += s->cost_s[(size_t)best_h * N + i];
    }
    if (!(fmax(t_b, t_h) < M * (1.0 - IMPROVE_REL)))
        return 0;
    for (int32_t x = 0; x < best_k; ++x)
        if (best_mask >> x & 1u) {
            int32_t i = best_items[x], to = s->group_of[i] == b ? best_h : b;
            state_take(s, i);
            state_put(s, i, to);
        }
    return 1;
}

/* The local search of step 3; returns its rounds. */
static int64_t local_search(batch_state *s) {
    const int32_t G = s->G, N = s->N;
    const double *cost = s->cost_s;
    const int64_t *tok = s->tokens;
    int64_t cap_rounds = 50 * (int64_t)N + 1000;
    if (s->max_rounds > 0 && s->max_rounds < cap_rounds)
        cap_rounds = s->max_rounds;
    int64_t rounds = 0, pair_budget = PAIR_BUDGET;
    while (rounds < cap_rounds) {
        if (isfinite(s->deadline_s) && rounds % POLL_ROUNDS == 0 && rounds > 0 && hexiseq_now_s() >= s->deadline_s)
            break;
        ++rounds;
        int32_t b = 0;
        for (int32_t g = 1; g < G; ++g)
            if (s->load_s[g] > s->load_s[b])
                b = g;
        const double M = s->load_s[b];
        const double *cb = cost + (size_t)b * N;
        double best_max = M * (1.0 - IMPROVE_REL), best_sum = INFINITY;
        int found = 0;
        int32_t best_i = -1, best_j = -1, best_h = -1; /* best_j < 0: a move of best_i to best_h */
        /* moves first; the swaps (N candidates per sequence of b, not G) only when no move improves */
        for (int32_t i = s->head[b]; i >= 0; i = s->next[i]) {
            const double rest = M - cb[i]; /* b's time without i */
            if (rest > best_max)
                continue;
            for (int32_t h = 0; h < G; ++h) {
                if (h == b || !can_take(s, h, i))
                    continue;
                double nh = s->load_s[h] + cost[(size_t)h * N + i], nmax = fmax(rest, nh), nsum = rest + nh;
                if (nmax < best_max || (found && nmax == best_max && nsum < best_sum)) {
                    best_max = nmax;
                    best_sum = nsum;
                    best_i = i, best_j = -1, best_h = h;
                    found = 1;
                }
            }
        }
        /* b's sequences costliest first: their swaps lower b the most, and once one is found, a sequence whose
         * removal leaves b above it is skipped whole */
        int32_t held = 0;
        for (int32_t i = found || s->swap_budget <= 0 ? -1 : s->head[b]; i >= 0; i = s->next[i]) {
            int32_t k = held++;
            for (; k > 0 && cb[s->held[k - 1]] < cb[i]; --k)
                s->held[k] = s->held[k - 1];
            s->held[k] = i;
        }
        for (int32_t k = 0; k < held; ++k) {
            const int32_t i = s->held[k];
            const double rest = M - cb[i];
            if (rest > best_max)
                break;
            s->swap_budget -= N;
            double *ci = s->column_s; /* i's costs gathered once: the scan below then reads only arrays in order */
            for (int32_t h = 0; h < G; ++h)
                ci[h] = cost[(size_t)h * N + i];
            for (int32_t j = 0; j < N; ++j) { /* swaps with every sequence outside b */
                if (!(cb[j] <= best_max - rest)) /* b's new time would already be too high (or b cannot run j) */
                    continue;
                int32_t h = s->group_of[j];
                double nh = s->load_s[h] - s->own_s[j] + ci[h]; /* INFINITY when h cannot run i */
                if (h == b || !(nh <= best_max))
                    continue;
                if (!has_room(s, b, tok[j], i) || !has_room(s, h, tok[i], j))
                    continue;
                double nb = rest + cb[j], nmax = fmax(nb, nh), nsum = nb + nh;
                if (nmax < best_max || (found && nmax == best_max && nsum < best_sum)) {
                    best_max = nmax;
                    best_sum = nsum;
                    best_i = i, best_j = j, best_h = h;
                    found = 1;
                }
            }
        }
        if (!found) {
            if (pair_repartition(s, b, &pair_budget))
                continue;
            break;
        }
        state_take(s, best_i);
        if (best_j >= 0) {
            state_take(s, best_j);
            state_put(s, best_j, b);
        }
        state_put(s, best_i, best_h);
    }
    return rounds;
}

/* Steps 2 and 3 from two starts: the greedy placement longest first, then largest first (tokens), each followed
 * by the local search; the better result stays in s->group_of, its times in group_time_s [G] out. The second start
 * is skipped when the first meets `lower_bound_s`. Fails (HEXISEQ_ERR_MEMORY) when neither placement found room
 * for everything. *rounds: the local search's rounds, both starts together. keep [N], tmp [N] scratch. */
static hexiseq_status heuristic(batch_state *s, double lower_bound_s, int32_t *keep, int32_t *tmp,
                                double *group_time_s, int64_t *rounds) {
    double best_s = INFINITY;
    *rounds = 0;
    for (int start = 0; start < (s->max_rounds > 0 ? 1 : 2); ++start) { /* a count of rounds: the first start only */
        if (best_s <= lower_bound_s * (1.0 + IMPROVE_REL) ||
            (start > 0 && isfinite(best_s) && isfinite(s->deadline_s) && hexiseq_now_s() >= s->deadline_s))
            break;
        sort_order(s, s->order, tmp, start == 0 ? cost_first : tokens_first);
        int32_t unplaced = greedy_place(s);
        if (unplaced >= 0)
            continue;
        *rounds += local_search(s);
        double makespan_s = state_times(s, group_time_s);
        if (makespan_s < best_s) {
            best_s = makespan_s;
            if (s->N > 0) /* group_of may be NULL when N = 0 */
                memcpy(keep, s->group_of, (size_t)s->N * sizeof *keep);
        }
    }
    if (!isfinite(best_s)) {
        sort_order(s, s->order, tmp, tokens_first); /* name what the largest-first placement left out */
        return greedy_error(s, greedy_place(s));
    }
    if (s->N > 0)
        memcpy(s->group_of, keep, (size_t)s->N * sizeof *keep);
    state_times(s, group_time_s);
    return HEXISEQ_OK;
}

/* Branch and bound of step 1. */
typedef struct {
    batch_state *s;
    int32_t *current;     /* [N] the group of each sequence on the current branch */
    double best_s;        /* the incumbent's makespan (INFINITY: none yet) */
    double stop_at_s;     /* a makespan that meets the lower bound: the search ends there */
    int32_t found;        /* the incumbent is in s->group_of */
    int32_t stopped;      /* the time limit ended the search */
    int64_t nodes;
} batch_bnb;

static void bnb_descend(batch_bnb *t, int32_t k, double branch_max_s) {
    batch_state *s = t->s;
    if (t->stopped || t->best_s <= t->stop_at_s)
        return;
    if (k == s->N) {
        if (branch_max_s < t->best_s) {
            t->best_s = branch_max_s;
            if (s->N > 0)
                memcpy(s->group_of, t->current, (size_t)s->N * sizeof *t->current);
            t->found = 1;
        }
        return;
    }
    if (++t->nodes % 4096 == 0 && isfinite(s->deadline_s) && hexiseq_now_s() >= s->deadline_s) {
        t->stopped = 1;
        return;
    }
    int32_t i = s->order[k];
    for (int32_t g = 0; g < s->G; ++g) {
        if (!can_take(s, g, i))
            continue;
        double was_s = s->load_s[g], now_s = was_s + s->cost_s[(size_t)g * s->N + i];
        if (now_s >= t->best_s)
            continue;
        s->load_s[g] = now_s;
        s->used[g] += s->tokens[i];
        t->current[i] = g;
        bnb_descend(t, k + 1, fmax(branch_max_s, now_s));
        s->load_s[g] = was_s;
        s->used[g] -= s->tokens[i];
        if (t->stopped || t->best_s <= t->stop_at_s)
            return;
    }
}

/* Exhaustive search from the incumbent in s->group_of (when have_incumbent); returns 1 when it completed (the
 * assignment in s->group_of is optimal), 0 when the time limit stopped it; *found: some assignment fits. */
static int exhaustive(batch_state *s, int32_t *current, double incumbent_s, int have_incumbent, double lower_bound_s,
                      int *found, int32_t *tmp) {
    batch_bnb t = {s, current, have_incumbent ? incumbent_s : INFINITY, lower_bound_s * (1.0 + IMPROVE_REL),
                   have_incumbent, 0, 0};
    sort_order(s, s->order, tmp, cost_first);
    state_reset(s);
    double start_max = 0.0;
    for (int32_t g = 0; g < s->G; ++g)
        start_max = fmax(start_max, s->load_s[g]);
    bnb_descend(&t, 0, start_max);
    *found = t.found;
    return !t.stopped;
}

/* The lower bound of step 4. weight, gain [G], best_cost [N] scratch. */
static double lower_bound(const batch_state *s, int32_t max_steps, double *weight, double *gain, double *best_cost) {
    const int32_t G = s->G, N = s->N;
    double bound_s = 0.0;
    for (int32_t g = 0; g < G; ++g) /* (a): every group pays its fixed time */
        bound_s = fmax(bound_s, fixed_of(s, g));
    for (int32_t i = 0; i < N; ++i) { /* (a): every sequence runs somewhere */
        double least = INFINITY;
        for (int32_t g = 0; g < G; ++g)
            if (s->tokens[i] <= (s->capacity ? s->capacity[g] : INT64_MAX))
                least = fmin(least, fixed_of(s, g) + s->cost_s[(size_t)g * N + i]);
        bound_s = fmax(bound_s, least);
    }
    if (N == 0)
        return bound_s;
    /* (b): weights start proportional to speed; a group whose finite costs sum to 0 starts at 0 */
    double total = 0.0;
    for (int32_t g = 0; g < G; ++g) {
        double sum = 0.0;
        for (int32_t i = 0; i < N; ++i) {
            double c = s->cost_s[(size_t)g * N + i];
            if (isfinite(c) && s->tokens[i] <= (s->capacity ? s->capacity[g] : INT64_MAX))
                sum += c;
        }
        weight[g] = sum > 0.0 ? 1.0 / sum : 0.0;
        total += weight[g];
    }
    for (int32_t g = 0; g < G; ++g)
        weight[g] = total > 0.0 ? weight[g] / total : 1.0 / G;
    double work = (double)G * (double)N;
    int32_t steps = work * BOUND_STEPS_MAX <= BOUND_WORK ? BOUND_STEPS_MAX
                    : work * BOUND_STEPS_MIN >= BOUND_WORK ? BOUND_STEPS_MIN
                                                            : (int32_t)(BOUND_WORK / work);
    if (steps > max_steps)
        steps = max_steps;
    double best_b = 0.0;
    for (int32_t step = 0; step < steps; ++step) {
        /* value and gradient at `weight`: gain[g] = fixed + the costs of the sequences whose minimum g attains */
        for (int32_t i = 0; i < N; ++i)
            best_cost[i] = INFINITY;
        for (int32_t g = 0; g < G; ++g) {
            const double *cg = s->cost_s + (size_t)g * N;
            int64_t cap = s->capacity ? s->capacity[g] : INT64_MAX;
            for (int32_t i = 0; i < N; ++i)
                if (isfinite(cg[i]) && s->tokens[i] <= cap && weight[g] * cg[i] < best_cost[i])
                    best_cost[i] = weight[g] * cg[i];
        }
        double value = 0.0;
        for (int32_t g = 0; g < G; ++g) {
            value += weight[g] * fixed_of(s, g);
            gain[g] = fixed_of(s, g);
        }
        for (int32_t i = 0; i < N; ++i)
            value += best_cost[i];
        best_b = fmax(best_b, value);
        if (!(value > 0.0) || step + 1 == steps)
            break;
        /* the argmin per sequence, attributed in a second pass over the rows (the first one that attains it) */
        for (int32_t g = 0; g < G; ++g) {
            const double *cg = s->cost_s + (size_t)g * N;
            int64_t cap = s->capacity ? s->capacity[g] : INT64_MAX;
            for (int32_t i = 0; i < N; ++i)
                if (isfinite(cg[i]) && s->tokens[i] <= cap && weight[g] * cg[i] == best_cost[i]) {
                    gain[g] += cg[i];
                    best_cost[i] = -1.0; /* attributed */
                }
        }
        /* exponentiated gradient: up where the fractional load is above the bound, down where below; a little of
         * the uniform mixed in so no weight stays at 0 */
        double eta = 1.0 / sqrt((double)step + 1.0), sum = 0.0;
        for (int32_t g = 0; g < G; ++g) {
            double x = eta * (gain[g] - value) / value;
            weight[g] = (0.99 * weight[g] + 0.01 / G) * exp(fmin(x, 30.0));
            sum += weight[g];
        }
        for (int32_t g = 0; g < G; ++g)
            weight[g] /= sum;
    }
    best_b *= 1.0 - (double)(N + G + 8) * DBL_EPSILON;
    return fmax(bound_s, best_b);
}

/* quick: neither the exhaustive search nor the weight search of the lower bound (one weighted evaluation only). */
static hexiseq_status batch_assign(const hexiseq_batch_problem *p, double time_limit_s, int allow_exhaustive,
                                   int quick, int64_t max_rounds, int32_t *group_of, double *group_time_s,
                                   hexiseq_batch_result *result) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(batch_check(p, time_limit_s, group_of, group_time_s, result));
    const int32_t G = p->n_groups, N = p->n_seqs;
    memset(result, 0, sizeof *result);
    batch_state s = {.G = G, .N = N, .cost_s = p->cost_s, .fixed_s = p->fixed_s, .tokens = p->tokens,
                     .capacity = p->capacity, .group_of = group_of,
                     .swap_budget = SWAP_WORK, .max_rounds = max_rounds,
                     .deadline_s = time_limit_s > 0 ? hexiseq_now_s() + time_limit_s : INFINITY};
    size_t nG = (size_t)G, nN = (size_t)N + 1;
    s.load_s = malloc(nG * sizeof *s.load_s);
    s.used = malloc(nG * sizeof *s.used);
    s.head = malloc(nG * sizeof *s.head);
    s.next = malloc(nN * sizeof *s.next);
    s.prev = malloc(nN * sizeof *s.prev);
    s.order = malloc(nN * sizeof *s.order);
    s.own_s = malloc(nN * sizeof *s.own_s);
    s.held = malloc(nN * sizeof *s.held);
    s.column_s = malloc(nG * sizeof *s.column_s);
    s.cheapest_s = malloc(nN * sizeof *s.cheapest_s);
    int32_t *tmp = malloc(nN * sizeof *tmp), *current = malloc(nN * sizeof *current);
    double *weight = malloc(nG * sizeof *weight), *gain = malloc(nG * sizeof *gain);
    double *scratch = malloc(nN * sizeof *scratch);
    hexiseq_status st = HEXISEQ_OK;
    if (!s.load_s || !s.used || !s.head || !s.next || !s.prev || !s.order || !s.own_s || !s.column_s || !s.held || !s.cheapest_s || !tmp || !current ||
        !weight || !gain || !scratch) {
        st = hexiseq_fail(HEXISEQ_ERR_NOMEM, "batch assignment: no memory for %d groups x %d sequences", (int)G,
                          (int)N);
        goto done;
    }
    st = batch_check_fits(&s);
    if (st != HEXISEQ_OK)
        goto done;
    result->lower_bound_s = lower_bound(&s, quick ? 1 : BOUND_STEPS_MAX, weight, gain, scratch);

    /* G^N, stopping as soon as it passes the limit */
    double leaves = 1.0;
    for (int32_t k = 0; k < N && leaves <= EXHAUSTIVE_LEAVES; ++k)
        leaves *= G;
    /* one group: the one assignment there is (and no branch and bound N deep) */
    int small = allow_exhaustive && !quick && G > 1 && leaves <= EXHAUSTIVE_LEAVES;

    st = heuristic(&s, result->lower_bound_s, current, tmp, group_time_s, &result->iterations);
    int have_heuristic = st == HEXISEQ_OK;
    if (!have_heuristic && !small)
        goto done;
    double heuristic_s = have_heuristic ? state_times(&s, group_time_s) : INFINITY;
    int proven = G == 1;
    if (small) {
        int found = 0;
        proven = exhaustive(&s, current, heuristic_s, have_heuristic, result->lower_bound_s, &found, tmp);
        if (!found) {
            st = proven ? hexiseq_fail(HEXISEQ_ERR_MEMORY, "no assignment of the %d sequences fits the groups' "
                                       "capacities (searched exhaustively)", (int)N)
                        : hexiseq_fail(HEXISEQ_ERR_MEMORY, "no assignment fitting the groups' capacities was found "
                                       "within time_limit_s = %g", time_limit_s);
            goto done;
        }
        hexiseq_clear_error();
        st = HEXISEQ_OK;
    }
    result->makespan_s = state_times(&s, group_time_s);
    result->exact = proven || result->makespan_s <= result->lower_bound_s * (1.0 + IMPROVE_REL);
done:
    free(s.load_s);
    free(s.used);
    free(s.head);
    free(s.next);
    free(s.prev);
    free(s.order);
    free(s.own_s);
    free(s.held);
    free(s.column_s);
    free(s.cheapest_s);
    free(tmp);
    free(current);
    free(weight);
    free(gain);
    free(scratch);
    return st;
}

hexiseq_status hexiseq_batch_assign(const hexiseq_batch_problem *p, double time_limit_s, int32_t *group_of,
                                    double *group_time_s, hexiseq_batch_result *result) {
    return batch_assign(p, time_limit_s, 1, 0, 0, group_of, group_time_s, result);
}

hexiseq_status hexiseq_batch_assign_quick(const hexiseq_batch_problem *p, double time_limit_s, int32_t *group_of,
                                          double *group_time_s, hexiseq_batch_result *result) {
    return batch_assign(p, time_limit_s, 0, 1, 0, group_of, group_time_s, result);
}

hexiseq_status hexiseq_batch_assign_heuristic(const hexiseq_batch_problem *p, double time_limit_s,
                                              int32_t *group_of, double *group_time_s, hexiseq_batch_result *result) {
    return batch_assign(p, time_limit_s, 0, 0, 0, group_of, group_time_s, result);
}

hexiseq_status hexiseq_batch_assign_rounds(const hexiseq_batch_problem *p, int64_t max_rounds, int32_t *group_of,
                                           double *group_time_s, hexiseq_batch_result *result) {
    if (max_rounds < 1) {
        hexiseq_clear_error();
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "max_rounds must be >= 1, got %lld", (long long)max_rounds);
    }
    return batch_assign(p, 0.0, 0, 1, max_rounds, group_of, group_time_s, result);
}
