/* Below the scheduler's driver and its levels (not part of the public API): the search state, the limits the
 * levels run under, scoring a candidate and keeping the best so far (evaluate.c). */
#ifndef HEXISEQ_EVALUATE_H
#define HEXISEQ_EVALUATE_H

#include "planner.h"

#define TOKEN_GRANULE 64    /* kernel tile: shares are multiples of this where sizes allow */
#define REFIT_ROUNDS 4      /* LP solve + full evaluation rounds per structure */
#define MAX_EXACT_ORDER 6   /* groups up to which every ring order is tried */
#define PARK_SEARCH_DEVICES 64       /* greedy parking up to this size (its candidates grow with n, each a
                                         structure of its own: 10-25x the planning time at 128 devices) */
#define LOCAL_SEARCH_DEVICES 256      /* local search up to this size */
#define LOCAL_SEARCH_EVALS 400        /* evaluations of polish for clusters of 17..256 devices */
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
    hexiseq_budget *budget;   /* time limit and cancellation, polled at every evaluation */
    hexiseq_device_cost *per; /* [n] scratch for evaluations */
    double *fgemm, *fattn;    /* [n] effective rates, FLOP/s; 0 for a parked device */
    double *fgemm0, *fattn0;  /* [n] the devices' real rates */
    int32_t relax;            /* memory features (hexiseq_memory_feature) the memory caps assume each device uses
                                 where its training allows them; 0: none, the caps of a device that needs none */
    /* best so far */
    hexiseq_layout best;
    hexiseq_plan_cost best_cost;
    int have_best;
} sched;

/* Score a layout (fills s->per); HEXISEQ_ERR_CANCELLED when the budget says stop. */
hexiseq_status hexiseq_sched_eval(sched *s, const hexiseq_layout *l, hexiseq_plan_cost *cost);
/* Keep `l` if it beats the best so far. */
hexiseq_status hexiseq_sched_offer(sched *s, const hexiseq_layout *l, const hexiseq_plan_cost *cost);

#endif /* HEXISEQ_EVALUATE_H */
