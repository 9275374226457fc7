/* The planning entry point: validates the request and dispatches to the uniform baselines
 * (baselines.c) or to the scheduler (scheduler.c), which starts from the best baseline. Both sit above the
 * cost model; neither calls back up here (the strategies' names, which both print, are in strategy_name.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "planner.h"

/* The error for a best candidate that still does not fit: which device is short, by how much. */
static hexiseq_status memory_error(const hexiseq_cluster *c, const char *strategy, const hexiseq_plan_cost *cost) {
    const hexiseq_device_info *di = &c->dev[cost->short_device];
    return hexiseq_fail(HEXISEQ_ERR_MEMORY, "%s: no layout fits in memory; device %d (%.64s, %.1f GiB) is short by %.2f GiB",
                        strategy, cost->short_device, di->gpu_name, di->memory_gib, cost->short_gib);
}

/* Under documents: the plan for one causal document, priced under the documents, when it beats the seed
 * (or there is none). The scheduler's search is local, so on its own it may miss that layout; seeded with
 * it, a plan made for the documents is never predicted slower than the plan made without them. */
static hexiseq_status one_document_seed(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                        int64_t seq_len, int32_t causal, hexiseq_budget *b, hexiseq_layout *seed,
                                        hexiseq_plan_cost *seed_cost, int *have_seed);

/* The scheduler, seeded with the best uniform layout (USP covers Ring and Ulysses: every factorisation
 * hp x cp, hp = 1 and hp = N included), so its plan is never predicted slower than a baseline. */
static hexiseq_status plan_hexiseq(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                   int64_t seq_len, int32_t causal, hexiseq_budget *b, hexiseq_layout *out,
                                   hexiseq_plan_cost *cost) {
    hexiseq_layout seed;
    hexiseq_plan_cost seed_cost;
    hexiseq_status st = hexiseq_plan_baseline(c, m, t, seq_len, causal, HEXISEQ_STRATEGY_USP, b, &seed, &seed_cost);
    if (t->documents && (st == HEXISEQ_OK || st == HEXISEQ_ERR_UNSUPPORTED)) {
        int have = st == HEXISEQ_OK;
        if (!have)
            hexiseq_clear_error();
        hexiseq_status s2 = one_document_seed(c, m, t, seq_len, causal, b, &seed, &seed_cost, &have);
        if (s2 == HEXISEQ_ERR_CANCELLED && b->stopped == HEXISEQ_BUDGET_TIME && have) {
            *out = seed;
            *cost = seed_cost;
            return s2;
        }
        if (s2 != HEXISEQ_OK) {
            if (have)
                hexiseq_layout_free(&seed);
            return s2;
        }
        st = have ? HEXISEQ_OK : HEXISEQ_ERR_UNSUPPORTED;
    }
    if (st == HEXISEQ_ERR_CANCELLED && b->stopped == HEXISEQ_BUDGET_TIME) {
        *out = seed; /* out of time among the baselines: the best of them */
        *cost = seed_cost;
        return st;
    }
    if (st == HEXISEQ_ERR_UNSUPPORTED) {
        hexiseq_clear_error();
        st = hexiseq_schedule(c, m, t, seq_len, causal, NULL, NULL, b, out, cost);
    } else if (st == HEXISEQ_OK) {
        st = hexiseq_schedule(c, m, t, seq_len, causal, &seed, &seed_cost, b, out, cost);
        hexiseq_layout_free(&seed);
    }
    return st;
}

static hexiseq_status one_document_seed(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                        int64_t seq_len, int32_t causal, hexiseq_budget *b, hexiseq_layout *seed,
                                        hexiseq_plan_cost *seed_cost, int *have_seed) {
    hexiseq_training plain = *t;
    plain.documents = NULL;
    hexiseq_layout one;
    memset(&one, 0, sizeof one);
    hexiseq_plan_cost one_cost;
    hexiseq_status st = plan_hexiseq(c, m, &plain, seq_len, causal, b, &one, &one_cost);
    if (st == HEXISEQ_ERR_CANCELLED && b->stopped == HEXISEQ_BUDGET_TIME) {
        if (!one.group_size) /* out of time before any layout */
            return HEXISEQ_OK;
        st = HEXISEQ_OK; /* the best one-document layout found in time is still a candidate */
    } else if (st != HEXISEQ_OK) {
        return st;
    }
    hexiseq_device_cost *per = malloc((size_t)c->n_devices * sizeof *per);
    if (!per) {
        hexiseq_layout_free(&one);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate cost scratch for %d devices", c->n_devices);
    }
    st = hexiseq_evaluate(c, m, t, seq_len, causal, &one, per, &one_cost);
    free(per);
    if (st == HEXISEQ_OK && (!*have_seed || hexiseq_cost_better(&one_cost, seed_cost))) {
        if (*have_seed)
            hexiseq_layout_free(seed);
        *seed = one;
        *seed_cost = one_cost;
        *have_seed = 1;
    } else {
        hexiseq_layout_free(&one);
    }
    return st;
}

hexiseq_status hexiseq_plan_strategy_ex(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                        int64_t seq_len, int32_t causal, hexiseq_strategy strategy,
                                        const hexiseq_plan_options *options, hexiseq_layout *out,
                                        hexiseq_plan_cost *cost, hexiseq_plan_info *info) {
    hexiseq_clear_error();
    if (!out || !cost)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "out and cost must not be NULL");
    memset(out, 0, sizeof *out);
    if (info)
        memset(info, 0, sizeof *info);
    HEXISEQ_CHECK(hexiseq_check_inputs(c, m, t, seq_len));
    if (strategy < 0 || strategy >= HEXISEQ_STRATEGY_COUNT)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "strategy must be in [0, %d), got %d", HEXISEQ_STRATEGY_COUNT, strategy);
    if (causal != 0 && causal != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "causal must be 0 or 1, got %d", causal);
    HEXISEQ_CHECK(hexiseq_check_documents(t, seq_len, causal));
    if (options && !(options->time_limit_s <= 0 || isfinite(options->time_limit_s)))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "time_limit_s must be finite (or <= 0 for none), got %g",
                            options->time_limit_s);
    int32_t n = c->n_devices;
    if (strategy == HEXISEQ_STRATEGY_HEXISEQ && seq_len < n)
        /* the scheduler builds its group structures over every device before it parks any: each needs a token */
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "hexiseq has no valid layout: seq_len %lld is shorter than the %d devices; plan "
                            "seq_len >= %d, or a cluster of at most %lld devices",
                            (long long)seq_len, n, n, (long long)seq_len);
    hexiseq_budget b;
    hexiseq_budget_init(&b, options);
    hexiseq_status st = strategy == HEXISEQ_STRATEGY_HEXISEQ
                            ? plan_hexiseq(c, m, t, seq_len, causal, &b, out, cost)
                            : hexiseq_plan_baseline(c, m, t, seq_len, causal, strategy, &b, out, cost);
    int stopped_early = 0;
    if (st == HEXISEQ_ERR_CANCELLED && b.stopped == HEXISEQ_BUDGET_TIME) {
        st = HEXISEQ_OK; /* the time limit: the best plan found by then */
        stopped_early = 1;
    }
    if (info) {
        info->stopped_early = stopped_early;
        info->evaluations = b.evaluations;
        info->elapsed_s = hexiseq_now_s() - b.start_s;
    }
    if (st != HEXISEQ_OK) {
        hexiseq_layout_free(out);
        return st;
    }
    if (!cost->fits)
        return memory_error(c, hexiseq_strategy_name(strategy), cost);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_plan_strategy(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                     int64_t seq_len, int32_t causal, hexiseq_strategy strategy, hexiseq_layout *out,
                                     hexiseq_plan_cost *cost) {
    return hexiseq_plan_strategy_ex(c, m, t, seq_len, causal, strategy, NULL, out, cost, NULL);
}
