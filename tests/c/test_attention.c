/* Tests of the CPU attention kernels (csrc/attention/attention_cpu.c) against a naive fp64 reference. */
/*
 * Error measure: max |x - ref| / max |ref| over a whole tensor (normwise relative); a reference that is
 * all zero requires an exact zero. Tolerances:
 *   f64  1e-12: accumulation in double over <= 1025 terms of O(1) values stays near 1e-14.
 *   f32  1e-5 : fp32 accumulation over <= 1025 terms, ~sqrt(n) * 6e-8 = 2e-6, with headroom.
 *   f16  2e-3 = 4 * 2^-11 and bf16 1.6e-2 = 4 * 2^-8: the reference runs on the same rounded inputs,
 *        the kernel computes in fp32 (error ~1e-6), so what is left is the final rounding of each
 *        output to the storage type, at most half an ulp (2^-11 resp. 2^-8 relative to the element,
 *        hence to the max); the factor 4 is headroom, the same spirit as flash-attention's "2x the
 *        error of a low-precision reference".
 * LSE is float for f32/f16/bf16 and checked at 1e-5 (relative to max(1, max |lse|)) in all three.
 */
#include "attention.h"
#include "half.h" /* fp16 / bf16 conversions of the test data */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"

/* ------------------------------------------------------------------------------------------------ */
/* Random numbers and tensors */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* uniform in [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1.0p-52 - 1.0;
}
static int64_t irand(int64_t n) { return (int64_t)((urand() + 1.0) * 0.5 * (double)n) % n; }

static size_t dtype_size(int dtype) {
    return dtype == HEXISEQ_DTYPE_F64 ? 8 : dtype == HEXISEQ_DTYPE_F32 ? 4 : 2;
}

static double tol_for(int dtype) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: return 1e-12;
    case HEXISEQ_DTYPE_F32: return 1e-5;
    case HEXISEQ_DTYPE_F16: return 4 * 0x1.0p-11;
    default: return 4 * 0x1.0p-8;
    }
}

static const char *dtype_name(int dtype) {
    static const char *names[] = {"f64", "f32", "f16", "bf16"};
    return names[dtype];
}

/* Layouts of a [B, S, H, D] tensor in memory. */
enum { LAYOUT_CONTIG, LAYOUT_HEADS_MAJOR, LAYOUT_EMBEDDED, LAYOUT_COL_STRIDE2, LAYOUT_COUNT };

typedef struct {
    void *buf;         /* allocation */
    char *base;        /* element [0, 0, 0, 0] */
    int64_t stride[4]; /* [b, s, h, d] in elements */
    int64_t size[4];
    int dtype;
} tensor;

static tensor tensor_make(int64_t B, int64_t S, int64_t H, int64_t D, int dtype, int layout) {
    tensor t;
    memset(&t, 0, sizeof t);
    t.size[0] = B;
    t.size[1] = S;
    t.size[2] = H;
    t.size[3] = D;
    t.dtype = dtype;
    int64_t total, lead = 0;
    switch (layout) {
    case LAYOUT_HEADS_MAJOR: /* [b][h][s][d] */
        t.stride[3] = 1, t.stride[1] = D, t.stride[2] = S * D, t.stride[0] = H * S * D;
        total = B * H * S * D;
        break;
    case LAYOUT_EMBEDDED: /* a view of a [B+1][S+2][H][D+3] buffer, starting at [0][1][0][2] */
        t.stride[3] = 1, t.stride[2] = D + 3, t.stride[1] = H * (D + 3), t.stride[0] = (S + 2) * H * (D + 3);
        total = (B + 1) * t.stride[0];
        lead = t.stride[1] + 2;
        break;
    case LAYOUT_COL_STRIDE2: /* every other element of [B][S][H][2D] */
        t.stride[3] = 2, t.stride[2] = 2 * D, t.stride[1] = H * 2 * D, t.stride[0] = S * H * 2 * D;
        total = B * S * H * 2 * D;
        break;
    default:
        t.stride[3] = 1, t.stride[2] = D, t.stride[1] = H * D, t.stride[0] = S * H * D;
        total = B * S * H * D;
        break;
    }
    size_t bytes = (size_t)total * dtype_size(dtype);
    t.buf = malloc(bytes);
    /* garbage outside the view (and in it until written) shows up as a wrong result if read */
    for (size_t i = 0; i < bytes; ++i)
        ((unsigned char *)t.buf)[i] = (unsigned char)(0x7f ^ (i * 131));
    t.base = (char *)t.buf + (size_t)lead * dtype_size(dtype);
    return t;
}

static int64_t tensor_at(const tensor *t, int64_t b, int64_t s, int64_t h, int64_t c) {
    return b * t->stride[0] + s * t->stride[1] + h * t->stride[2] + c * t->stride[3];
}

static double load_elem(const void *base, int dtype, int64_t i) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: return ((const double *)base)[i];
    case HEXISEQ_DTYPE_F32: return ((const float *)base)[i];
    case HEXISEQ_DTYPE_F16: return hexiseq_f16_to_f32(((const uint16_t *)base)[i]);
    default: return hexiseq_bf16_to_f32(((const uint16_t *)base)[i]);
    }
}

static void store_elem(void *base, int dtype, int64_t i, double x) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: ((double *)base)[i] = x; break;
    case HEXISEQ_DTYPE_F32: ((float *)base)[i] = (float)x; break;
    case HEXISEQ_DTYPE_F16: ((uint16_t *)base)[i] = hexiseq_f32_to_f16((float)x); break;
    default: ((uint16_t *)base)[i] = hexiseq_f32_to_bf16((float)x); break;
    }
}

/* Copy between a tensor and a contiguous double array [B][S][H][D]. */
static void tensor_from(tensor *t, const double *x) {
    int64_t n = 0;
    for (int64_t b = 0; b < t->size[0]; ++b)
        for (int64_t s = 0; s < t->size[1]; ++s)
            for (int64_t h = 0; h < t->size[2]; ++h)
                for (int64_t c = 0; c < t->size[3]; ++c)
                    store_elem(t->base, t->dtype, tensor_at(t, b, s, h, c), x[n++]);
}

static void tensor_to(const tensor *t, double *x) {
    int64_t n = 0;
    for (int64_t b = 0; b < t->size[0]; ++b)
        for (int64_t s = 0; s < t->size[1]; ++s)
            for (int64_t h = 0; h < t->size[2]; ++h)
                for (int64_t c = 0; c < t->size[3]; ++c)
                    x[n++] = load_elem(t->base, t->dtype, tensor_at(t, b, s, h, c));
}

static int64_t numel(const tensor *t) { return t->size[0] * t->size[1] * t->size[2] * t->size[3]; }

/* Random tensor; x receives the values after rounding to the dtype. */
static tensor tensor_random(int64_t B, int64_t S, int64_t H, int64_t D, int dtype, int layout, double *x) {
    tensor t = tensor_make(B, S, H, D, dtype, layout);
    int64_t n = B * S * H * D;
    for (int64_t i = 0; i < n; ++i)
        x[i] = urand();
    tensor_from(&t, x);
    tensor_to(&t, x);
    return t;
}

/* LSE buffer [B, H, S]: double for f64 data, float otherwise; heads-major or [b][s][h] order. */
typedef struct {
    void *buf;
    int64_t stride[3];
    int dtype; /* of the data it belongs to */
} lse_buf;

static lse_buf lse_make(int64_t B, int64_t H, int64_t S, int dtype, int transposed) {
    lse_buf l;
    l.dtype = dtype;
    if (transposed)
        l.stride[0] = S * H, l.stride[1] = 1, l.stride[2] = H;
    else
        l.stride[0] = H * S, l.stride[1] = S, l.stride[2] = 1;
    l.buf = calloc((size_t)(B * H * S), dtype == HEXISEQ_DTYPE_F64 ? 8 : 4);
    return l;
}

static double lse_get(const lse_buf *l, int64_t b, int64_t h, int64_t s) {
    int64_t i = b * l->stride[0] + h * l->stride[1] + s * l->stride[2];
    return l->dtype == HEXISEQ_DTYPE_F64 ? ((double *)l->buf)[i] : ((float *)l->buf)[i];
}

static void lse_set(lse_buf *l, int64_t b, int64_t h, int64_t s, double x) {
    int64_t i = b * l->stride[0] + h * l->stride[1] + s * l->stride[2];
    if (l->dtype == HEXISEQ_DTYPE_F64)
        ((double *)l->buf)[i] = x;
    else
        ((float *)l->buf)[i] = (float)x;
}

/* ------------------------------------------------------------------------------------------------ */
/* Naive fp64 reference, contiguous [B][S][H][D] arrays, lse [B][H][Sq] */

typedef struct {
    int64_t B, Sq, Sk;
    int A, Akv, D;
    int causal;
    int64_t qp, kp;
    double scale;
    int dtype;
    int layout;
} config;

static int64_t idx4(int64_t S, int64_t H, int64_t D, int64_t b, int64_t s, int64_t h, int64_t c) {
    return ((b * S + s) * H + h) * D + c;
}

/* doc: the document mask's q_doc as a contiguous [B][Sq] array of absolute starts, or NULL. */
static int visible(const config *c, const int64_t *doc, int64_t b, int64_t i, int64_t j) {
    if (doc != NULL && c->kp + j < doc[b * c->Sq + i])
        return 0;
    return !c->causal || c->kp + j <= c->qp + i;
}

/* scores[i][j] = scale * q_i . k_j for one (b, h), -inf where masked. */
static void ref_scores(const config *c, const int64_t *doc, const double *q, const double *k, int64_t b, int h,
                       double *sc) {
    int hk = h / (c->A / c->Akv);
    for (int64_t i = 0; i < c->Sq; ++i)
        for (int64_t j = 0; j < c->Sk; ++j) {
            double s = 0;
            for (int x = 0; x < c->D; ++x)
                s += q[idx4(c->Sq, c->A, c->D, b, i, h, x)] * k[idx4(c->Sk, c->Akv, c->D, b, j, hk, x)];
            sc[i * c->Sk + j] = visible(c, doc, b, i, j) ? c->scale * s : -INFINITY;
        }
}

static void ref_forward(const config *c, const int64_t *doc, const double *q, const double *k, const double *v,
                        double *o, double *lse) {
    double *sc = malloc(sizeof(double) * (size_t)(c->Sq * c->Sk));
    for (int64_t b = 0; b < c->B; ++b)
        for (int h = 0; h < c->A; ++h) {
            int hk = h / (c->A / c->Akv);
            ref_scores(c, doc, q, k, b, h, sc);
            for (int64_t i = 0; i < c->Sq; ++i) {
                double m = -INFINITY;
                for (int64_t j = 0; j < c->Sk; ++j)
                    m = fmax(m, sc[i * c->Sk + j]);
                double *oi = o + idx4(c->Sq, c->A, c->D, b, i, h, 0);
                for (int x = 0; x < c->D; ++x)
                    oi[x] = 0;
                if (m == -INFINITY) {
                    lse[(b * c->A + h) * c->Sq + i] = -INFINITY;
                    continue;
                }
                double l = 0;
                for (int64_t j = 0; j < c->Sk; ++j) {
                    double p = exp(sc[i * c->Sk + j] - m);
                    l += p;
                    for (int x = 0; x < c->D; ++x)
                        oi[x] += p * v[idx4(c->Sk, c->Akv, c->D, b, j, hk, x)];
                }
                for (int x = 0; x < c->D; ++x)
                    oi[x] /= l;
                lse[(b * c->A + h) * c->Sq + i] = m + log(l);
            }
        }
    free(sc);
}

/* P = exp(S - lse) with the given lse, D_i = do_i . o_i, dV = P^T dO, dP = dO V^T, dS = P * (dP - D),
 * dQ = scale * dS K, dK = scale * dS^T Q. dk, dv sum over the query heads of a kv head. */
static void ref_backward(const config *c, const int64_t *doc, const double *q, const double *k, const double *v,
                         const double *o, const double *lse, const double *dout, double *dq, double *dk, double *dv) {
    double *sc = malloc(sizeof(double) * (size_t)(c->Sq * c->Sk));
    memset(dq, 0, sizeof(double) * (size_t)(c->B * c->Sq * c->A * c->D));
    memset(dk, 0, sizeof(double) * (size_t)(c->B * c->Sk * c->Akv * c->D));
    memset(dv, 0, sizeof(double) * (size_t)(c->B * c->Sk * c->Akv * c->D));
    for (int64_t b = 0; b < c->B; ++b)
        for (int h = 0; h < c->A; ++h) {
            int hk = h / (c->A / c->Akv);
            ref_scores(c, doc, q, k, b, h, sc);
            for (int64_t i = 0; i < c->Sq; ++i) {
                double l = lse[(b * c->A + h) * c->Sq + i];
                if (l == -INFINITY)
                    continue;
                const double *doi = dout + idx4(c->Sq, c->A, c->D, b, i, h, 0);
                const double *oi = o + idx4(c->Sq, c->A, c->D, b, i, h, 0);
                const double *qi = q + idx4(c->Sq, c->A, c->D, b, i, h, 0);
                double *dqi = dq + idx4(c->Sq, c->A, c->D, b, i, h, 0);
                double Di = 0;
                for (int x = 0; x < c->D; ++x)
                    Di += doi[x] * oi[x];
                for (int64_t j = 0; j < c->Sk; ++j) {
                    if (sc[i * c->Sk + j] == -INFINITY)
                        continue;
                    double p = exp(sc[i * c->Sk + j] - l);
                    const double *kj = k + idx4(c->Sk, c->Akv, c->D, b, j, hk, 0);
                    const double *vj = v + idx4(c->Sk, c->Akv, c->D, b, j, hk, 0);
                    double dpij = 0;
                    for (int x = 0; x < c->D; ++x)
                        dpij += doi[x] * vj[x];
                    double ds = p * (dpij - Di);
                    double *dkj = dk + idx4(c->Sk, c->Akv, c->D, b, j, hk, 0);
                    double *dvj = dv + idx4(c->Sk, c->Akv, c->D, b, j, hk, 0);
                    for (int x = 0; x < c->D; ++x) {
                        dqi[x] += c->scale * ds * kj[x];
                        dkj[x] += c->scale * ds * qi[x];
                        dvj[x] += p * doi[x];
                    }
                }
            }
        }
    free(sc);
}

/* ------------------------------------------------------------------------------------------------ */
/* Comparisons */

static double rel_err(const double *x, const double *ref, int64_t n) {
    double maxdiff = 0, maxref = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (isnan(x[i]))
            return INFINITY;
        maxdiff = fmax(maxdiff, fabs(x[i] - ref[i]));
        maxref = fmax(maxref, fabs(ref[i]));
    }
    if (maxref == 0)
        return maxdiff == 0 ? 0 : INFINITY;
    return maxdiff / maxref;
}

/* LSE: -inf exactly where the reference has it, elsewhere relative to max(1, max |ref|). */
static double lse_err(const config *c, const lse_buf *l, const double *ref) {
    double maxdiff = 0, maxref = 1;
    for (int64_t b = 0; b < c->B; ++b)
        for (int h = 0; h < c->A; ++h)
            for (int64_t i = 0; i < c->Sq; ++i) {
                double r = ref[(b * c->A + h) * c->Sq + i], x = lse_get(l, b, h, i);
                if (r == -INFINITY || x == -INFINITY || isnan(x)) {
                    if (x != r)
                        return INFINITY;
                    continue;
                }
                maxdiff = fmax(maxdiff, fabs(x - r));
                maxref = fmax(maxref, fabs(r));
            }
    return maxdiff / maxref;
}

static void describe(char *out, size_t n, const config *c) {
    snprintf(out, n, "%s B=%lld Sq=%lld Sk=%lld A=%d Akv=%d D=%d causal=%d qp=%lld kp=%lld layout=%d",
             dtype_name(c->dtype), (long long)c->B, (long long)c->Sq, (long long)c->Sk, c->A, c->Akv, c->D,
             c->causal, (long long)c->qp, (long long)c->kp, c->layout);
}

static void set_strides(int64_t dst[4], const tensor *t) { memcpy(dst, t->stride, sizeof t->stride); }

/* Everything one configuration needs: inputs, kernel outputs, reference values. */
typedef struct {
    config c;
    const int64_t *doc; /* q_doc, contiguous [B][Sq], or NULL */
    tensor q, k, v, o, dout, dq, dk, dv;
    lse_buf lse;
    double *qd, *kd, *vd, *dod, *oref, *lseref, *od, *lsed, *dqref, *dkref, *dvref, *tmp_q, *tmp_k;
} problem;

static hexiseq_attn_params params_of(problem *pr) {
    const config *c = &pr->c;
    hexiseq_attn_params p;
    memset(&p, 0, sizeof p);
    p.q = pr->q.base, p.k = pr->k.base, p.v = pr->v.base, p.o = pr->o.base, p.lse = pr->lse.buf;
    p.do_ = pr->dout.base, p.dq = pr->dq.base, p.dk = pr->dk.base, p.dv = pr->dv.base;
    set_strides(p.q_stride, &pr->q);
    set_strides(p.k_stride, &pr->k);
    set_strides(p.v_stride, &pr->v);
    set_strides(p.o_stride, &pr->o);
    set_strides(p.do_stride, &pr->dout);
    set_strides(p.dq_stride, &pr->dq);
    set_strides(p.dk_stride, &pr->dk);
    set_strides(p.dv_stride, &pr->dv);
    memcpy(p.lse_stride, pr->lse.stride, sizeof p.lse_stride);
    p.batch = c->B, p.seq_q = c->Sq, p.seq_k = c->Sk, p.q_pos0 = c->qp, p.k_pos0 = c->kp;
    p.heads = c->A, p.kv_heads = c->Akv, p.head_dim = c->D, p.causal = c->causal, p.scale = c->scale;
    p.dtype = c->dtype;
    if (pr->doc != NULL) {
        p.q_doc = pr->doc;
        p.q_doc_stride[0] = c->Sq, p.q_doc_stride[1] = 1;
    }
    return p;
}

static problem problem_make(const config *c) {
    problem pr;
    memset(&pr, 0, sizeof pr);
    pr.c = *c;
    int64_t nq = c->B * c->Sq * c->A * c->D, nk = c->B * c->Sk * c->Akv * c->D, nl = c->B * c->A * c->Sq;
    pr.qd = malloc(sizeof(double) * (size_t)nq);
    pr.dod = malloc(sizeof(double) * (size_t)nq);
    pr.oref = malloc(sizeof(double) * (size_t)nq);
    pr.od = malloc(sizeof(double) * (size_t)nq);
    pr.dqref = malloc(sizeof(double) * (size_t)nq);
    pr.tmp_q = malloc(sizeof(double) * (size_t)nq);
    pr.kd = malloc(sizeof(double) * (size_t)nk);
    pr.vd = malloc(sizeof(double) * (size_t)nk);
    pr.dkref = malloc(sizeof(double) * (size_t)nk);
    pr.dvref = malloc(sizeof(double) * (size_t)nk);
    pr.tmp_k = malloc(sizeof(double) * (size_t)nk);
    pr.lseref = malloc(sizeof(double) * (size_t)nl);
    pr.lsed = malloc(sizeof(double) * (size_t)nl);
    pr.q = tensor_random(c->B, c->Sq, c->A, c->D, c->dtype, c->layout, pr.qd);
    pr.k = tensor_random(c->B, c->Sk, c->Akv, c->D, c->dtype, (c->layout + 1) % LAYOUT_COUNT, pr.kd);
    pr.v = tensor_random(c->B, c->Sk, c->Akv, c->D, c->dtype, (c->layout + 2) % LAYOUT_COUNT, pr.vd);
    pr.dout = tensor_random(c->B, c->Sq, c->A, c->D, c->dtype, (c->layout + 3) % LAYOUT_COUNT, pr.dod);
    pr.o = tensor_make(c->B, c->Sq, c->A, c->D, c->dtype, c->layout);
    pr.dq = tensor_make(c->B, c->Sq, c->A, c->D, c->dtype, (c->layout + 1) % LAYOUT_COUNT);
    pr.dk = tensor_make(c->B, c->Sk, c->Akv, c->D, c->dtype, c->layout);
    pr.dv = tensor_make(c->B, c->Sk, c->Akv, c->D, c->dtype, (c->layout + 3) % LAYOUT_COUNT);
    pr.lse = lse_make(c->B, c->A, c->Sq, c->dtype, c->layout != LAYOUT_CONTIG);
    return pr;
}

static void problem_free(problem *pr) {
    tensor *ts[] = {&pr->q, &pr->k, &pr->v, &pr->o, &pr->dout, &pr->dq, &pr->dk, &pr->dv};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; ++i)
        free(ts[i]->buf);
    free(pr->lse.buf);
    double *ds[] = {pr->qd, pr->kd, pr->vd, pr->dod, pr->oref, pr->lseref, pr->od, pr->lsed,
                    pr->dqref, pr->dkref, pr->dvref, pr->tmp_q, pr->tmp_k};
    for (size_t i = 0; i < sizeof ds / sizeof ds[0]; ++i)
        free(ds[i]);
}

static void read_lse(problem *pr, double *out) {
    const config *c = &pr->c;
    for (int64_t b = 0; b < c->B; ++b)
        for (int h = 0; h < c->A; ++h)
            for (int64_t i = 0; i < c->Sq; ++i)
                out[(b * c->A + h) * c->Sq + i] = lse_get(&pr->lse, b, h, i);
}

/* Forward + backward of one configuration against the reference; doc: its document mask (see visible) or NULL. */
static void check_config(const config *c, const int64_t *doc) {
    char name[256];
    describe(name, sizeof name, c);
    if (doc != NULL)
        strncat(name, " documents", sizeof name - strlen(name) - 1);
    problem pr = problem_make(c);
    pr.doc = doc;
    hexiseq_attn_params p = params_of(&pr);
    double tol = tol_for(c->dtype);

    ref_forward(c, doc, pr.qd, pr.kd, pr.vd, pr.oref, pr.lseref);
    hexiseq_status st = hexiseq_attn_forward_cpu(&p);
    EXPECT(st == HEXISEQ_OK, "forward %s: status %d (%s)", name, st, hexiseq_last_error());
    tensor_to(&pr.o, pr.od);
    double e_o = rel_err(pr.od, pr.oref, numel(&pr.o));
    double e_l = lse_err(c, &pr.lse, pr.lseref);
    EXPECT(e_o <= tol, "forward o %s: rel err %.3g > %.3g", name, e_o, tol);
    EXPECT(e_l <= (c->dtype == HEXISEQ_DTYPE_F64 ? 1e-12 : 1e-5), "forward lse %s: err %.3g", name, e_l);

    /* Backward from the kernel's own (rounded) o and lse; the reference uses the same values. */
    read_lse(&pr, pr.lsed);
    ref_backward(c, doc, pr.qd, pr.kd, pr.vd, pr.od, pr.lsed, pr.dod, pr.dqref, pr.dkref, pr.dvref);
    st = hexiseq_attn_backward_cpu(&p);
    EXPECT(st == HEXISEQ_OK, "backward %s: status %d (%s)", name, st, hexiseq_last_error());
    tensor_to(&pr.dq, pr.tmp_q);
    double e_dq = rel_err(pr.tmp_q, pr.dqref, numel(&pr.dq));
    tensor_to(&pr.dk, pr.tmp_k);
    double e_dk = rel_err(pr.tmp_k, pr.dkref, numel(&pr.dk));
    tensor_to(&pr.dv, pr.tmp_k);
    double e_dv = rel_err(pr.tmp_k, pr.dvref, numel(&pr.dv));
    EXPECT(e_dq <= tol && e_dk <= tol && e_dv <= tol, "backward %s: rel err dq %.3g dk %.3g dv %.3g > %.3g", name,
           e_dq, e_dk, e_dv, tol);
    problem_free(&pr);
}

/* Element offset of key row `start` in a [B, S, H, D] tensor, as a pointer. */
static void *row_ptr(const tensor *t, int64_t start) {
    return t->base + (size_t)(start * t->stride[1]) * dtype_size(t->dtype);
}

/* Splits K/V into nblocks at random boundaries: forward per block merged into an accumulator must
 * equal the unsplit result; backward per block with the global o/lse, dq accumulated across blocks
 * and dk/dv written into each block's rows, must equal the unsplit gradient. */
static void check_split(const config *c, const int64_t *doc, int nblocks) {
    char name[256];
    describe(name, sizeof name, c);
    if (doc != NULL)
        strncat(name, " documents", sizeof name - strlen(name) - 1);
    problem pr = problem_make(c);
    pr.doc = doc;
    double tol = tol_for(c->dtype);
    int64_t bounds[8];
    bounds[0] = 0;
    bounds[nblocks] = c->Sk;
    for (int i = 1; i < nblocks; ++i) { /* strictly increasing, arbitrary */
        int64_t lo = bounds[i - 1] + 1, hi = c->Sk - (nblocks - i);
        bounds[i] = lo + irand(hi - lo + 1);
    }
    ref_forward(c, doc, pr.qd, pr.kd, pr.vd, pr.oref, pr.lseref);

    /* accumulator: o (garbage values) with lse = -inf, so the first merge must overwrite it */
    for (int64_t b = 0; b < c->B; ++b)
        for (int h = 0; h < c->A; ++h)
            for (int64_t i = 0; i < c->Sq; ++i)
                lse_set(&pr.lse, b, h, i, -INFINITY);
    tensor part = tensor_make(c->B, c->Sq, c->A, c->D, c->dtype, LAYOUT_CONTIG);
    lse_buf part_lse = lse_make(c->B, c->A, c->Sq, c->dtype, 0);
    int ok = 1;
    for (int blk = 0; blk < nblocks; ++blk) {
        hexiseq_attn_params p = params_of(&pr);
        p.k = row_ptr(&pr.k, bounds[blk]);
        p.v = row_ptr(&pr.v, bounds[blk]);
        p.seq_k = bounds[blk + 1] - bounds[blk];
        p.k_pos0 = c->kp + bounds[blk];
        p.o = part.base;
        set_strides(p.o_stride, &part);
        p.lse = part_lse.buf;
        memcpy(p.lse_stride, part_lse.stride, sizeof p.lse_stride);
        ok &= hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK;
        hexiseq_attn_merge_params m;
        memset(&m, 0, sizeof m);
        m.o_acc = pr.o.base, m.lse_acc = pr.lse.buf, m.o_part = part.base, m.lse_part = part_lse.buf;
        set_strides(m.o_acc_stride, &pr.o);
        set_strides(m.o_part_stride, &part);
        memcpy(m.lse_acc_stride, pr.lse.stride, sizeof m.lse_acc_stride);
        memcpy(m.lse_part_stride, part_lse.stride, sizeof m.lse_part_stride);
        m.batch = c->B, m.seq = c->Sq, m.heads = c->A, m.head_dim = c->D;
        m.acc_dtype = c->dtype, m.part_dtype = c->dtype;
        ok &= hexiseq_attn_merge_cpu(&m) == HEXISEQ_OK;
    }
    EXPECT(ok, "split forward %s: a call failed: %s", name, hexiseq_last_error());
    /* rows the split never wrote keep the garbage the accumulator held; zero them as the kernel would */
    for (int64_t b = 0; b < c->B; ++b)
        for (int h = 0; h < c->A; ++h)
            for (int64_t i = 0; i < c->Sq; ++i)
                if (lse_get(&pr.lse, b, h, i) == -INFINITY)
                    for (int x = 0; x < c->D; ++x)
                        store_elem(pr.o.base, c->dtype, tensor_at(&pr.o, b, i, h, x), 0.0);
    tensor_to(&pr.o, pr.od);
    double e_o = rel_err(pr.od, pr.oref, numel(&pr.o));
    double e_l = lse_err(c, &pr.lse, pr.lseref);
    /* merging rounds o to the storage type once per block */
    double tol_o = c->dtype <= HEXISEQ_DTYPE_F32 ? tol : tol * nblocks;
    EXPECT(e_o <= tol_o, "split forward o %s blocks=%d: rel err %.3g", name, nblocks, e_o);
    EXPECT(e_l <= (c->dtype == HEXISEQ_DTYPE_F64 ? 1e-12 : 1e-5), "split forward lse %s blocks=%d: err %.3g", name,
           nblocks, e_l);

    /* backward pieces with the global (merged) o and lse */
    read_lse(&pr, pr.lsed);
    ref_backward(c, doc, pr.qd, pr.kd, pr.vd, pr.od, pr.lsed, pr.dod, pr.dqref, pr.dkref, pr.dvref);
    memset(pr.tmp_q, 0, sizeof(double) * (size_t)numel(&pr.dq));
    tensor_from(&pr.dq, pr.tmp_q);
    ok = 1;
    for (int blk = 0; blk < nblocks; ++blk) {
        hexiseq_attn_params p = params_of(&pr);
        p.k = row_ptr(&pr.k, bounds[blk]);
        p.v = row_ptr(&pr.v, bounds[blk]);
        p.dk = row_ptr(&pr.dk, bounds[blk]);
        p.dv = row_ptr(&pr.dv, bounds[blk]);
        p.seq_k = bounds[blk + 1] - bounds[blk];
        p.k_pos0 = c->kp + bounds[blk];
        p.accumulate = 1;
        /* dq adds up over blocks; dk/dv rows of this block start from zero */
        tensor blk_dk = pr.dk, blk_dv = pr.dv;
        blk_dk.base = p.dk, blk_dk.size[1] = p.seq_k;
        blk_dv.base = p.dv, blk_dv.size[1] = p.seq_k;
        memset(pr.tmp_k, 0, sizeof(double) * (size_t)numel(&blk_dk));
        tensor_from(&blk_dk, pr.tmp_k);
        tensor_from(&blk_dv, pr.tmp_k);
        ok &= hexiseq_attn_backward_cpu(&p) == HEXISEQ_OK;
    }
    EXPECT(ok, "split backward %s: a call failed: %s", name, hexiseq_last_error());
    tensor_to(&pr.dq, pr.tmp_q);
    double e_dq = rel_err(pr.tmp_q, pr.dqref, numel(&pr.dq));
    tensor_to(&pr.dk, pr.tmp_k);
    double e_dk = rel_err(pr.tmp_k, pr.dkref, numel(&pr.dk));
    tensor_to(&pr.dv, pr.tmp_k);
    double e_dv = rel_err(pr.tmp_k, pr.dvref, numel(&pr.dv));
    double tol_g = c->dtype <= HEXISEQ_DTYPE_F32 ? tol : tol * nblocks;
    EXPECT(e_dq <= tol_g && e_dk <= tol_g && e_dv <= tol_g,
           "split backward %s blocks=%d: rel err dq %.3g dk %.3g dv %.3g", name, nblocks, e_dq, e_dk, e_dv);
    free(part.buf);
    free(part_lse.buf);
    problem_free(&pr);
}

/* ------------------------------------------------------------------------------------------------ */
/* Targeted tests */

static void test_conversions(void) {
    int bad_f16 = 0, bad_bf16 = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
        /* f16 decode against ldexp, and re-encode round trip (NaN stays NaN) */
        uint32_t e = (h >> 10) & 31, mnt = h & 1023;
        double expect = e == 0 ? ldexp(mnt, -24) : e == 31 ? (mnt ? NAN : INFINITY) : ldexp(1024 + mnt, (int)e - 25);
        if (h & 0x8000)
            expect = -expect;
        float f = hexiseq_f16_to_f32((uint16_t)h);
        if (isnan(expect) ? !isnan(f) : (double)f != expect || !signbit(f) != !signbit(expect))
            ++bad_f16;
        uint16_t back = hexiseq_f32_to_f16(f);
        if (isnan(f) ? ((back & 0x7c00) != 0x7c00 || (back & 0x3ff) == 0) : back != h)
            ++bad_f16;
        float g = hexiseq_bf16_to_f32((uint16_t)h);
        uint16_t gb = hexiseq_f32_to_bf16(g);
        if (isnan(g) ? !isnan(hexiseq_bf16_to_f32(gb)) : gb != h)
            ++bad_bf16;
    }
    EXPECT(bad_f16 == 0, "f16 exhaustive decode/round trip: %d mismatches", bad_f16);
    EXPECT(bad_bf16 == 0, "bf16 exhaustive round trip: %d mismatches", bad_bf16);
    /* rounding to nearest, ties to even */
    EXPECT(hexiseq_f32_to_f16(1.0f + 0x1.0p-11f) == 0x3c00, "f16 tie 1+2^-11 -> 1");
    EXPECT(hexiseq_f32_to_f16(1.0f + 3 * 0x1.0p-11f) == 0x3c02, "f16 tie 1+3*2^-11 -> 1+2^-9");
    EXPECT(hexiseq_f32_to_f16(1.0f + 0x1.0p-11f + 0x1.0p-20f) == 0x3c01, "f16 above tie rounds up");
    EXPECT(hexiseq_f32_to_f16(65504.0f) == 0x7bff && hexiseq_f32_to_f16(65519.0f) == 0x7bff &&
               hexiseq_f32_to_f16(65520.0f) == 0x7c00 && hexiseq_f32_to_f16(-1e30f) == 0xfc00,
           "f16 overflow boundary");
    EXPECT(hexiseq_f32_to_f16(0x1.0p-25f) == 0 && hexiseq_f32_to_f16(0x1.8p-25f) == 1 &&
               hexiseq_f32_to_f16(0x1.8p-24f) == 2 && hexiseq_f32_to_f16(0x1.0p-26f) == 0 &&
               hexiseq_f32_to_f16(0x1.ffcp-15f) == 0x0400 && hexiseq_f32_to_f16(-0.0f) == 0x8000,
           "f16 subnormal rounding");
    EXPECT(hexiseq_f32_to_bf16(1.0f + 0x1.0p-8f) == 0x3f80 && hexiseq_f32_to_bf16(1.0f + 3 * 0x1.0p-8f) == 0x3f82 &&
               hexiseq_f32_to_bf16(1.0f + 0x1.0p-8f + 0x1.0p-20f) == 0x3f81 &&
               hexiseq_f32_to_bf16(3.4e38f) == 0x7f80,
           "bf16 ties to even and overflow");
}

static void test_configs(void) {
    const double s64 = 0.125; /* 1 / sqrt(64) */
    config cs[] = {
        /* B  Sq   Sk   A  Akv D   causal qp   kp   scale  dtype layout */
        {1, 1, 1, 1, 1, 1, 0, 0, 0, 1.0, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},
        {1, 1, 1, 1, 1, 1, 1, 0, 0, 1.0, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {2, 97, 97, 4, 1, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},     /* MQA 4:1, batch 2 */
        {1, 97, 130, 8, 2, 7, 1, 50, 0, 0.4, HEXISEQ_DTYPE_F64, LAYOUT_HEADS_MAJOR}, /* GQA 8:2, overlap */
        {1, 33, 40, 2, 2, 5, 1, 0, 200, 0.5, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},     /* q before k: all masked */
        {1, 50, 70, 2, 1, 9, 1, 10, 30, 0.3, HEXISEQ_DTYPE_F64, LAYOUT_EMBEDDED},   /* first 20 rows masked */
        {1, 70, 90, 2, 2, 12, 1, 500, 0, 0.3, HEXISEQ_DTYPE_F64, LAYOUT_COL_STRIDE2}, /* q after k */
        {1, 1025, 1025, 2, 1, 8, 1, 0, 0, 0.35, HEXISEQ_DTYPE_F64, LAYOUT_EMBEDDED},
        {1, 1025, 300, 1, 1, 4, 0, 0, 0, 0.5, HEXISEQ_DTYPE_F64, LAYOUT_COL_STRIDE2}, /* non-causal */
        {1, 70, 80, 2, 2, 256, 1, 20, 0, 0.0625, HEXISEQ_DTYPE_F64, LAYOUT_HEADS_MAJOR},
        {1, 97, 97, 2, 1, 64, 0, 0, 0, s64, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},
        {2, 97, 97, 4, 1, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {1, 97, 130, 8, 2, 7, 1, 50, 0, 0.4, HEXISEQ_DTYPE_F32, LAYOUT_HEADS_MAJOR},
        {1, 33, 40, 2, 2, 5, 1, 0, 200, 0.5, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {1, 50, 70, 2, 1, 9, 1, 10, 30, 0.3, HEXISEQ_DTYPE_F32, LAYOUT_EMBEDDED},
        {1, 1025, 1025, 2, 1, 8, 1, 0, 0, 0.35, HEXISEQ_DTYPE_F32, LAYOUT_EMBEDDED},
        {1, 300, 1025, 2, 2, 16, 0, 0, 0, 0.25, HEXISEQ_DTYPE_F32, LAYOUT_COL_STRIDE2},
        {1, 70, 80, 2, 2, 256, 1, 20, 0, 0.0625, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {1, 130, 130, 2, 1, 128, 1, 0, 0, 0.088, HEXISEQ_DTYPE_F32, LAYOUT_HEADS_MAJOR},
        {1, 97, 97, 2, 1, 64, 0, 0, 0, s64, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {2, 97, 97, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_BF16, LAYOUT_CONTIG},
        {1, 97, 130, 4, 1, 64, 1, 50, 0, s64, HEXISEQ_DTYPE_BF16, LAYOUT_EMBEDDED},
        {2, 97, 97, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F16, LAYOUT_HEADS_MAJOR},
        {1, 97, 130, 4, 1, 64, 0, 0, 0, s64, HEXISEQ_DTYPE_F16, LAYOUT_COL_STRIDE2},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; ++i)
        check_config(&cs[i], NULL);
}

static void test_splits(void) {
    config cs[] = {
        {1, 97, 97, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},
        {2, 70, 150, 4, 1, 8, 1, 60, 0, 0.3, HEXISEQ_DTYPE_F64, LAYOUT_HEADS_MAJOR}, /* overlapping, MQA */
        {1, 60, 200, 2, 2, 5, 0, 0, 0, 0.5, HEXISEQ_DTYPE_F64, LAYOUT_EMBEDDED},     /* non-causal */
        {1, 50, 90, 2, 1, 3, 1, 10, 0, 0.7, HEXISEQ_DTYPE_F64, LAYOUT_COL_STRIDE2},  /* blocks past the queries */
        {1, 97, 97, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {2, 70, 150, 4, 1, 8, 1, 60, 0, 0.3, HEXISEQ_DTYPE_F32, LAYOUT_HEADS_MAJOR},
        {1, 97, 97, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_BF16, LAYOUT_CONTIG},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; ++i)
        for (int nb = 2; nb <= 5; ++nb)
            check_split(&cs[i], NULL, nb);
}

static void test_merge_inf(void) {
    /* 1 batch, 5 rows, 1 head, d = 2; f64 both sides */
    double lse_a[5] = {-INFINITY, 0.5, -INFINITY, 1.0, 3.0};
    double lse_p[5] = {-INFINITY, -INFINITY, 0.3, 2.0, -1000.0};
    double oa[10] = {7, -7, 1, 2, NAN, NAN, 0.5, 0.25, 1, 1};
    double op[10] = {9, 9, 5, 6, 3, 4, 2, 4, 5, 5};
    hexiseq_attn_merge_params m;
    memset(&m, 0, sizeof m);
    m.o_acc = oa, m.lse_acc = lse_a, m.o_part = op, m.lse_part = lse_p;
    int64_t os[4] = {10, 2, 2, 1}, ls[3] = {5, 5, 1};
    memcpy(m.o_acc_stride, os, sizeof os);
    memcpy(m.o_part_stride, os, sizeof os);
    memcpy(m.lse_acc_stride, ls, sizeof ls);
    memcpy(m.lse_part_stride, ls, sizeof ls);
    m.batch = 1, m.seq = 5, m.heads = 1, m.head_dim = 2;
    m.acc_dtype = m.part_dtype = HEXISEQ_DTYPE_F64;
    EXPECT(hexiseq_attn_merge_cpu(&m) == HEXISEQ_OK, "merge: %s", hexiseq_last_error());
    EXPECT(lse_a[0] == -INFINITY && oa[0] == 7 && oa[1] == -7, "merge both -inf leaves the accumulator as is");
    EXPECT(lse_a[1] == 0.5 && oa[2] == 1 && oa[3] == 2, "merge part -inf is a no-op");
    EXPECT(lse_a[2] == 0.3 && oa[4] == 3 && oa[5] == 4, "merge acc -inf takes the part (even over NaN)");
    double lnew = 2.0 + log1p(exp(-1.0)), wa = exp(1.0 - lnew), wp = exp(2.0 - lnew);
    EXPECT(fabs(lse_a[3] - lnew) < 1e-15 && fabs(oa[6] - (wa * 0.5 + wp * 2)) < 1e-15 &&
               fabs(oa[7] - (wa * 0.25 + wp * 4)) < 1e-15,
           "merge finite rows: lse %.17g vs %.17g", lse_a[3], lnew);
    EXPECT(lse_a[4] == 3.0 && oa[8] == 1 && oa[9] == 1, "merge negligible part: accumulator unchanged");

    /* float accumulator, bf16 partials, the design's answer to bf16 error across ring steps */
    float lacc[2] = {-INFINITY, 0.0f}, lpart[2] = {1.5f, 0.0f};
    float oacc[2] = {0, 1.0f};
    uint16_t opart[2] = {hexiseq_f32_to_bf16(0.3f), hexiseq_f32_to_bf16(3.0f)};
    m.o_acc = oacc, m.lse_acc = lacc, m.o_part = opart, m.lse_part = lpart;
    int64_t os2[4] = {2, 1, 1, 1}, ls2[3] = {2, 2, 1};
    memcpy(m.o_acc_stride, os2, sizeof os2);
    memcpy(m.o_part_stride, os2, sizeof os2);
    memcpy(m.lse_acc_stride, ls2, sizeof ls2);
    memcpy(m.lse_part_stride, ls2, sizeof ls2);
    m.seq = 2, m.head_dim = 1, m.acc_dtype = HEXISEQ_DTYPE_F32, m.part_dtype = HEXISEQ_DTYPE_BF16;
    EXPECT(hexiseq_attn_merge_cpu(&m) == HEXISEQ_OK, "mixed merge: %s", hexiseq_last_error());
    EXPECT(lacc[0] == 1.5f && oacc[0] == hexiseq_bf16_to_f32(opart[0]), "mixed merge into -inf accumulator");
    EXPECT(fabsf(lacc[1] - (float)log(2.0)) < 1e-7f && fabsf(oacc[1] - 2.0f) < 1e-7f,
           "mixed merge equal weights: o %.9g lse %.9g", oacc[1], lacc[1]);
}

/* Same result bit for bit with 1 and 2 threads. */
static void test_determinism(void) {
#ifdef _OPENMP
    config c = {1, 300, 300, 4, 2, 32, 1, 0, 0, 0.2, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG};
    problem pr = problem_make(&c);
    hexiseq_attn_params p = params_of(&pr);
    size_t nq = (size_t)numel(&pr.o), nk = (size_t)numel(&pr.dk);
    float *o1 = malloc(nq * 4), *dq1 = malloc(nq * 4), *dk1 = malloc(nk * 4);
    int prev = omp_get_max_threads();
    omp_set_num_threads(1);
    int ok = hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK && hexiseq_attn_backward_cpu(&p) == HEXISEQ_OK;
    memcpy(o1, pr.o.base, nq * 4);
    memcpy(dq1, pr.dq.base, nq * 4);
    memcpy(dk1, pr.dk.base, nk * 4);
    omp_set_num_threads(2);
    ok = ok && hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK && hexiseq_attn_backward_cpu(&p) == HEXISEQ_OK;
    omp_set_num_threads(prev);
    EXPECT(ok && memcmp(o1, pr.o.base, nq * 4) == 0 && memcmp(dq1, pr.dq.base, nq * 4) == 0 &&
               memcmp(dk1, pr.dk.base, nk * 4) == 0,
           "results depend on the thread count");
    free(o1);
    free(dq1);
    free(dk1);
    problem_free(&pr);
#endif
}

/* Each bad input gives its code and a message naming the field. */
static void expect_fail(hexiseq_status got, hexiseq_status want, const char *field, const char *what) {
    const char *msg = hexiseq_last_error();
    EXPECT(got == want && msg[0] != '\0' && strstr(msg, field) != NULL,
           "%s: got status %d want %d, message '%s' (should name '%s')", what, got, want, msg, field);
}

static void test_bad_inputs(void) {
    config c = {1, 8, 8, 2, 1, 4, 1, 0, 0, 0.5, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG};
    problem pr = problem_make(&c);
    hexiseq_attn_params base = params_of(&pr), p;

    expect_fail(hexiseq_attn_forward_cpu(NULL), HEXISEQ_ERR_NULL, "params", "NULL params");
    expect_fail(hexiseq_attn_backward_cpu(NULL), HEXISEQ_ERR_NULL, "params", "NULL params (backward)");
#define BAD(stmt, want, field)                                   \
    do {                                                         \
        p = base;                                                \
        stmt;                                                    \
        expect_fail(hexiseq_attn_forward_cpu(&p), want, field, #stmt); \
    } while (0)
#define BAD_BWD(stmt, want, field)                               \
    do {                                                         \
        p = base;                                                \
        stmt;                                                    \
        expect_fail(hexiseq_attn_backward_cpu(&p), want, field, #stmt); \
    } while (0)
    BAD(p.q = NULL, HEXISEQ_ERR_NULL, "q");
    BAD(p.v = NULL, HEXISEQ_ERR_NULL, "v");
    BAD(p.lse = NULL, HEXISEQ_ERR_NULL, "lse");
    BAD_BWD(p.do_ = NULL, HEXISEQ_ERR_NULL, "do_");
    BAD_BWD(p.dk = NULL, HEXISEQ_ERR_NULL, "dk");
    BAD(p.batch = 0, HEXISEQ_ERR_INVALID, "batch");
    BAD(p.seq_q = -1, HEXISEQ_ERR_INVALID, "seq_q");
    BAD(p.seq_k = 0, HEXISEQ_ERR_INVALID, "seq_k");
    BAD(p.heads = -2, HEXISEQ_ERR_INVALID, "heads");
    BAD(p.kv_heads = 0, HEXISEQ_ERR_INVALID, "kv_heads");
    BAD((p.heads = 6, p.kv_heads = 4), HEXISEQ_ERR_INVALID, "kv_heads");
    BAD(p.head_dim = 0, HEXISEQ_ERR_INVALID, "head_dim");
    BAD(p.head_dim = 257, HEXISEQ_ERR_UNSUPPORTED, "head_dim");
    BAD(p.dtype = 9, HEXISEQ_ERR_INVALID, "dtype");
    BAD(p.dtype = -1, HEXISEQ_ERR_INVALID, "dtype");
    BAD(p.causal = 2, HEXISEQ_ERR_INVALID, "causal");
    BAD(p.scale = NAN, HEXISEQ_ERR_INVALID, "scale");
    BAD(p.scale = INFINITY, HEXISEQ_ERR_INVALID, "scale");
    BAD(p.scale = 0.0, HEXISEQ_ERR_INVALID, "scale");
    BAD(p.scale = -0.5, HEXISEQ_ERR_INVALID, "scale");
    BAD(p.q_pos0 = -1, HEXISEQ_ERR_INVALID, "q_pos0");
    BAD(p.k_pos0 = INT64_MAX - 3, HEXISEQ_ERR_INVALID, "k_pos0");
    BAD(p.q_stride[1] = (int64_t)1 << 62, HEXISEQ_ERR_INVALID, "q_stride[1]");
    BAD(p.k_stride[0] = INT64_MIN, HEXISEQ_ERR_INVALID, "k_stride[0]");
    BAD((p.seq_q = (int64_t)1 << 40, p.q_stride[1] = (int64_t)1 << 30), HEXISEQ_ERR_INVALID, "q_stride[1]");
    BAD((p.batch = INT64_MAX / 2, p.q_stride[0] = 0, p.k_stride[0] = 0, p.v_stride[0] = 0, p.o_stride[0] = 0,
         p.lse_stride[0] = 0),
        HEXISEQ_ERR_INVALID, "batch");
    BAD(p.lse_stride[2] = -((int64_t)1 << 61), HEXISEQ_ERR_INVALID, "lse_stride[2]");
    BAD_BWD(p.accumulate = 5, HEXISEQ_ERR_INVALID, "accumulate");
    BAD_BWD(p.dv_stride[3] = (int64_t)1 << 60, HEXISEQ_ERR_INVALID, "dv_stride[3]");
#undef BAD
#undef BAD_BWD
    /* a failed call is followed by a clean one: the error text is cleared */
    p = base;
    EXPECT(hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK && hexiseq_last_error()[0] == '\0',
           "a good call after a failure: %s", hexiseq_last_error());

    hexiseq_attn_merge_params m;
    memset(&m, 0, sizeof m);
    expect_fail(hexiseq_attn_merge_cpu(NULL), HEXISEQ_ERR_NULL, "merge params", "NULL merge params");
    expect_fail(hexiseq_attn_merge_cpu(&m), HEXISEQ_ERR_NULL, "o_acc", "merge NULL o_acc");
    double dummy[4] = {0};
    m.o_acc = m.lse_acc = dummy;
    m.o_part = m.lse_part = dummy;
    m.batch = m.seq = 1, m.heads = 1, m.head_dim = 1;
    m.acc_dtype = 4;
    expect_fail(hexiseq_attn_merge_cpu(&m), HEXISEQ_ERR_INVALID, "acc_dtype", "merge bad dtype");
    m.acc_dtype = HEXISEQ_DTYPE_F64, m.head_dim = 300;
    expect_fail(hexiseq_attn_merge_cpu(&m), HEXISEQ_ERR_UNSUPPORTED, "head_dim", "merge head_dim 300");
    m.head_dim = 1, m.seq = 0;
    expect_fail(hexiseq_attn_merge_cpu(&m), HEXISEQ_ERR_INVALID, "seq", "merge seq 0");
    problem_free(&pr);
}

/* ------------------------------------------------------------------------------------------------ */
/* Document mask (q_doc) */

/* Documents of a packed sequence, per batch: lengths 1..maxlen at random, or all exactly `fixed` long when
 * fixed > 0 (boundaries on tile edges for multiples of 64). Returns q_doc for the query block [qp, qp + Sq):
 * [B][Sq] absolute starts (malloc'd). maxlen 0 and fixed 0: one document (every start 0). */
static int64_t *make_docs(int64_t B, int64_t qp, int64_t Sq, int64_t maxlen, int64_t fixed) {
    int64_t *doc = malloc(sizeof(int64_t) * (size_t)(B * Sq));
    for (int64_t b = 0; b < B; ++b) {
        int64_t start = 0, next = fixed > 0 ? fixed : maxlen > 0 ? 1 + irand(maxlen) : INT64_MAX;
        for (int64_t a = 0; a < qp + Sq; ++a) {
            if (a == next) {
                start = a;
                next = a + (fixed > 0 ? fixed : 1 + irand(maxlen));
            }
            if (a >= qp)
                doc[b * Sq + a - qp] = start;
        }
    }
    return doc;
}

static void test_documents(void) {
    const double s64 = 0.125;
    typedef struct {
        config c;
        int64_t maxlen, fixed;
    } doc_case;
    const doc_case cs[] = {
        /* B  Sq   Sk   A  Akv D   causal qp   kp   scale  dtype layout;  maxlen fixed */
        {{1, 300, 300, 2, 1, 8, 1, 0, 0, 0.35, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG}, 3, 0},        /* tiny documents */
        {{2, 300, 300, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F64, LAYOUT_HEADS_MAJOR}, 90, 0}, /* GQA, batch 2 */
        {{1, 257, 257, 2, 2, 5, 1, 0, 0, 0.5, HEXISEQ_DTYPE_F64, LAYOUT_EMBEDDED}, 0, 64},      /* BK tile edges */
        {{1, 257, 257, 2, 2, 5, 1, 0, 0, 0.5, HEXISEQ_DTYPE_F64, LAYOUT_COL_STRIDE2}, 0, 128},  /* BQ tile edges */
        {{1, 150, 200, 4, 1, 7, 1, 400, 200, 0.4, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG}, 120, 0},   /* ring step */
        {{1, 100, 100, 2, 1, 9, 1, 300, 0, 0.3, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG}, 150, 0},     /* zigzag back chunk */
        {{1, 300, 300, 2, 1, 8, 1, 0, 0, 0.35, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG}, 3, 0},
        {{2, 300, 300, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F32, LAYOUT_HEADS_MAJOR}, 90, 0},
        {{1, 257, 257, 2, 2, 64, 1, 0, 0, s64, HEXISEQ_DTYPE_F32, LAYOUT_EMBEDDED}, 0, 64},
        {{1, 150, 200, 4, 1, 7, 1, 400, 200, 0.4, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG}, 120, 0},
        {{1, 100, 100, 2, 1, 9, 1, 300, 0, 0.3, HEXISEQ_DTYPE_F32, LAYOUT_COL_STRIDE2}, 150, 0},
        /* long key block under one long document: the forward's pieces and the backward's dq folds */
        {{1, 40, 8300, 2, 1, 4, 1, 8300, 0, 0.5, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG}, 6000, 0},
        {{2, 97, 130, 4, 2, 16, 1, 50, 0, 0.25, HEXISEQ_DTYPE_BF16, LAYOUT_CONTIG}, 40, 0},
        {{1, 97, 130, 4, 1, 64, 1, 50, 0, s64, HEXISEQ_DTYPE_F16, LAYOUT_HEADS_MAJOR}, 40, 0},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; ++i) {
        const config *c = &cs[i].c;
        int64_t *doc = make_docs(c->B, c->qp, c->Sq, cs[i].maxlen, cs[i].fixed);
        check_config(c, doc);
        free(doc);
    }
    /* starts in no order (the kernels take any start <= the query's position, not only a packed sequence's):
     * a query tile's rows that reach a key tile need not be a prefix of it */
    const config any[] = {
        {1, 300, 300, 2, 1, 8, 1, 0, 0, 0.35, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},
        {2, 150, 200, 4, 2, 16, 1, 400, 200, 0.25, HEXISEQ_DTYPE_F32, LAYOUT_HEADS_MAJOR},
    };
    for (size_t i = 0; i < sizeof any / sizeof any[0]; ++i) {
        const config *c = &any[i];
        int64_t *doc = malloc(sizeof(int64_t) * (size_t)(c->B * c->Sq));
        for (int64_t r = 0; r < c->B * c->Sq; ++r) {
            const int64_t pos = c->qp + r % c->Sq;
            /* a third of the rows late (a short reach back), the rest anywhere */
            doc[r] = r % 3 ? irand(pos + 1) : pos - irand(8 < pos + 1 ? 8 : pos + 1);
        }
        check_config(c, doc);
        free(doc);
    }
    /* split over key blocks + merge == unsplit */
    const config sp[] = {
        {1, 200, 200, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},
        {2, 70, 150, 4, 1, 8, 1, 60, 0, 0.3, HEXISEQ_DTYPE_F64, LAYOUT_HEADS_MAJOR},
        {1, 200, 200, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F32, LAYOUT_EMBEDDED},
    };
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; ++i)
        for (int nb = 2; nb <= 4; ++nb) {
            int64_t *doc = make_docs(sp[i].B, sp[i].qp, sp[i].Sq, 40, 0);
            check_split(&sp[i], doc, nb);
            free(doc);
        }
}

/* Runs forward then backward; out receives o, dq ([B][Sq][A][D]), dk, dv ([B][Sk][Akv][D]) and lse ([B][A][Sq])
 * as doubles (exact for every dtype, so equal doubles are equal bits). Returns 1 when both calls succeed. */
static int run_both(problem *pr, double *out) {
    hexiseq_attn_params p = params_of(pr);
    int ok = hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK && hexiseq_attn_backward_cpu(&p) == HEXISEQ_OK;
    const tensor *ts[] = {&pr->o, &pr->dq, &pr->dk, &pr->dv};
    for (size_t i = 0; i < 4; ++i) {
        tensor_to(ts[i], out);
        out += numel(ts[i]);
    }
    read_lse(pr, out);
    return ok;
}

/* Doubles run_both writes for a configuration. */
static size_t both_size(const config *c) {
    return (size_t)(2 * c->B * c->Sq * c->A * c->D + 2 * c->B * c->Sk * c->Akv * c->D + c->B * c->A * c->Sq);
}

/* One document over everything (q_doc at or before the key block's start) is the plain causal mask: the same
 * results bit for bit, forward and backward. */
static void test_documents_one(void) {
    const config cs[] = {
        {1, 300, 300, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {2, 150, 200, 2, 1, 8, 1, 400, 200, 0.4, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG},
        {1, 300, 300, 4, 2, 16, 1, 0, 0, 0.25, HEXISEQ_DTYPE_F64, LAYOUT_CONTIG},
        {1, 130, 130, 2, 2, 8, 1, 0, 0, 0.3, HEXISEQ_DTYPE_BF16, LAYOUT_CONTIG},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; ++i) {
        const config *c = &cs[i];
        problem pr = problem_make(c);
        const size_t n = both_size(c);
        double *plain = malloc(n * sizeof(double)), *docs = malloc(n * sizeof(double));
        int ok = run_both(&pr, plain);
        int64_t *doc = malloc(sizeof(int64_t) * (size_t)(c->B * c->Sq));
        for (int64_t r = 0; r < c->B * c->Sq; ++r)
            doc[r] = r % 2 ? 0 : c->kp; /* both mean "from before the block" */
        pr.doc = doc;
        ok &= run_both(&pr, docs);
        char name[256];
        describe(name, sizeof name, c);
        EXPECT(ok && memcmp(plain, docs, n * sizeof(double)) == 0, "one document != causal bit for bit: %s (%s)", name,
               hexiseq_last_error());
        free(doc);
        free(plain);
        free(docs);
        problem_free(&pr);
    }
}

/* A (query tile, key tile) pair no query reaches is skipped, not computed with a mask: infinite keys and NaN values
 * in the first document (rows 0..127, one BQ query tile) reach neither the later query tiles' o, lse, dq nor the
 * later keys' dk, dv; a masked computation would carry them there (P V = 0 * NaN in the forward, dS K = 0 * inf in
 * the backward). */
static void test_documents_skip(void) {
#ifdef _OPENMP
    /* one thread makes the forward give a task two query tiles (tasks per thread), so the per-tile skip inside a
     * task is exercised, not only the task's first key tile */
    const int prev = omp_get_max_threads();
#endif
    for (int dt = 0; dt < 4; ++dt) {
#ifdef _OPENMP
        omp_set_num_threads(dt < 2 ? 1 : prev);
#endif
        const config c = {1, 384, 384, 2, 1, 8, 1, 0, 0, 0.3, dt % 2 ? HEXISEQ_DTYPE_F32 : HEXISEQ_DTYPE_F64,
                          LAYOUT_CONTIG};
        problem pr = problem_make(&c);
        int64_t *doc = make_docs(1, 0, c.Sq, 0, 128);
        pr.doc = doc;
        const size_t n = both_size(&c);
        double *clean = malloc(n * sizeof(double)), *poisoned = malloc(n * sizeof(double));
        int ok = run_both(&pr, clean);
        for (int64_t j = 0; j < 128; ++j)
            for (int x = 0; x < c.D; ++x) {
                store_elem(pr.k.base, c.dtype, tensor_at(&pr.k, 0, j, 0, x), INFINITY);
                store_elem(pr.v.base, c.dtype, tensor_at(&pr.v, 0, j, 0, x), NAN);
            }
        ok &= run_both(&pr, poisoned);
        /* rows >= 128 of o, dq, dk, dv (batch 1: each is [S][heads * D]) and of each head's lse */
        const int64_t qrow = c.A * c.D, krow = c.Akv * c.D;
        const int64_t off[4] = {0, c.Sq * qrow, 2 * c.Sq * qrow, 2 * c.Sq * qrow + c.Sk * krow};
        const int64_t row[4] = {qrow, qrow, krow, krow}, len[4] = {c.Sq, c.Sq, c.Sk, c.Sk};
        int same = 1;
        for (int t = 0; t < 4; ++t)
            same &= memcmp(clean + off[t] + 128 * row[t], poisoned + off[t] + 128 * row[t],
                           sizeof(double) * (size_t)((len[t] - 128) * row[t])) == 0;
        for (int h = 0; h < c.A; ++h) {
            const int64_t at = 2 * c.Sq * qrow + 2 * c.Sk * krow + h * c.Sq + 128;
            same &= memcmp(clean + at, poisoned + at, sizeof(double) * (size_t)(c.Sq - 128)) == 0;
        }
        /* and the poison is there: the first document's o rows changed */
        const int nan_seen = memcmp(clean, poisoned, sizeof(double) * (size_t)(128 * qrow)) != 0;
        EXPECT(ok && same && nan_seen, "%s: the poisoned first document reached later ones (ok %d, "
               "same %d, first document poisoned %d)", dtype_name(c.dtype), ok, same, nan_seen);
        free(clean);
        free(poisoned);
        free(doc);
        problem_free(&pr);
    }
#ifdef _OPENMP
    omp_set_num_threads(prev);
#endif
}

static void test_documents_refused(void) {
    config c = {2, 8, 8, 2, 1, 4, 1, 3, 0, 0.5, HEXISEQ_DTYPE_F32, LAYOUT_CONTIG};
    problem pr = problem_make(&c);
    int64_t doc[16];
    for (int i = 0; i < 16; ++i)
        doc[i] = 0;
    pr.doc = doc;
    hexiseq_attn_params p = params_of(&pr);
    EXPECT(hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK, "documents: %s", hexiseq_last_error());
    p.causal = 0;
    expect_fail(hexiseq_attn_forward_cpu(&p), HEXISEQ_ERR_INVALID, "q_doc", "q_doc without causal");
    expect_fail(hexiseq_attn_backward_cpu(&p), HEXISEQ_ERR_INVALID, "causal", "q_doc without causal (backward)");
    p = params_of(&pr);
    doc[8 + 5] = -1; /* batch 1, row 5 */
    expect_fail(hexiseq_attn_forward_cpu(&p), HEXISEQ_ERR_INVALID, "q_doc[1, 5]", "q_doc below 0");
    doc[8 + 5] = 3 + 5; /* its own position: allowed */
    EXPECT(hexiseq_attn_backward_cpu(&p) == HEXISEQ_OK, "q_doc at its own position: %s", hexiseq_last_error());
    doc[8 + 5] = 3 + 6; /* past it */
    expect_fail(hexiseq_attn_backward_cpu(&p), HEXISEQ_ERR_INVALID, "q_doc[1, 5]", "q_doc past its row");
    doc[8 + 5] = 0;
    p.q_doc_stride[1] = (int64_t)1 << 61;
    expect_fail(hexiseq_attn_forward_cpu(&p), HEXISEQ_ERR_INVALID, "q_doc_stride[1]", "q_doc stride");
    /* stride 0 over the batch: one layout for every batch row */
    p = params_of(&pr);
    p.q_doc_stride[0] = 0;
    EXPECT(hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK, "q_doc broadcast over the batch: %s", hexiseq_last_error());
    problem_free(&pr);
}

int main(void) {
    clock_t t0 = clock();
    test_conversions();
    test_bad_inputs();
    test_merge_inf();
    test_configs();
    test_splits();
    test_determinism();
    test_documents();
    test_documents_one();
    test_documents_skip();
    test_documents_refused();
    fprintf(stderr, "cpu time %.2f s\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
