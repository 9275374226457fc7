/* Baseline strategies (Ring, Ulysses, USP) expressed as layouts of the general form and scored by the
 * same cost model as everything else. */
#include <stdlib.h>
#include <string.h>

#include "planner.h"

/* Uniform CP x HP mesh: `cp` groups of `hp` consecutive devices (consecutive ids share a node, so the
 * all-to-all stays on the fast links), ring in device order, equal sequence, token and head shares. */
static void uniform_layout(int32_t n, int32_t heads, int64_t seq_len, int32_t hp, hexiseq_layout *l) {
    int32_t cp = n / hp;
    for (int32_t g = 0; g < cp; ++g) {
        l->group_size[g] = hp;
        l->group_seq[g] = hexiseq_even_share(seq_len, cp, g);
        for (int32_t i = 0; i < hp; ++i) {
            int32_t r = g * hp + i;
            l->device[r] = r;
            l->tokens[r] = hexiseq_even_share(l->group_seq[g], hp, i);
            l->head_lo[r] = i * (heads / hp);
            l->head_count[r] = heads / hp;
        }
    }
}

hexiseq_status hexiseq_plan_baseline(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                     int64_t seq_len, int32_t causal, hexiseq_strategy strategy, hexiseq_budget *b,
                                     hexiseq_layout *out, hexiseq_plan_cost *cost) {
    int32_t n = c->n_devices;
    memset(out, 0, sizeof *out);
    hexiseq_device_cost *per = malloc((size_t)n * sizeof *per);
    if (!per)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate %d device costs", n);
    hexiseq_status st = HEXISEQ_OK;
    int found = 0;
    for (int32_t hp = 1; hp <= n && st == HEXISEQ_OK; ++hp) {
        if (n % hp != 0 || m->heads % hp != 0)
            continue;
        if (strategy == HEXISEQ_STRATEGY_RING && hp != 1)
            continue;
        if (strategy == HEXISEQ_STRATEGY_ULYSSES && hp != n)
            continue;
        int32_t cp = n / hp;
        if (seq_len < cp || seq_len < n)
            continue; /* a uniform split needs a token per device */
        st = hexiseq_budget_tick(b, found && cost->fits);
        if (st != HEXISEQ_OK)
            break;
        hexiseq_layout cand;
        hexiseq_plan_cost cc;
        st = hexiseq_layout_alloc(cp, n, &cand);
        if (st != HEXISEQ_OK)
            break;
        uniform_layout(n, m->heads, seq_len, hp, &cand);
        st = hexiseq_evaluate(c, m, t, seq_len, causal, &cand, per, &cc);
        if (st == HEXISEQ_OK && (!found || hexiseq_cost_better(&cc, cost))) {
            hexiseq_layout_free(out);
            *out = cand;
            *cost = cc;
            found = 1;
        } else {
            hexiseq_layout_free(&cand);
        }
    }
    free(per);
    if (st == HEXISEQ_ERR_CANCELLED && b->stopped == HEXISEQ_BUDGET_TIME && found)
        return st; /* the best so far stays in out */
    if (st != HEXISEQ_OK) {
        hexiseq_layout_free(out);
        return st;
    }
    if (!found) {
        if (strategy == HEXISEQ_STRATEGY_ULYSSES)
            return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                                "ulysses needs heads (%d) divisible by the device count (%d) and seq_len (%lld) >= devices",
                                m->heads, n, (long long)seq_len);
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "%s has no valid layout: seq_len %lld is shorter than the %d devices; plan seq_len >= %d",
                            hexiseq_strategy_name(strategy), (long long)seq_len, n, n);
    }
    return HEXISEQ_OK;
}
