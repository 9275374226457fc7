/* Baseline strategies (Ring, Ulysses, USP) expressed as layouts of the general form and scored by the
 * same cost model as everything else. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

const char *hexiseq_strategy_name(hexiseq_strategy s) {
    switch (s) {
    case HEXISEQ_STRATEGY_RING: return "ring";
    case HEXISEQ_STRATEGY_ULYSSES: return "ulysses";
    case HEXISEQ_STRATEGY_USP: return "usp";
    case HEXISEQ_STRATEGY_HEXISEQ: return "hexiseq";
    default: return "unknown";
    }
}

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

/* The error for a best candidate that still does not fit: which device is short, by how much. */
static hexiseq_status memory_error(const hexiseq_cluster *c, const char *strategy, const hexiseq_plan_cost *cost) {
    const hexiseq_device_info *di = &c->dev[cost->short_device];
    return hexiseq_fail(HEXISEQ_ERR_MEMORY, "%s: no layout fits in memory; device %d (%.64s, %.1f GiB) is short by %.2f GiB",
                        strategy, cost->short_device, di->gpu_name, di->memory_gib, cost->short_gib);
}

/* Is candidate a better than b? Fitting beats not fitting; then faster; among non-fitting, less short. */
static int better(const hexiseq_plan_cost *a, const hexiseq_plan_cost *b) {
    if (a->fits != b->fits)
        return a->fits;
    if (a->fits)
        return a->step_time_s < b->step_time_s;
    return a->short_gib < b->short_gib;
}

hexiseq_status hexiseq_plan_strategy(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                     int64_t seq_len, int32_t causal, hexiseq_strategy strategy, hexiseq_layout *out,
                                     hexiseq_plan_cost *cost) {
    hexiseq_clear_error();
    if (!out || !cost)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "out and cost must not be NULL");
    memset(out, 0, sizeof *out);
    HEXISEQ_CHECK(hexiseq_check_inputs(c, m, t, seq_len));
    if (strategy < 0 || strategy >= HEXISEQ_STRATEGY_COUNT)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "strategy must be in [0, %d), got %d", HEXISEQ_STRATEGY_COUNT, strategy);
    if (causal != 0 && causal != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "causal must be 0 or 1, got %d", causal);
    int32_t n = c->n_devices;
    if (strategy == HEXISEQ_STRATEGY_HEXISEQ) {
        /* the scheduler builds its group structures over every device before it parks any: each needs a token */
        if (seq_len < n)
            return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                                "hexiseq has no valid layout: seq_len %lld is shorter than the %d devices; plan "
                                "seq_len >= %d, or a cluster of at most %lld devices",
                                (long long)seq_len, n, n, (long long)seq_len);
        HEXISEQ_CHECK(hexiseq_schedule(c, m, t, seq_len, causal, out, cost));
        if (!cost->fits)
            return memory_error(c, "hexiseq", cost);
        return HEXISEQ_OK;
    }

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
        hexiseq_layout cand;
        hexiseq_plan_cost cc;
        st = hexiseq_layout_alloc(cp, n, &cand);
        if (st != HEXISEQ_OK)
            break;
        uniform_layout(n, m->heads, seq_len, hp, &cand);
        st = hexiseq_evaluate(c, m, t, seq_len, causal, &cand, per, &cc);
        if (st == HEXISEQ_OK && (!found || better(&cc, cost))) {
            hexiseq_layout_free(out);
            *out = cand;
            *cost = cc;
            found = 1;
        } else {
            hexiseq_layout_free(&cand);
        }
    }
    free(per);
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
    if (!cost->fits)
        return memory_error(c, hexiseq_strategy_name(strategy), cost);
    return HEXISEQ_OK;
}
