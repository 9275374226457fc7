/* Scoring a scheduler candidate (the cost model, polling the time limit) and keeping the best so far: below
 * the driver and every level, which all call it. */
#include "evaluate.h"

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
