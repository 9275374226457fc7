/* CPU attention kernels (forward, backward, merge): the reference the CUDA kernels are tested against. */
/*
 * Layout: this file holds the shared helpers (dtype load/store, masks, scratch sizes) and the public entry
 * points. It includes attention_tile.inc twice to stamp out the typed tile kernels for one accumulator type T
 * each: double (dtype F64) and float (F32, F16, BF16, converted on load), named through HX(name). The x86-64
 * SIMD micro-kernels for float live in attention_simd.c, reached through the ops table attention_simd.h
 * declares; the fp16 / bf16 conversions in half.h.
 *
 * Tiling: a forward task owns up to FWD_GROUP query tiles (BQ rows each) of one (batch, head) and runs
 * the key loop outside the tile loop, so each K/V tile is packed once for all of them. The backward is
 * one pass (5 GEMMs per tile pair): a task owns the key tiles c, c + nchunk, ... of one (batch, kv head);
 * for each of its key tiles it walks every query tile of every query head sharing it, computes P and dS
 * once, accumulates dK/dV for the key tile and adds dQ into its chunk's own buffer; the nchunk buffers
 * are summed in a fixed order at the end. A task converts each tile of K/V/Q/dO it reads into contiguous
 * scratch, zero padded to dp (head_dim rounded up to 32) columns, some also transposed. Every product is
 * one small GEMM (gemm: C (+)= A B with a strided A, so P^T dO and dS^T Q need no transposed copy, and an
 * optional per-row scale of C, which folds the online-softmax rescale into O += P V); the forward works
 * on transposed scores st = K (scale Q)^T [keys][queries], so its online softmax runs down columns, one
 * SIMD lane per query. Under the causal mask, key tiles no query of the task sees are skipped, queries
 * that see none of a tile are left out of its GEMMs, and only the diagonal tiles mask. The document mask
 * (q_doc) bounds each query's keys from below the same way: a (query tile, key tile) pair in which no query
 * reaches back to the key tile is skipped, and only tiles that hold a document start mask (in the forward
 * by -inf scores before the column softmax and zero probabilities after it, in the backward by zeroing P
 * and dS of the masked keys), so the SIMD kernels keep their prefix-of-keys contract.
 *
 * Speed: float (F32, F16, BF16) runs its gemm / softmax / backward-row kernels through a table chosen
 * at run time (AVX-512F, AVX2+FMA, or portable C; see attention_simd.c), so the production
 * build needs no -march flag. double always uses the portable kernels. The forward pads the leading
 * dimension of Q^T and of the score tile to QLD = BQ + 16 (a 512-byte stride put the column slices the
 * S GEMM streams onto a few L1 sets), starts each thread's scratch on a 64-byte boundary, runs its
 * AVX-512 column softmax without masks on tiles every query sees whole (unrolled max, exp without the
 * upper clamp), and hands out the longest causal query groups first. The AVX-512 GEMM uses 6 x 64
 * register blocks (24 accumulators) where N allows, 8 x 32 / 8 x 16 for the rest.
 *
 * Accuracy at any length: a running sum in T grows with the number of terms it takes, and so does its rounding
 * error. The forward's O and row sums run in T over at most one piece of PIECE_TILES key tiles and are then folded
 * into double by log-sum-exp (fwd_tiles); the backward computes each query tile's share of dK, dV with a fresh GEMM
 * and adds it into double accumulators of the key tile (bwd_kv_task), rounded once at the store. A row whose
 * visible scores are all -inf is fully masked in every dtype (O = 0, LSE = -inf, no gradient, never 0 * inf).
 * A NaN or +inf among a row's visible scores (from a NaN or an infinity in q or k) makes its O and LSE NaN, and its
 * gradients and those of the keys it sees NaN, as in torch; masked keys stay out of it (their P and dS are 0).
 *
 * Determinism: every output element is produced by one task in a fixed order (dQ: per-chunk buffers,
 * nchunk chosen from the shape only, summed in chunk order), so results do not depend on the number of
 * threads or on the schedule. Memory: per-thread tile scratch, plus nchunk (<= BWD_MAX_CHUNKS)
 * dQ-sized buffers (accumulator type, rows padded to dp) in the backward.
 */
#include "attention.h"
#include "attention_simd.h"
#include "half.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#define HX_OMP(directive) _Pragma(directive)
#else
#define HX_OMP(directive)
#endif

/* The tile shape (BQ, BK, DCHUNK) is in attention_simd.h, shared with the SIMD kernels.
 * Register block of the portable score kernel: SR rows x SC columns. */
enum { SR = 2, SC = 32 };

/* Offset and position limits: see attention_check.c, which validates every params struct. */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* exp(x) in float, written with integer bit operations only so that GCC vectorises a loop of it
 * (a float compare-and-select blocks if-conversion under the default -ftrapping-math).
 * The recipe and its constants: attention_simd.h (the SIMD kernels share them); relative error < 1e-7 for x
 * in [-87, 88].
 * x < -87.3 (result would be subnormal) gives 0, x > 88 is clamped to exp(88), NaN stays NaN. */
static inline float hx_expf(float x) {
    uint32_t xb;
    memcpy(&xb, &x, sizeof xb);
    uint32_t ax = xb & 0x7fffffffu;
    uint32_t not_nan = ax <= 0x7f800000u;
    uint32_t under = (xb >> 31) & (ax > 0x42c80000u) & not_nan;         /* x < -100, -inf */
    uint32_t over = ((xb >> 31) ^ 1u) & (ax > 0x42b00000u) & not_nan; /* x > 88, +inf */
    xb = (xb & ~(0u - under)) | (0xc2c80000u & (0u - under));
    xb = (xb & ~(0u - over)) | (0x42b00000u & (0u - over));
    memcpy(&x, &xb, sizeof x);
    /* round(x * log2(e)) by the 1.5 * 2^23 trick: afterwards the low mantissa bits hold it */
    float t = x * HX_EXP_LOG2E + 12582912.0f;
    uint32_t tb;
    memcpy(&tb, &t, sizeof tb);
    int32_t n = (int32_t)(tb - 0x4b400000u);
    int32_t nc = n < -126 ? -126 : n;
    nc = nc > 127 ? 127 : nc;
    float nf = (float)nc;
    float r = x - nf * HX_EXP_LN2_HI;
    r = r + nf * HX_EXP_LN2_LO;
    float poly = HX_EXP_P0;
    poly = poly * r + HX_EXP_P1;
    poly = poly * r + HX_EXP_P2;
    poly = poly * r + HX_EXP_P3;
    poly = poly * r + HX_EXP_P4;
    poly = poly * r + HX_EXP_P5;
    poly = poly * r * r + r + 1.0f;
    uint32_t sbits = (uint32_t)(nc + 127) << 23;
    sbits &= 0u - (uint32_t)(n >= -126);
    float s;
    memcpy(&s, &sbits, sizeof s);
    return poly * s;
}

/* double -> float with round-to-odd; a later float -> half/bfloat16 rounding to nearest-even
 * then equals a direct double -> half rounding (24 >= 11 + 2 bits). */
static float f64_to_f32_odd(double x) {
    float f = (float)x;
    if ((double)f == x || x != x)
        return f;
    if (fabs((double)f) > fabs(x))
        f = nextafterf(f, 0.0f);
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= 1u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline double get_f64(const void *base, int32_t dtype, int64_t i) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: return ((const double *)base)[i];
    case HEXISEQ_DTYPE_F32: return ((const float *)base)[i];
    case HEXISEQ_DTYPE_F16: return hexiseq_f16_to_f32(((const uint16_t *)base)[i]);
    default: return hexiseq_bf16_to_f32(((const uint16_t *)base)[i]);
    }
}

static inline float get_f32(const void *base, int32_t dtype, int64_t i) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: return (float)((const double *)base)[i];
    case HEXISEQ_DTYPE_F32: return ((const float *)base)[i];
    case HEXISEQ_DTYPE_F16: return hexiseq_f16_to_f32(((const uint16_t *)base)[i]);
    default: return hexiseq_bf16_to_f32(((const uint16_t *)base)[i]);
    }
}

static inline void put_f64(void *base, int32_t dtype, int64_t i, double x) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: ((double *)base)[i] = x; break;
    case HEXISEQ_DTYPE_F32: ((float *)base)[i] = (float)x; break;
    case HEXISEQ_DTYPE_F16: ((uint16_t *)base)[i] = hexiseq_f32_to_f16(f64_to_f32_odd(x)); break;
    default: ((uint16_t *)base)[i] = hexiseq_f32_to_bf16(f64_to_f32_odd(x)); break;
    }
}

static inline void put_f32(void *base, int32_t dtype, int64_t i, float x) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: ((double *)base)[i] = x; break;
    case HEXISEQ_DTYPE_F32: ((float *)base)[i] = x; break;
    case HEXISEQ_DTYPE_F16: ((uint16_t *)base)[i] = hexiseq_f32_to_f16(x); break;
    default: ((uint16_t *)base)[i] = hexiseq_f32_to_bf16(x); break;
    }
}

/* LSE is double for F64 data, float otherwise. */
static inline double get_lse(const void *base, int32_t dtype, int64_t i) {
    return dtype == HEXISEQ_DTYPE_F64 ? ((const double *)base)[i] : (double)((const float *)base)[i];
}

static inline void put_lse(void *base, int32_t dtype, int64_t i, double x) {
    if (dtype == HEXISEQ_DTYPE_F64)
        ((double *)base)[i] = x;
    else
        ((float *)base)[i] = (float)x;
}

/* Keys of a block visible to the query at absolute position qpos: a count in [0, seq_k]. */
static inline int64_t visible_keys(const hexiseq_attn_params *p, int64_t qpos) {
    if (!p->causal)
        return p->seq_k;
    return min64(p->seq_k, max64(0, qpos - p->k_pos0 + 1));
}

/* Whether rows have a lower bound on their keys: a document mask, or a sliding window (which, in the canonical form
 * of hexiseq_attn_canonical_mask, is a left bound only). Everything named doc_ below serves both. */
static inline int has_lower_bound(const hexiseq_attn_params *p) { return p->q_doc != NULL || p->window; }

/* The first key of the block that query row i of batch b may see: the later of its document's start (q_doc) and
 * q_pos0 + i - window_left (a window), as an index into the block clamped to [0, seq_k]; 0 without either. Keys
 * before it are masked as keys past the diagonal are under the causal mask. No overflow: in the canonical form
 * q_pos0 + i - window_left >= -2^62 (see hexiseq_attn_canonical_mask), and k_pos0 <= 2^62. */
static inline int64_t doc_first_key(const hexiseq_attn_params *p, int64_t b, int64_t i) {
    if (!has_lower_bound(p))
        return 0;
    int64_t start = p->window ? p->q_pos0 + i - p->window_left : INT64_MIN / 2;
    if (p->q_doc != NULL)
        start = max64(start, p->q_doc[b * p->q_doc_stride[0] + i * p->q_doc_stride[1]]);
    return min64(p->seq_k, max64(0, start - p->k_pos0));
}

/* Under the document mask, one past the last row of rows [i0, nq) of the query tile at q0 whose document starts
 * before key kend (an index into the block): the rows after it see none of the keys below kend, so a tile pair
 * computes rows [i0, end) only. That trim is what lets a query tile holding several short documents cost their
 * pairs, not the tile's. Rows of one chunk start their documents in order, so the scan from the tile's end stops
 * at the first row that reaches back. nq without a document mask. */
static inline int64_t doc_row_end(const hexiseq_attn_params *p, int64_t b, int64_t q0, int64_t i0, int64_t nq,
                                  int64_t kend) {
    if (!has_lower_bound(p))
        return nq;
    int64_t i = nq;
    while (i > i0 && doc_first_key(p, b, q0 + i - 1) >= kend)
        --i;
    return i;
}

/* Per (batch, query tile of BQ rows): the smallest doc_first_key of its rows, [batch][nqt]. A key tile that ends
 * at or before it is seen by no row of the query tile and is skipped, as causal skips tiles past the diagonal:
 * that skip is what makes a packed sequence of short documents cost its documents' lengths, not the sequence's.
 * NULL without a document mask; *failed set when the allocation fails. */
static int64_t *doc_tile_first_keys(const hexiseq_attn_params *p, int *failed) {
    *failed = 0;
    if (!has_lower_bound(p))
        return NULL;
    const int64_t nqt = (p->seq_q + BQ - 1) / BQ;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(p->batch * nqt));
    if (first == NULL) {
        *failed = 1;
        return NULL;
    }
    for (int64_t t = 0; t < p->batch * nqt; ++t) {
        const int64_t b = t / nqt, q0 = t % nqt * BQ;
        int64_t lo = p->seq_k;
        for (int64_t i = q0; i < min64(p->seq_q, q0 + BQ); ++i)
            lo = min64(lo, doc_first_key(p, b, i));
        first[t] = lo;
    }
    return first;
}

/* dp: head_dim rounded up to a whole number of DCHUNK columns. */
static int32_t padded_dim(int32_t head_dim) { return (head_dim + DCHUNK - 1) / DCHUNK * DCHUNK; }

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Backward: dq chunks per (batch, kv head), so that batch * kv_heads * chunks reaches BWD_MIN_TASKS;
 * each chunk costs one dq-sized buffer. */
enum { BWD_MAX_CHUNKS = 4, BWD_MIN_TASKS = 16 };

/* Query tiles a forward task handles at most (it packs each K/V tile once for all of them). */
enum { FWD_GROUP = 8 };

/* Leading dimension of the forward's Q^T and score tiles: BQ plus 16 elements. A power-of-two row
 * stride (512 bytes) maps the column slices the S GEMM streams onto a few L1 sets, which then evict each
 * other (about 5% at d = 128). Padding the K / V / accumulator rows (dp) measured no gain. */
enum { QLD = BQ + 16 };

/* Key tiles a forward query tile accumulates in its working (T) accumulators before folding them into its
 * double ones (see fwd_tiles): bounds the length of every T running sum to PIECE_TILES * BK keys. */
enum { PIECE_TILES = 32 };

/* Forward scratch of one query tile, in bytes: its working part in T (esize bytes): Q^T, the piece accumulator
 * and max / sum / alpha; its folded part in double: accumulator, sum and max (see fwd_tiles). Multiples of 8. */
static size_t fwd_tile_bytes(int32_t dp, size_t esize) {
    return ((size_t)QLD * (size_t)dp + (size_t)BQ * (size_t)dp + 3 * BQ) * esize;
}
static size_t fwd_tile_hi_bytes(int32_t dp) { return ((size_t)BQ * (size_t)dp + 2 * BQ) * sizeof(double); }

/* Forward per-thread scratch, in bytes: K, V and score tiles, the working parts of `group` query tiles, then
 * their folded parts (apart, so the working set of a block of one piece is laid out as without them). */
static size_t fwd_scratch_bytes(int32_t dp, int64_t group, size_t esize) {
    const size_t ld = (size_t)dp;
    return ((size_t)2 * BK * ld + (size_t)BK * QLD) * esize +
           (size_t)group * (fwd_tile_bytes(dp, esize) + fwd_tile_hi_bytes(dp));
}

/* Backward per-thread scratch, in bytes: the buffers bwd_kv_task carves, in T (esize bytes) then the double
 * dK, dV accumulators of the key tile. A multiple of 8 bytes. */
static size_t bwd_scratch_bytes(int32_t dp, size_t esize) {
    return ((size_t)8 * BQ * (size_t)dp + (size_t)4 * BQ * BK + 4 * BQ) * esize + (size_t)2 * BK * (size_t)dp * sizeof(double);
}

/* --------------------------------------------------------------------------------------------- */
/* Typed kernels: attention_tile.inc, once per accumulator type (it undefines the type macros at its end). */

#define HX_CAT2(a, b) a##_##b
#define HX_CAT(a, b) HX_CAT2(a, b)
#define HX(name) HX_CAT(name, HEXISEQ_ATTN_SUFFIX)

#define HEXISEQ_ATTN_T double
#define HEXISEQ_ATTN_SUFFIX f64
#define HX_GET get_f64
#define HX_EXP exp
#define HX_TANH tanh
#define HX_USE_SIMD 0
#include "attention_tile.inc"

#define HEXISEQ_ATTN_T float
#define HEXISEQ_ATTN_SUFFIX f32
#define HX_GET get_f32
#define HX_EXP hx_expf
#define HX_TANH tanhf
#define HX_USE_SIMD 1
#include "attention_tile.inc"

/* --------------------------------------------------------------------------------------------- */
/* Entry points */

hexiseq_status hexiseq_attn_forward_cpu(const hexiseq_attn_params *given) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(hexiseq_attn_check_params(given, 0));
    HEXISEQ_CHECK(hexiseq_attn_check_doc_values(given));
    hexiseq_attn_params canonical = *given; /* the window as a per-row lower bound, see attention.h */
    hexiseq_attn_canonical_mask(&canonical);
    const hexiseq_attn_params *p = &canonical;
    const int32_t dp = padded_dim(p->head_dim);
    const int nthreads = max_threads();
    const int64_t nqt = (p->seq_q + BQ - 1) / BQ;
    /* A task takes up to FWD_GROUP query tiles of one head, so each K/V tile it packs serves all of them;
     * fewer while that would leave under 4 tasks per thread. Results do not depend on the grouping. */
    int64_t group = FWD_GROUP;
    while (group > 1 && p->batch * p->heads * ((nqt + group - 1) / group) < 4 * (int64_t)nthreads)
        group /= 2;
    const int64_t ngroups = (nqt + group - 1) / group;
    const int64_t ntasks = p->batch * p->heads * ngroups;
    const int f64 = p->dtype == HEXISEQ_DTYPE_F64;
    /* per-thread blocks start on 64-byte boundaries: a zmm row that straddles two cache lines costs two */
    const size_t per_thread = (fwd_scratch_bytes(dp, group, f64 ? sizeof(double) : sizeof(float)) + 63) / 64 * 64;
    char *scratch_raw = malloc(per_thread * (size_t)nthreads + 64);
    if (scratch_raw == NULL)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "forward scratch of %zu bytes could not be allocated",
                            per_thread * (size_t)nthreads);
    char *scratch = scratch_raw + (64 - (uintptr_t)scratch_raw % 64) % 64;
    int doc_failed;
    int64_t *tile_first = doc_tile_first_keys(p, &doc_failed);
    if (doc_failed) {
        free(scratch_raw);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "forward: the document mask's per-tile starts could not be allocated");
    }

    HX_OMP("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")
    for (int64_t t = 0; t < ntasks; ++t) {
        /* The last query groups of every head first: under a causal mask they are the longest, and
         * handing them out before the short ones balances the threads (dynamic schedule). */
        const int64_t bh = t % (p->batch * p->heads);
        const int64_t b = bh / p->heads;
        const int32_t h = (int32_t)(bh % p->heads);
        const int64_t g = ngroups - 1 - t / (p->batch * p->heads);
        const int64_t qt0 = g * group;
        const int64_t ntile = min64(group, nqt - qt0);
        char *mine = scratch + per_thread * (size_t)thread_id();
        const int64_t *first = tile_first != NULL ? tile_first + b * nqt + qt0 : NULL;
        if (f64)
            fwd_tiles_f64(p, b, h, qt0, ntile, first, (double *)(void *)mine, dp);
        else
            fwd_tiles_f32(p, b, h, qt0, ntile, first, (float *)(void *)mine, dp);
    }
    free(scratch_raw);
    free(tile_first);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_attn_backward_cpu(const hexiseq_attn_params *given) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(hexiseq_attn_check_params(given, 1));
    HEXISEQ_CHECK(hexiseq_attn_check_doc_values(given));
    hexiseq_attn_params canonical = *given;
    hexiseq_attn_canonical_mask(&canonical);
    const hexiseq_attn_params *p = &canonical;
    const int32_t dp = padded_dim(p->head_dim);
    const int nthreads = max_threads();
    const int f64 = p->dtype == HEXISEQ_DTYPE_F64;
    const size_t esize = f64 ? sizeof(double) : sizeof(float);
    const size_t per_thread = bwd_scratch_bytes(dp, esize);
    const int64_t rows = p->batch * p->heads * p->seq_q;
    const int64_t nkt = (p->seq_k + BK - 1) / BK;
    /* Tasks: (batch, kv head, chunk); chunk c takes the key tiles c, c + nchunk, ... (interleaved, so
     * causal chunks get similar work) and adds its dq into its own [batch, heads, seq_q][dp] buffer;
     * the buffers are summed in a fixed order at the end. nchunk depends on the shape only, never on
     * the thread count, so results are the same for any number of threads. */
    int64_t nchunk = 1;
    while (nchunk < BWD_MAX_CHUNKS && nchunk < nkt && p->batch * p->kv_heads * nchunk < BWD_MIN_TASKS)
        nchunk *= 2;
    nchunk = min64(nchunk, nkt);
    const size_t buf_elems = (size_t)rows * (size_t)dp;
    /* D = rowsum(dO * O) per (batch, head, query row), [batch, heads, seq_q] contiguous. */
    char *delta = malloc((size_t)rows * esize);
    char *scratch = malloc(per_thread * (size_t)nthreads);
    char *dqbuf = calloc(buf_elems * (size_t)nchunk, esize);
    /* double dq buffers, folded into every PIECE_TILES key tiles, when a task takes more key tiles than that */
    const int split_dq = (nkt + nchunk - 1) / nchunk > PIECE_TILES;
    double *dqhi = split_dq ? calloc(buf_elems * (size_t)nchunk, sizeof(double)) : NULL;
    int doc_failed;
    int64_t *tile_first = doc_tile_first_keys(p, &doc_failed);
    if (scratch == NULL || delta == NULL || dqbuf == NULL || (split_dq && dqhi == NULL) || doc_failed) {
        free(scratch);
        free(delta);
        free(dqbuf);
        free(dqhi);
        free(tile_first);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "backward scratch of %zu bytes could not be allocated",
                            per_thread * (size_t)nthreads + (size_t)rows * esize +
                                buf_elems * (size_t)nchunk * (esize + (split_dq ? sizeof(double) : 0)));
    }

    HX_OMP("omp parallel num_threads(nthreads)")
    {
        HX_OMP("omp for schedule(static)")
        for (int64_t r = 0; r < rows; ++r) {
            if (f64)
                delta_row_f64(p, r, (double *)(void *)delta);
            else
                delta_row_f32(p, r, (float *)(void *)delta);
        }
        /* implicit barrier: every D is written before any tile reads it */
        const int64_t ntasks = p->batch * p->kv_heads * nchunk;
        HX_OMP("omp for schedule(dynamic, 1)")
        for (int64_t t = 0; t < ntasks; ++t) {
            const int64_t b = t / (p->kv_heads * nchunk);
            const int32_t hk = (int32_t)(t / nchunk % p->kv_heads);
            const int64_t c = t % nchunk;
            char *mine = scratch + per_thread * (size_t)thread_id();
            char *buf = dqbuf + buf_elems * (size_t)c * esize;
            double *hi = split_dq ? dqhi + buf_elems * (size_t)c : NULL;
            const int64_t *first = tile_first != NULL ? tile_first + b * ((p->seq_q + BQ - 1) / BQ) : NULL;
            if (f64)
                bwd_kv_task_f64(p, b, hk, c, nchunk, first, (const double *)(void *)delta, (double *)(void *)buf, hi,
                                (double *)(void *)mine, dp);
            else
                bwd_kv_task_f32(p, b, hk, c, nchunk, first, (const float *)(void *)delta, (float *)(void *)buf, hi,
                                (float *)(void *)mine, dp);
        }
        /* implicit barrier: every dq contribution is in its buffer */
        HX_OMP("omp for schedule(static)")
        for (int64_t r = 0; r < rows; ++r) {
            if (f64)
                bwd_dq_row_f64(p, r, (const double *)(void *)dqbuf, dqhi, nchunk, buf_elems, dp);
            else
                bwd_dq_row_f32(p, r, (const float *)(void *)dqbuf, dqhi, nchunk, buf_elems, dp);
        }
    }
    free(scratch);
    free(delta);
    free(dqbuf);
    free(dqhi);
    free(tile_first);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_attn_merge_cpu(const hexiseq_attn_merge_params *m) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(hexiseq_attn_check_merge(m));
    const int64_t rows = m->batch * m->heads * m->seq;
    HX_OMP("omp parallel for schedule(static)")
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = r / ((int64_t)m->heads * m->seq);
        const int64_t h = r / m->seq % m->heads;
        const int64_t s = r % m->seq;
        const int64_t la_at = b * m->lse_acc_stride[0] + h * m->lse_acc_stride[1] + s * m->lse_acc_stride[2];
        const int64_t lp_at = b * m->lse_part_stride[0] + h * m->lse_part_stride[1] + s * m->lse_part_stride[2];
        const int64_t oa_at = b * m->o_acc_stride[0] + s * m->o_acc_stride[1] + h * m->o_acc_stride[2];
        const int64_t op_at = b * m->o_part_stride[0] + s * m->o_part_stride[1] + h * m->o_part_stride[2];
        const int64_t oa_cs = m->o_acc_stride[3];
        const int64_t op_cs = m->o_part_stride[3];
        const double la = get_lse(m->lse_acc, m->acc_dtype, la_at);
        const double lp = get_lse(m->lse_part, m->part_dtype, lp_at);
        if (lp == -INFINITY)
            continue; /* the partial saw no key: exact no-op */
        if (la == -INFINITY) {
            for (int32_t c = 0; c < m->head_dim; ++c)
                put_f64(m->o_acc, m->acc_dtype, oa_at + c * oa_cs, get_f64(m->o_part, m->part_dtype, op_at + c * op_cs));
            put_lse(m->lse_acc, m->acc_dtype, la_at, lp);
            continue;
        }
        /* logaddexp without overflow: the larger term factors out, the weights are <= 1 */
        const double hi = la > lp ? la : lp;
        const double lnew = hi + log1p(exp(-fabs(la - lp)));
        const double wa = exp(la - lnew);
        const double wp = exp(lp - lnew);
        for (int32_t c = 0; c < m->head_dim; ++c) {
            const double oa = get_f64(m->o_acc, m->acc_dtype, oa_at + c * oa_cs);
            const double op = get_f64(m->o_part, m->part_dtype, op_at + c * op_cs);
            put_f64(m->o_acc, m->acc_dtype, oa_at + c * oa_cs, wa * oa + wp * op);
        }
        put_lse(m->lse_acc, m->acc_dtype, la_at, lnew);
    }
    return HEXISEQ_OK;
}
