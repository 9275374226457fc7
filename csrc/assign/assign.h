/* The batch assignment's own interface beyond hexiseq.h (not part of the public API): its heuristic path alone, for
 * its tests. */
#ifndef HEXISEQ_ASSIGN_H
#define HEXISEQ_ASSIGN_H

#include "hexiseq.h"

/* hexiseq_batch_assign without its exhaustive search, whatever G^N: the greedy placement and the local search
 * only, with the same checks, outputs and errors (so tests can hold the heuristic against brute force). */
hexiseq_status hexiseq_batch_assign_heuristic(const hexiseq_batch_problem *p, double time_limit_s,
                                              int32_t *group_of /* [N] out */, double *group_time_s /* [G] out */,
                                              hexiseq_batch_result *result);

#endif /* HEXISEQ_ASSIGN_H */
