/* The LP of lp.h: the step time t split a : (1 - a) between the two phases, each group filled to
 * min(U_g, t a / c_g, t (1 - a) / c_r) (lp_fill); for a given a, the smallest t whose fill holds S (lp_time, Newton
 * steps on the concave, piecewise linear fill); a searched by a coarse scan and then golden section
 * (hexiseq_lp_solve). */
#include <math.h>
#include <stdlib.h>

#include "lp.h"

/* The LP's groups: caps and per-token coefficients, each group standing for `weight` alike groups (NULL:
 * one each). */
typedef struct {
    int32_t n;
    const double *ug, *cg, *cr, *weight;
} lp_inst;

static inline double min2(double a, double b) { return b < a ? b : a; }

/* sum_g min(U_g, T_gemm / cg, T_rest / cr) for T = (t a, t (1 - a)); per group into out when not NULL. */
static double lp_fill(const lp_inst *p, double t, double a, double *out) {
    double total = 0;
    for (int32_t g = 0; g < p->n; ++g) {
        double x = p->ug[g];
        if (p->cg[g] > 0)
            x = min2(x, t * a / p->cg[g]);
        if (p->cr[g] > 0)
            x = min2(x, t * (1 - a) / p->cr[g]);
        if (out)
            out[g] = x;
        total += p->weight ? p->weight[g] * x : x;
    }
    return total;
}

/* Uncapped rate of lp_fill at t: sum over groups below their cap of min(a / cg, (1 - a) / cr), tokens per
 * second (INFINITY when a group has no time coefficient and is below its cap). */
static double lp_slope(const lp_inst *p, double t, double a) {
    double slope = 0;
    for (int32_t g = 0; g < p->n; ++g) {
        double k = INFINITY;
        if (p->cg[g] > 0)
            k = min2(k, a / p->cg[g]);
        if (p->cr[g] > 0)
            k = min2(k, (1 - a) / p->cr[g]);
        if (t * k < p->ug[g])
            slope += p->weight ? p->weight[g] * k : k;
    }
    return slope;
}

/* Smallest t (to about 1e-13) with lp_fill(t, a) >= S (INFINITY when the caps cannot hold S). lp_fill is
 * concave, piecewise linear and increasing in t, so Newton steps from t = 0 stay below the root and reach
 * it after crossing at most the breakpoints in between (usually one to three steps). */
static double lp_time(const lp_inst *p, double S, double a) {
    if (lp_fill(p, INFINITY, a, NULL) < S * (1 - 1e-12))
        return INFINITY;
    double t = 0, f = 0;
    for (int iter = 0; iter < 64; ++iter) {
        double slope = lp_slope(p, t, a);
        if (!(slope > 0) || !isfinite(slope))
            break;
        double next = t + (S - f) / slope;
        if (!(next > t))
            break;
        t = next;
        f = lp_fill(p, t, a, NULL);
        if (f >= S * (1 - 1e-13))
            break;
    }
    for (int up = 0; up < 8 && t > 0 && f < S && f >= S * (1 - 1e-13); ++up) { /* rounding: step just past */
        t *= 1.0 + 1e-13;
        f = lp_fill(p, t, a, NULL);
    }
    if (t > 0 && f >= S)
        return t;
    /* Newton stalled (should not happen): bracket [lo, hi] around the root and bisect to 1e-15 relative */
    double lo = 0, hi = t > 0 ? t : 1e-9;
    if (t > 0 && f < S) {
        lo = t;
        hi = t * (1.0 + 1e-12);
    } else if (t > 0 && lp_fill(p, t * (1.0 - 1e-12), a, NULL) < S) {
        lo = t * (1.0 - 1e-12);
    }
    while (lp_fill(p, hi, a, NULL) < S && hi < 1e30) { /* still short: widen geometrically */
        lo = hi;
        hi *= 4;
    }
    for (int iter = 0; iter < 100 && hi - lo > 1e-15 * hi; ++iter) {
        double mid = 0.5 * (lo + hi);
        if (lp_fill(p, mid, a, NULL) >= S)
            hi = mid;
        else
            lo = mid;
    }
    return hi;
}

typedef struct {
    double ug, cg, cr;
    int32_t g;
} lp_row;

static int cmp_lp_row(const void *a, const void *b) {
    const lp_row *p = a, *q = b;
    if (p->ug != q->ug)
        return p->ug < q->ug ? -1 : 1;
    if (p->cg != q->cg)
        return p->cg < q->cg ? -1 : 1;
    if (p->cr != q->cr)
        return p->cr < q->cr ? -1 : 1;
    return (p->g > q->g) - (p->g < q->g);
}

/* Groups with the same (U_g, c_g, c_r) merged into one weighted row, when that shrinks a large LP (more
 * than `merge_above` groups, at most a quarter as many rows): the same LP, its sums taken per kind of group. Returns
 * 0 (and leaves *out unset) when not worth it or out of memory. `buf` gets the storage to free. */
static int lp_compress(const lp_inst *full, int32_t merge_above, lp_inst *out, double **buf) {
    int32_t G = full->n;
    *buf = NULL;
    if (G <= merge_above)
        return 0;
    lp_row *rows = malloc((size_t)G * sizeof *rows);
    if (!rows)
        return 0;
    for (int32_t g = 0; g < G; ++g) {
        rows[g].ug = full->ug[g];
        rows[g].cg = full->cg[g];
        rows[g].cr = full->cr[g];
        rows[g].g = g;
    }
    qsort(rows, (size_t)G, sizeof *rows, cmp_lp_row);
    int32_t k = 0;
    for (int32_t i = 0; i < G; ++i)
        if (i == 0 || rows[i].ug != rows[i - 1].ug || rows[i].cg != rows[i - 1].cg || rows[i].cr != rows[i - 1].cr)
            ++k;
    double *d = k <= G / 4 ? malloc((size_t)k * 4 * sizeof *d) : NULL;
    if (!d) {
        free(rows);
        return 0;
    }
    double *ug = d, *cg = d + k, *cr = d + 2 * k, *wt = d + 3 * k;
    int32_t j = -1;
    for (int32_t i = 0; i < G; ++i) {
        if (i == 0 || rows[i].ug != rows[i - 1].ug || rows[i].cg != rows[i - 1].cg || rows[i].cr != rows[i - 1].cr) {
            ++j;
            ug[j] = rows[i].ug;
            cg[j] = rows[i].cg;
            cr[j] = rows[i].cr;
            wt[j] = 0;
        }
        wt[j] += 1.0;
    }
    free(rows);
    out->n = k;
    out->ug = ug;
    out->cg = cg;
    out->cr = cr;
    out->weight = wt;
    *buf = d;
    return 1;
}

int hexiseq_lp_solve(int32_t G, const double *cap, const double *cg, const double *cr, double S, int32_t merge_above,
                     double *x) {
    lp_inst full = {G, cap, cg, cr, NULL}, small, *p = &full;
    double *buf;
    if (lp_compress(&full, merge_above, &small, &buf))
        p = &small;
    double lo = 0.0, hi = 1.0, phi = 0.5 * (sqrt(5.0) - 1.0);
    /* coarse scan first: the objective is unimodal in practice but may be flat near the ends */
    double best_a = 0.5, best_t = INFINITY;
    for (int i = 1; i < 32; ++i) {
        double a = i / 32.0, tt = lp_time(p, S, a);
        if (tt < best_t) {
            best_t = tt;
            best_a = a;
        }
    }
    if (!isfinite(best_t)) {
        free(buf);
        return 0;
    }
    lo = fmax(0.0, best_a - 1.0 / 32);
    hi = fmin(1.0, best_a + 1.0 / 32);
    double x1 = hi - phi * (hi - lo), x2 = lo + phi * (hi - lo);
    double f1 = lp_time(p, S, x1), f2 = lp_time(p, S, x2);
    for (int iter = 0; iter < 40; ++iter) {
        if (f1 <= f2) {
            hi = x2;
            x2 = x1;
            f2 = f1;
            x1 = hi - phi * (hi - lo);
            f1 = lp_time(p, S, x1);
        } else {
            lo = x1;
            x1 = x2;
            f1 = f2;
            x2 = lo + phi * (hi - lo);
            f2 = lp_time(p, S, x2);
        }
    }
    double a = f1 <= f2 ? x1 : x2, tt = fmin(f1, f2);
    if (best_t < tt) {
        a = best_a;
        tt = best_t;
    }
    lp_fill(&full, tt, a, x);
    free(buf);
    return 1;
}
