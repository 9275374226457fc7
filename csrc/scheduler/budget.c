/* Time limit and cancellation of a planning call: a deadline on the clock of clock.h and a progress callback
 * polled between evaluations. */
#include <math.h>

#include "planner.h"

#define POLL_INTERVAL_S 0.05 /* the progress callback runs at most this often */

void hexiseq_budget_init(hexiseq_budget *b, const hexiseq_plan_options *opt) {
    b->start_s = hexiseq_now_s();
    b->deadline_s = opt && opt->time_limit_s > 0 ? b->start_s + opt->time_limit_s : INFINITY;
    b->progress = opt ? opt->progress : NULL;
    b->progress_user = opt ? opt->progress_user : NULL;
    b->next_poll_s = b->start_s + POLL_INTERVAL_S;
    b->stopped = HEXISEQ_BUDGET_RUNNING;
    b->evaluations = 0;
}

hexiseq_status hexiseq_budget_tick(hexiseq_budget *b, int have_plan) {
    b->evaluations++;
    if (b->stopped != HEXISEQ_BUDGET_RUNNING)
        return HEXISEQ_ERR_CANCELLED;
    if (!b->progress && b->deadline_s == INFINITY)
        return HEXISEQ_OK;
    double now = hexiseq_now_s();
    if (b->progress && now >= b->next_poll_s) {
        b->next_poll_s = now + POLL_INTERVAL_S;
        if (b->progress(b->progress_user)) {
            b->stopped = HEXISEQ_BUDGET_CANCELLED;
            return hexiseq_fail(HEXISEQ_ERR_CANCELLED, "planning cancelled after %.3f s", now - b->start_s);
        }
    }
    if (have_plan && now >= b->deadline_s) {
        b->stopped = HEXISEQ_BUDGET_TIME;
        return HEXISEQ_ERR_CANCELLED;
    }
    return HEXISEQ_OK;
}
