/* The scheduler's levels (not part of the public API): what the driver (scheduler.c) calls, and what a level
 * calls of the levels below it. The call graph is layered, top down:
 *   scheduler.c  driver: seeds, structures, parking, final polish
 *   park.c       parking: devices or groups that keep nothing (calls the structure level)
 *   structures.c structures: node splits, consecutive groups, every partition of small clusters (calls the
 *                shares, ring order and local search levels)
 *   search.c     ring orders and the local search over single moves
 *   shares.c     shares of one structure: S_g by the LP (lp.c, on plain arrays), heads and tokens inside groups
 *   evaluate.c   below them all: scores layouts through hexiseq_sched_eval (the cost model, polling the time
 *                limit and the cancel callback) and keeps the best so far through hexiseq_sched_offer
 * No level calls back up into the driver or into a level above it. */
#ifndef HEXISEQ_LEVELS_H
#define HEXISEQ_LEVELS_H

#include "evaluate.h"

/* ------------------------------------------------------------------ shares (shares.c) */

/* Scratch of one structure of G groups over n devices. */
typedef struct {
    double *gseq;     /* [G] continuous S_g */
    double *cg, *cr;  /* [G] seconds per token: gemm phase, rest (all-to-all + attention + ring) */
    double *ug;       /* [G] memory cap on S_g, tokens */
    double *spare;    /* [n] rounding scratch of one group's token shares */
    unsigned char *flags; /* [n] members capped by memory in one group's water-fill */
    double *tmpd;     /* [max(n, G)] */
    int32_t *offset;  /* [G + 1] */
    int32_t *order;   /* [max(n, G)] sort scratch */
    double *per_gtok; /* [n] memory model per slot: GiB per token of its group */
    double *room0;    /* [n] GiB free before tokens and tiles */
    unsigned char *alike; /* [n] slot r's memory model is slot r - 1's (same GPU class, heads and kv heads) */
    double *sets;     /* [n * FEATURE_SETS * 3] per feature set a slot may use: GiB per token, per tile token, most
                         tokens its host memory takes */
    int32_t *n_sets;  /* [n] feature sets of each slot */
} shares_ws;
#define FEATURE_SETS (HEXISEQ_MEMORY_FEATURES_ALL + 1)

hexiseq_status hexiseq_sched_ws_alloc(shares_ws *w, int32_t G, int32_t n);
void hexiseq_sched_ws_free(shares_ws *w);
/* Complete and optimise the shares of a structure (l->group_size, l->device set), offer every round's
 * result, and leave the best round's layout in l (its cost in *out). `unit`: head granularity; 0 keeps
 * the layout's head ranges as they are. */
hexiseq_status hexiseq_sched_optimise_shares(sched *s, hexiseq_layout *l, shares_ws *w, int32_t unit,
                                             hexiseq_plan_cost *out);

/* ------------------------------------------------------------------ ring order, local search (search.c) */

/* Every ring order of up to MAX_EXACT_ORDER groups (group 0 fixed), each offered. */
hexiseq_status hexiseq_sched_try_orders(sched *s, const hexiseq_layout *base);
/* Hill climbing from `start` over single moves, within `budget` evaluations; improvements are offered. */
hexiseq_status hexiseq_sched_local_search(sched *s, const hexiseq_layout *start, const hexiseq_plan_cost *start_cost,
                                          int64_t budget);

/* ------------------------------------------------------------------ structures (structures.c) */

/* Optimise one structure (shares, head units, ring orders); `score` gets its best fitting step time. */
hexiseq_status hexiseq_sched_run_structure(sched *s, hexiseq_layout *l, double *score);
/* Every partition of the active devices (s->fgemm > 0) of a cluster of up to EXACT_PARTITION_DEVICES. */
hexiseq_status hexiseq_sched_run_all_partitions(sched *s);
/* Groups of `hp` consecutive devices. */
hexiseq_status hexiseq_sched_run_consecutive(sched *s, int32_t hp);
/* Node splits per class of identical nodes, by coordinate descent. */
hexiseq_status hexiseq_sched_run_topology(sched *s);

/* ------------------------------------------------------------------ parking (park.c) */

hexiseq_status hexiseq_sched_park_subsets(sched *s);
hexiseq_status hexiseq_sched_park_search(sched *s);

#endif /* HEXISEQ_LEVELS_H */
