/* Stage 4 of the scheduler (scheduler.c) and its polish: ring orders of a few groups, and a local search over single moves. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "levels.h"

/* ------------------------------------------------------------------ ring order and local search */

/* Try every ring order of up to MAX_EXACT_ORDER groups (group 0 fixed: rotations are equivalent). */
hexiseq_status hexiseq_sched_try_orders(sched *s, const hexiseq_layout *base) {
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
        st = hexiseq_sched_eval(s, &l, &cost);
        if (st != HEXISEQ_OK)
            break;
        st = hexiseq_sched_offer(s, &l, &cost);
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

/* The single moves of the local search, tried in this order. */
typedef enum {
    MOVE_GROUP_TOKENS = 0, /* tokens from group a to group b (S_a shrinks, S_b grows) */
    MOVE_HEAD = 1,         /* one query head from rank a to rank b of the same group */
    MOVE_RANK_TOKENS = 2,  /* tokens from rank a to rank b of the same group */
    MOVE_KIND_COUNT = 3
} move_kind;

/* Apply move (kind, a, b, amount) to l (a copy of the current layout). Returns 0 when it does not apply. */
static int apply_move(hexiseq_layout *l, const int32_t *offset, const int32_t *group_of, move_kind kind, int32_t a,
                      int32_t b, int64_t amount) {
    switch (kind) {
    case MOVE_GROUP_TOKENS:
        return shift_group_tokens(l, offset, a, b, amount);
    case MOVE_HEAD: {
        if (l->head_count[a] < 1)
            return 0;
        l->head_count[a]--;
        l->head_count[b]++;
        int32_t next = 0;
        for (int32_t r = offset[group_of[a]]; r < offset[group_of[a] + 1]; ++r) {
            l->head_lo[r] = next;
            next += l->head_count[r];
        }
        return 1;
    }
    case MOVE_RANK_TOKENS:
        if (l->tokens[a] < amount)
            return 0;
        l->tokens[a] -= amount;
        l->tokens[b] += amount;
        return 1;
    default:
        return 0;
    }
}

/* Hill climbing on the best layout. Moves (move_kind): tokens between two groups, a head or tokens between
 * two ranks of a group; token amounts on a halving ladder from half the giver's share down to one token.
 * The first improving move is taken and the scan restarts, within an evaluation budget. Pairs of ranks
 * are only those of one group (the scan never visits the n^2 pairs of the cluster). */
hexiseq_status hexiseq_sched_local_search(sched *s, const hexiseq_layout *start, const hexiseq_plan_cost *start_cost,
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
        for (move_kind kind = MOVE_GROUP_TOKENS; kind < MOVE_KIND_COUNT && !improved && budget > 0 && st == HEXISEQ_OK;
             ++kind) {
            int32_t limit = kind == MOVE_GROUP_TOKENS ? G : n;
            for (int32_t a = 0; a < limit && !improved && budget > 0 && st == HEXISEQ_OK; ++a) {
                /* partners: every other group, or the other ranks of a's group */
                int32_t b_lo = kind == MOVE_GROUP_TOKENS ? 0 : offset[group_of[a]];
                int32_t b_hi = kind == MOVE_GROUP_TOKENS ? G : offset[group_of[a] + 1];
                for (int32_t b = b_lo; b < b_hi && !improved && budget > 0 && st == HEXISEQ_OK; ++b) {
                    if (a == b)
                        continue;
                    int64_t have = kind == MOVE_GROUP_TOKENS ? cur.group_seq[a] - 1 : cur.tokens[a];
                    int64_t amount = kind == MOVE_HEAD ? 1 : have / 2 > 0 ? have / 2 : have;
                    for (; amount >= 1 && !improved && budget > 0; amount /= 2) {
                        hexiseq_layout_copy(&l, &cur);
                        if (!apply_move(&l, offset, group_of, kind, a, b, amount)) {
                            if (kind == MOVE_HEAD)
                                break;
                            continue;
                        }
                        hexiseq_plan_cost cost;
                        --budget;
                        st = hexiseq_sched_eval(s, &l, &cost);
                        if (st != HEXISEQ_OK)
                            break;
                        if (hexiseq_cost_better(&cost, &cur_cost)) {
                            hexiseq_layout_copy(&cur, &l);
                            cur_cost = cost;
                            st = hexiseq_sched_offer(s, &l, &cost);
                            improved = 1;
                        }
                        if (kind == MOVE_HEAD)
                            break;
                    }
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
