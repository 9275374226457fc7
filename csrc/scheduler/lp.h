/* The linear program behind the groups' sequence shares (not part of the public API), on plain arrays: divide S
 * tokens among G groups, x_g in [0, U_g] with sum x_g = S, a step being a token-parallel phase and then the rest,
 * each as long as its slowest group, so as to minimise max_g c_g x_g + max_g c_r x_g (c_g, c_r: each phase's
 * seconds per token of group g). shares.c builds it from its workspace and solves it here. */
#ifndef HEXISEQ_LP_H
#define HEXISEQ_LP_H

#include <stdint.h>

/* Solves the LP of G groups with caps `cap` (U_g, INFINITY: none) and per-token coefficients `cg`, `cr` (0: the
 * phase does not bound the group): x[g] gets each group's continuous share, adding up to S to about 1e-13
 * relative. With more than `merge_above` groups, groups alike in (U_g, c_g, c_r) are solved as one weighted row
 * each when that leaves at most a quarter as many rows (the same LP, its sums taken per kind of group). Returns 0, x
 * untouched, when the caps cannot hold S. */
int hexiseq_lp_solve(int32_t G, const double *cap, const double *cg, const double *cr, double S, int32_t merge_above,
                     double *x);

#endif /* HEXISEQ_LP_H */
