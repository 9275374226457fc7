/* Shared by the scheduler's levels (not part of the public API). The call graph is layered, top down:
 *   scheduler.c      driver: seeds, structures, parking, final polish; owns the best-so-far
 *   sched_park.c     parking: devices or groups that keep nothing (calls the structure level)
 *   sched_topology.c structures: node splits, consecutive groups, every partition of small clusters
 *   sched_search.c   ring orders and the local search over single moves
 *   sched_shares.c   shares of one structure: S_g by the LP, heads and tokens inside groups
 * and every level scores layouts through hexiseq_sched_eval (the cost model, polling the time limit and
 * the cancel callback) and keeps the best through hexiseq_sched_offer. */
#ifndef HEXISEQ_SCHEDULER_H
#define HEXISEQ_SCHEDULER_H

#include "internal.h"

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
    /* best so far */
    hexiseq_layout best;
    hexiseq_plan_cost best_cost;
    int have_best;
} sched;

/* Score a layout (fills s->per); HEXISEQ_ERR_CANCELLED when the budget says stop. */
hexiseq_status hexiseq_sched_eval(sched *s, const hexiseq_layout *l, hexiseq_plan_cost *cost);
/* Keep `l` if it beats the best so far. */
hexiseq_status hexiseq_sched_offer(sched *s, const hexiseq_layout *l, const hexiseq_plan_cost *cost);

/* ------------------------------------------------------------------ shares (sched_shares.c) */

/* Scratch of one structure of G groups over n devices. */
typedef struct {
    double *gseq;     /* [G] continuous S_g */
    double *cg, *cr;  /* [G] seconds per token: gemm phase, rest (all-to-all + attention + ring) */
    double *ug;       /* [G] memory cap on S_g, tokens */
    int64_t *tmp64;   /* [n] */
    double *tmpd;     /* [max(n, G)] */
    int32_t *offset;  /* [G + 1] */
    int32_t *order;   /* [max(n, G)] sort scratch */
    double *free0, *per_tok, *per_gtok; /* [n] memory model per slot: GiB free before tokens, per token */
} shares_ws;

hexiseq_status hexiseq_sched_ws_alloc(shares_ws *w, int32_t G, int32_t n);
void hexiseq_sched_ws_free(shares_ws *w);
/* Complete and optimise the shares of a structure (l->group_size, l->device set), offer every round's
 * result, and leave the best round's layout in l (its cost in *out). `unit`: head granularity; 0 keeps
 * the layout's head ranges as they are. */
hexiseq_status hexiseq_sched_optimise_shares(sched *s, hexiseq_layout *l, shares_ws *w, int32_t unit,
                                             hexiseq_plan_cost *out);

/* ------------------------------------------------------------------ ring order, local search (sched_search.c) */

/* Every ring order of up to MAX_EXACT_ORDER groups (group 0 fixed), each offered. */
hexiseq_status hexiseq_sched_try_orders(sched *s, const hexiseq_layout *base);
/* Hill climbing from `start` over single moves, within `budget` evaluations; improvements are offered. */
hexiseq_status hexiseq_sched_local_search(sched *s, const hexiseq_layout *start, const hexiseq_plan_cost *start_cost,
                                          int64_t budget);

/* ------------------------------------------------------------------ structures (sched_topology.c) */

/* Optimise one structure (shares, head units, ring orders); `score` gets its best fitting step time. */
hexiseq_status hexiseq_sched_run_structure(sched *s, hexiseq_layout *l, double *score);
/* Every partition of the active devices (s->fgemm > 0) of a cluster of up to EXACT_PARTITION_DEVICES. */
hexiseq_status hexiseq_sched_run_all_partitions(sched *s);
/* Groups of `hp` consecutive devices. */
hexiseq_status hexiseq_sched_run_consecutive(sched *s, int32_t hp);
/* Node splits per class of identical nodes, by coordinate descent. */
hexiseq_status hexiseq_sched_run_topology(sched *s);

/* ------------------------------------------------------------------ parking (sched_park.c) */

hexiseq_status hexiseq_sched_park_subsets(sched *s);
hexiseq_status hexiseq_sched_park_search(sched *s);

#endif /* HEXISEQ_SCHEDULER_H */
