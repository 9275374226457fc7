/* Shared by the planners above the cost model (not part of the public API): the candidate ordering, the time
 * limit of a planning call, and the entry points the dispatcher (strategy.c) calls. */
#ifndef HEXISEQ_PLANNER_H
#define HEXISEQ_PLANNER_H

#include "clock.h"
#include "internal.h"

/* Candidate ordering, the one used by every planner: fitting beats not fitting; then faster by more than a
 * relative 1e-12 (so rounding noise never displaces an earlier candidate); among non-fitting, less short. */
static inline int hexiseq_cost_better(const hexiseq_plan_cost *a, const hexiseq_plan_cost *b) {
    if (a->fits != b->fits)
        return a->fits;
    if (a->fits)
        return a->step_time_s < b->step_time_s * (1.0 - 1e-12);
    return a->short_gib < b->short_gib;
}

/* Time limit and cancellation of one planning call, polled between evaluations. */
typedef struct {
    double start_s, deadline_s;   /* monotonic clock, seconds; deadline INFINITY: no limit */
    double next_poll_s;           /* next time the progress callback is due */
    hexiseq_progress_fn progress;
    void *progress_user;
    int32_t stopped;              /* HEXISEQ_BUDGET_RUNNING, _TIME or _CANCELLED */
    int64_t evaluations;
} hexiseq_budget;

enum { HEXISEQ_BUDGET_RUNNING = 0, HEXISEQ_BUDGET_TIME = 1, HEXISEQ_BUDGET_CANCELLED = 2 };

void hexiseq_budget_init(hexiseq_budget *b, const hexiseq_plan_options *opt);
/* Counts one evaluation and polls: HEXISEQ_OK to go on, HEXISEQ_ERR_CANCELLED to stop (b->stopped says
 * why: the time limit, or the callback). The time limit only stops a search that `have_plan` (holds a
 * layout that fits), so a stopped search still returns a valid plan. Once stopped, every later call stops
 * too. */
hexiseq_status hexiseq_budget_tick(hexiseq_budget *b, int have_plan);

/* The uniform baselines (Ring, Ulysses, USP; inputs already validated): best layout of `strategy` into
 * out/cost, HEXISEQ_ERR_UNSUPPORTED when it has none; a non-fitting best is returned with HEXISEQ_OK
 * (cost->fits = 0). On HEXISEQ_ERR_CANCELLED with b->stopped == HEXISEQ_BUDGET_TIME, out/cost hold the
 * best found. */
hexiseq_status hexiseq_plan_baseline(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                     int64_t seq_len, int32_t causal, hexiseq_strategy strategy, hexiseq_budget *b,
                                     hexiseq_layout *out, hexiseq_plan_cost *cost);

/* The asymmetric scheduler behind HEXISEQ_STRATEGY_HEXISEQ (inputs already validated). `seed`, when not
 * NULL, is a candidate scored already (the best baseline): the result is never worse than it. Returns
 * HEXISEQ_OK with the best layout, or HEXISEQ_ERR_CANCELLED (b->stopped == HEXISEQ_BUDGET_TIME: the best
 * found so far is in out/cost). */
hexiseq_status hexiseq_schedule(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                int64_t seq_len, int32_t causal, const hexiseq_layout *seed,
                                const hexiseq_plan_cost *seed_cost, hexiseq_budget *b, hexiseq_layout *out,
                                hexiseq_plan_cost *cost);

#endif /* HEXISEQ_PLANNER_H */
