/* CPU attention kernels (forward, backward, merge): the reference the CUDA kernels are tested against. */
/*
 * This file is compiled once and includes itself twice to stamp out the tile kernels for one
 * accumulator type T: double (dtype F64) and float (F32, F16, BF16, converted on load). The outer
 * pass (HEXISEQ_ATTN_T undefined) holds the shared helpers and the public entry points; the inner
 * pass (below the #else near the end) holds the typed kernels, named through HX(name).
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
 * that see none of a tile are left out of its GEMMs, and only the diagonal tiles mask.
 *
 * Speed: float (F32, F16, BF16) runs its gemm / softmax / backward-row kernels through a table chosen
 * at run time (AVX-512F, AVX2+FMA, or portable C; see the x86-64 SIMD section), so the production
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
 *
 * Determinism: every output element is produced by one task in a fixed order (dQ: per-chunk buffers,
 * nchunk chosen from the shape only, summed in chunk order), so results do not depend on the number of
 * threads or on the schedule. Memory: per-thread tile scratch, plus nchunk (<= BWD_MAX_CHUNKS)
 * dQ-sized buffers (accumulator type, rows padded to dp) in the backward.
 */
#ifndef HEXISEQ_ATTN_T

#include "attention.h"

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

enum { BQ = 128, BK = 64, DCHUNK = 32 };
/* Register block of the score kernel: SR rows x SC columns. */
enum { SR = 2, SC = 32 };

/* Offset and position limits: see csrc/attention_check.c, which validates every params struct. */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* exp(x) in float, written with integer bit operations only so that GCC vectorises a loop of it
 * (a float compare-and-select blocks if-conversion under the default -ftrapping-math).
 * Cephes polynomial after a Cody-Waite reduction: relative error < 1e-7 for x in [-87, 88].
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
    float t = x * 1.44269504088896341f + 12582912.0f;
    uint32_t tb;
    memcpy(&tb, &t, sizeof tb);
    int32_t n = (int32_t)(tb - 0x4b400000u);
    int32_t nc = n < -126 ? -126 : n;
    nc = nc > 127 ? 127 : nc;
    float nf = (float)nc;
    float r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
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
    return ((size_t)8 * BQ * (size_t)dp + (size_t)3 * BQ * BK + 4 * BQ) * esize + (size_t)2 * BK * (size_t)dp * sizeof(double);
}

/* --------------------------------------------------------------------------------------------- */
/* x86-64 SIMD kernels for float (F32, F16, BF16 all compute in float).
 *
 * Built with per-function target attributes, so the file still compiles with plain -O3 (no -march)
 * and runs anywhere: hx_simd_level() picks AVX-512F, AVX2+FMA or the portable C kernels at run time
 * (the environment variable HEXISEQ_ATTN_SIMD=0|1|2 caps the level, so tests can cover each path).
 * The choice depends only on the machine, never on the thread count, so results stay deterministic.
 * Each set provides the three ops of the typed kernels: gemm (register-blocked micro-kernel, explicit
 * FMA), softmax_cols (forward online softmax, one lane per query) and bwd_row (P and dS of a BK = 64
 * score row, vectorised exp, masked past jmax). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HX_F32_SIMD 1
#include <immintrin.h>

#define HX_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define HX_AVX2 __attribute__((target("avx2,fma")))
#define HX_INLINE static inline __attribute__((always_inline))

static int hx_simd_level(void) {
    int level = 0;
    if (__builtin_cpu_supports("avx512f"))
        level = 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        level = 1;
    const char *cap = getenv("HEXISEQ_ATTN_SIMD");
    if (cap != NULL && cap[0] >= '0' && cap[0] <= '2' && cap[0] - '0' < level)
        level = cap[0] - '0';
    return level;
}

/* Cephes expf coefficients, as in hx_expf. */
#define HX_EXP_P0 1.9875691500e-4f
#define HX_EXP_P1 1.3981999507e-3f
#define HX_EXP_P2 8.3334519073e-3f
#define HX_EXP_P3 4.1665795894e-2f
#define HX_EXP_P4 1.6666665459e-1f
#define HX_EXP_P5 5.0000001201e-1f

/* ---- AVX-512F ---- */

/* exp(x) for x <= 88 or NaN, no upper clamp (the forward's shifted scores are <= 0): range reduction by ln 2,
 * Cephes polynomial, Horner tail 1 + r (1 + r P(r)); relative error ~1e-7; -inf and x < -100 give ~0, NaN
 * stays NaN. */
HX_INLINE HX_AVX512 __m512 hx_exp512_neg(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-100.0f), x); /* max(c, NaN) = NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(HX_EXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(HX_EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(HX_EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(HX_EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(HX_EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(HX_EXP_P5));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* exp(x) for any x: clamped at 88 (exp overflows float just above), then as hx_exp512_neg. */
HX_INLINE HX_AVX512 __m512 hx_exp512(__m512 x) {
    return hx_exp512_neg(_mm512_min_ps(_mm512_set1_ps(88.0f), x)); /* min(c, NaN) = NaN */
}

/* Lanes of the 16-wide chunk q of a BK row that lie below jmax. */
HX_INLINE HX_AVX512 __mmask16 hx_mask16(int64_t jmax, int q) {
    const int64_t rem = jmax - 16 * q;
    return rem >= 16 ? (__mmask16)0xffff : rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1u);
}

/* MR rows x (16 * NV) columns of C in zmm registers over the k loop: per k, NV loads of B and MR
 * broadcasts of A feed MR * NV FMAs. MR <= 8, NV <= 4, MR * NV <= 24; constants after inlining. */
HX_INLINE HX_AVX512 void hx_mk512(const int MR, const int NV, float *restrict C, int64_t ldc,
                                  const float *restrict A, int64_t a_rs, int64_t a_ks, const float *restrict B,
                                  int64_t ldb, int64_t K, int accumulate, const float *restrict rs) {
    __m512 c[8][4];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
            c[r][v] = _mm512_setzero_ps();
            if (r < MR && v < NV && accumulate) {
                c[r][v] = _mm512_loadu_ps(C + r * ldc + 16 * v);
                if (rs != NULL)
                    c[r][v] = _mm512_mul_ps(c[r][v], _mm512_set1_ps(rs[r]));
            }
        }
    }
    for (int64_t k = 0; k < K; ++k) {
        const float *restrict bk = B + k * ldb;
        const float *restrict ak = A + k * a_ks;
        __m512 b[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
            b[v] = v < NV ? _mm512_loadu_ps(bk + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            if (r < MR) {
                const __m512 a = _mm512_set1_ps(ak[r * a_rs]);
#pragma GCC unroll 4
                for (int v = 0; v < 4; ++v)
                    if (v < NV)
                        c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
            if (r < MR && v < NV)
                _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
}

#define HX_MK512_CASE(mr, nv)                                                                               \
    case mr: hx_mk512(mr, nv, c, ldc, a, a_rs, a_ks, B + n0, ldb, K, accumulate, r_s); break;

/* Same contract as the portable gemm; N must be a multiple of 16 (it is BK or dp). Column blocks of 64
 * (6 rows x 4 zmm: 10 loads per 24 FMAs) while they last, then of 32 or 16 (8 rows x 2 or 1 zmm). Every
 * element of C is still one FMA chain over k in order, so the blocking does not change results. */
static HX_AVX512 void gemm_f32_avx512(float *C, int64_t ldc, const float *A, int64_t a_rs, int64_t a_ks,
                                      const float *B, int64_t ldb, int64_t M, int64_t N, int64_t K, int accumulate,
                                      const float *rowscale) {
    int64_t n0 = 0;
    for (; n0 + 64 <= N; n0 += 64) {
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            float *c = C + m0 * ldc + n0;
            const float *a = A + m0 * a_rs;
            const float *r_s = rowscale != NULL ? rowscale + m0 : NULL;
            switch (M - m0 >= 6 ? 6 : (int)(M - m0)) {
                HX_MK512_CASE(6, 4)
                HX_MK512_CASE(5, 4)
                HX_MK512_CASE(4, 4)
                HX_MK512_CASE(3, 4)
                HX_MK512_CASE(2, 4)
                HX_MK512_CASE(1, 4)
            default: break;
            }
        }
    }
    for (; n0 < N; n0 += 32) {
        const int nv = N - n0 >= 32 ? 2 : 1;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            float *c = C + m0 * ldc + n0;
            const float *a = A + m0 * a_rs;
            const float *r_s = rowscale != NULL ? rowscale + m0 : NULL;
            if (nv == 2) {
                switch (M - m0 >= 8 ? 8 : (int)(M - m0)) {
                    HX_MK512_CASE(8, 2)
                    HX_MK512_CASE(7, 2)
                    HX_MK512_CASE(6, 2)
                    HX_MK512_CASE(5, 2)
                    HX_MK512_CASE(4, 2)
                    HX_MK512_CASE(3, 2)
                    HX_MK512_CASE(2, 2)
                    HX_MK512_CASE(1, 2)
                default: break;
                }
            } else {
                switch (M - m0 >= 8 ? 8 : (int)(M - m0)) {
                    HX_MK512_CASE(8, 1)
                    HX_MK512_CASE(7, 1)
                    HX_MK512_CASE(6, 1)
                    HX_MK512_CASE(5, 1)
                    HX_MK512_CASE(4, 1)
                    HX_MK512_CASE(3, 1)
                    HX_MK512_CASE(2, 1)
                    HX_MK512_CASE(1, 1)
                default: break;
                }
            }
        }
    }
}

/* Column softmax (see the portable softmax_cols); ncols is a multiple of 16. Vectorised across queries,
 * so the max and sum over keys are plain vertical operations. */
static HX_AVX512 void softmax_cols_f32_avx512(float *st, int64_t ld, int64_t nk, int64_t ncols, const int32_t *jlim,
                                              float *mx, float *sum, float *alpha) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < ncols; i += 16) {
        const __m512i lim = _mm512_loadu_si512((const void *)(jlim + i));
        /* every lane sees all nk keys (all but the diagonal tiles of a causal mask): no masks */
        const int full = _mm512_cmplt_epi32_mask(lim, _mm512_set1_epi32((int32_t)nk)) == 0;
        /* four independent max chains (max is exact, so the order does not matter) */
        __m512 v0 = ninf, v1 = ninf, v2 = ninf, v3 = ninf;
        int64_t j = 0;
        if (full) {
            for (; j + 4 <= nk; j += 4) {
                v0 = _mm512_max_ps(v0, _mm512_loadu_ps(st + j * ld + i));
                v1 = _mm512_max_ps(v1, _mm512_loadu_ps(st + (j + 1) * ld + i));
                v2 = _mm512_max_ps(v2, _mm512_loadu_ps(st + (j + 2) * ld + i));
                v3 = _mm512_max_ps(v3, _mm512_loadu_ps(st + (j + 3) * ld + i));
            }
        }
        for (; j < nk; ++j) {
            const __mmask16 m = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32((int32_t)j));
            v0 = _mm512_mask_max_ps(v0, m, v0, _mm512_loadu_ps(st + j * ld + i));
        }
        const __m512 vmax = _mm512_max_ps(_mm512_max_ps(v0, v1), _mm512_max_ps(v2, v3));
        const __m512 mold = _mm512_loadu_ps(mx + i);
        const __m512 mnew = _mm512_max_ps(mold, vmax);
        const __m512 shift = _mm512_mask_mov_ps(mnew, _mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
        const __m512 a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mold, ninf, _CMP_NEQ_UQ),
                                             hx_exp512_neg(_mm512_sub_ps(mold, mnew)));
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        j = 0;
        if (full) {
            for (; j + 2 <= nk; j += 2) {
                float *row0 = st + j * ld + i, *row1 = row0 + ld;
                const __m512 e0 = hx_exp512_neg(_mm512_sub_ps(_mm512_loadu_ps(row0), shift));
                const __m512 e1 = hx_exp512_neg(_mm512_sub_ps(_mm512_loadu_ps(row1), shift));
                _mm512_storeu_ps(row0, e0);
                _mm512_storeu_ps(row1, e1);
                s0 = _mm512_add_ps(s0, e0);
                s1 = _mm512_add_ps(s1, e1);
            }
        }
        for (; j < nk; ++j) {
            const __mmask16 m = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32((int32_t)j));
            float *row = st + j * ld + i;
            const __m512 e = _mm512_maskz_mov_ps(m, hx_exp512_neg(_mm512_sub_ps(_mm512_loadu_ps(row), shift)));
            _mm512_storeu_ps(row, e);
            s0 = _mm512_add_ps(s0, e);
        }
        const __m512 vsum = _mm512_add_ps(s0, s1);
        _mm512_storeu_ps(sum + i, _mm512_fmadd_ps(_mm512_loadu_ps(sum + i), a, vsum));
        _mm512_storeu_ps(mx + i, mnew);
        _mm512_storeu_ps(alpha + i, a);
    }
}

static HX_AVX512 void bwd_row_f32_avx512(float *s, float *ds, int64_t jmax, float lse, float dd) {
    if (jmax <= 0 || lse == -INFINITY)
        jmax = 0;
    const __m512 vl = _mm512_set1_ps(lse == -INFINITY ? 0 : lse), vd = _mm512_set1_ps(dd);
    for (int q = 0; q < BK / 16; ++q) {
        const __mmask16 m = hx_mask16(jmax, q);
        const __m512 pr = _mm512_maskz_mov_ps(m, hx_exp512(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * q), vl)));
        const __m512 g = _mm512_maskz_mov_ps(m, _mm512_sub_ps(_mm512_loadu_ps(ds + 16 * q), vd));
        _mm512_storeu_ps(s + 16 * q, pr);
        _mm512_storeu_ps(ds + 16 * q, _mm512_mul_ps(pr, g));
    }
}

/* hi[e] += (double)lo[e] for e < n: the backward's fold of one query tile's dK / dV into the key tile's
 * double accumulators (see fold in the typed kernels). */
static HX_AVX512 void fold_f32_avx512(double *hi, const float *lo, int64_t n) {
    int64_t e = 0;
    for (; e + 16 <= n; e += 16) {
        _mm512_storeu_pd(hi + e, _mm512_add_pd(_mm512_loadu_pd(hi + e), _mm512_cvtps_pd(_mm256_loadu_ps(lo + e))));
        _mm512_storeu_pd(hi + e + 8,
                         _mm512_add_pd(_mm512_loadu_pd(hi + e + 8), _mm512_cvtps_pd(_mm256_loadu_ps(lo + e + 8))));
    }
    for (; e < n; ++e)
        hi[e] += (double)lo[e];
}

/* ---- AVX2 + FMA ---- */

/* exp(x), relative error ~1e-7; x below -87.3 (and -inf) is raised to -87.3 (result ~1e-38), NaN stays NaN. */
HX_INLINE HX_AVX2 __m256 hx_exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(HX_EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(HX_EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(HX_EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(HX_EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(HX_EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(HX_EXP_P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n for n in [-126, 127]: (n + 127) << 23 */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* All-ones lanes of the 8-wide chunk q of a BK row that lie below jmax. */
HX_INLINE HX_AVX2 __m256 hx_mask8(int64_t jmax, int q) {
    const int32_t rem = (int32_t)(jmax < 0 ? 0 : jmax > BK ? BK : jmax) - 8 * q;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* MR rows x 16 columns (two ymm) of C in registers over the k loop; MR <= 6. */
HX_INLINE HX_AVX2 void hx_mk256(const int MR, float *restrict C, int64_t ldc, const float *restrict A, int64_t a_rs,
                                int64_t a_ks, const float *restrict B, int64_t ldb, int64_t K, int accumulate,
                                const float *restrict rs) {
    __m256 c0[6], c1[6];
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
        c0[r] = _mm256_setzero_ps();
        c1[r] = _mm256_setzero_ps();
        if (r < MR && accumulate) {
            c0[r] = _mm256_loadu_ps(C + r * ldc);
            c1[r] = _mm256_loadu_ps(C + r * ldc + 8);
            if (rs != NULL) {
                const __m256 f = _mm256_set1_ps(rs[r]);
                c0[r] = _mm256_mul_ps(c0[r], f);
                c1[r] = _mm256_mul_ps(c1[r], f);
            }
        }
    }
    for (int64_t k = 0; k < K; ++k) {
        const float *restrict bk = B + k * ldb;
        const float *restrict ak = A + k * a_ks;
        const __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps(bk + 8);
#pragma GCC unroll 6
        for (int r = 0; r < 6; ++r) {
            if (r < MR) {
                const __m256 a = _mm256_broadcast_ss(ak + r * a_rs);
                c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
                c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
        if (r < MR) {
            _mm256_storeu_ps(C + r * ldc, c0[r]);
            _mm256_storeu_ps(C + r * ldc + 8, c1[r]);
        }
    }
}

#define HX_MK256_CASE(mr)                                                                                   \
    case mr: hx_mk256(mr, c, ldc, a, a_rs, a_ks, B + n0, ldb, K, accumulate, r_s); break;

static HX_AVX2 void gemm_f32_avx2(float *C, int64_t ldc, const float *A, int64_t a_rs, int64_t a_ks,
                                  const float *B, int64_t ldb, int64_t M, int64_t N, int64_t K, int accumulate,
                                  const float *rowscale) {
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            float *c = C + m0 * ldc + n0;
            const float *a = A + m0 * a_rs;
            const float *r_s = rowscale != NULL ? rowscale + m0 : NULL;
            switch (M - m0 >= 6 ? 6 : (int)(M - m0)) {
                HX_MK256_CASE(6)
                HX_MK256_CASE(5)
                HX_MK256_CASE(4)
                HX_MK256_CASE(3)
                HX_MK256_CASE(2)
                HX_MK256_CASE(1)
            default: break;
            }
        }
    }
}

/* Column softmax, AVX2; ncols is a multiple of 8. */
static HX_AVX2 void softmax_cols_f32_avx2(float *st, int64_t ld, int64_t nk, int64_t ncols, const int32_t *jlim,
                                          float *mx, float *sum, float *alpha) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < ncols; i += 8) {
        const __m256i lim = _mm256_loadu_si256((const __m256i *)(const void *)(jlim + i));
        __m256 vmax = ninf;
        for (int64_t j = 0; j < nk; ++j) {
            const __m256 m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_set1_epi32((int32_t)j)));
            vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, _mm256_loadu_ps(st + j * ld + i), m));
        }
        const __m256 mold = _mm256_loadu_ps(mx + i);
        const __m256 mnew = _mm256_max_ps(mold, vmax);
        const __m256 shift = _mm256_andnot_ps(_mm256_cmp_ps(mnew, ninf, _CMP_EQ_OQ), mnew);
        const __m256 a = _mm256_and_ps(_mm256_cmp_ps(mold, ninf, _CMP_NEQ_UQ), hx_exp256(_mm256_sub_ps(mold, mnew)));
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t j = 0; j < nk; ++j) {
            const __m256 m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_set1_epi32((int32_t)j)));
            float *row = st + j * ld + i;
            const __m256 e = _mm256_and_ps(m, hx_exp256(_mm256_sub_ps(_mm256_loadu_ps(row), shift)));
            _mm256_storeu_ps(row, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        _mm256_storeu_ps(sum + i, _mm256_fmadd_ps(_mm256_loadu_ps(sum + i), a, vsum));
        _mm256_storeu_ps(mx + i, mnew);
        _mm256_storeu_ps(alpha + i, a);
    }
}

static HX_AVX2 void bwd_row_f32_avx2(float *s, float *ds, int64_t jmax, float lse, float dd) {
    if (jmax <= 0 || lse == -INFINITY)
        jmax = 0;
    const __m256 vl = _mm256_set1_ps(lse == -INFINITY ? 0 : lse), vd = _mm256_set1_ps(dd);
    for (int q = 0; q < BK / 8; ++q) {
        const __m256 m = hx_mask8(jmax, q);
        const __m256 pr = _mm256_and_ps(m, hx_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * q), vl)));
        const __m256 g = _mm256_and_ps(m, _mm256_sub_ps(_mm256_loadu_ps(ds + 8 * q), vd));
        _mm256_storeu_ps(s + 8 * q, pr);
        _mm256_storeu_ps(ds + 8 * q, _mm256_mul_ps(pr, g));
    }
}

static HX_AVX2 void fold_f32_avx2(double *hi, const float *lo, int64_t n) {
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) {
        _mm256_storeu_pd(hi + e, _mm256_add_pd(_mm256_loadu_pd(hi + e), _mm256_cvtps_pd(_mm_loadu_ps(lo + e))));
        _mm256_storeu_pd(hi + e + 4,
                         _mm256_add_pd(_mm256_loadu_pd(hi + e + 4), _mm256_cvtps_pd(_mm_loadu_ps(lo + e + 4))));
    }
    for (; e < n; ++e)
        hi[e] += (double)lo[e];
}

#else
#define HX_F32_SIMD 0
#endif /* x86-64 SIMD */

/* --------------------------------------------------------------------------------------------- */
/* Typed kernels */

#define HX_CAT2(a, b) a##_##b
#define HX_CAT(a, b) HX_CAT2(a, b)
#define HX(name) HX_CAT(name, HEXISEQ_ATTN_SUFFIX)

#define HEXISEQ_ATTN_T double
#define HEXISEQ_ATTN_SUFFIX f64
#define HX_GET get_f64
#define HX_PUT put_f64
#define HX_EXP exp
#define HX_LOG log
#define HX_USE_SIMD 0
#include "attention_cpu.c"
#undef HX_USE_SIMD
#undef HEXISEQ_ATTN_T
#undef HEXISEQ_ATTN_SUFFIX
#undef HX_GET
#undef HX_PUT
#undef HX_EXP
#undef HX_LOG

#define HEXISEQ_ATTN_T float
#define HEXISEQ_ATTN_SUFFIX f32
#define HX_GET get_f32
#define HX_PUT put_f32
#define HX_EXP hx_expf
#define HX_LOG logf
#define HX_USE_SIMD HX_F32_SIMD
#include "attention_cpu.c"
#undef HX_USE_SIMD
#undef HEXISEQ_ATTN_T
#undef HEXISEQ_ATTN_SUFFIX
#undef HX_GET
#undef HX_PUT
#undef HX_EXP
#undef HX_LOG

/* --------------------------------------------------------------------------------------------- */
/* Entry points */

hexiseq_status hexiseq_attn_forward_cpu(const hexiseq_attn_params *p) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(hexiseq_attn_check_params(p, 0));
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
        if (f64)
            fwd_tiles_f64(p, b, h, qt0, ntile, (double *)(void *)mine, dp);
        else
            fwd_tiles_f32(p, b, h, qt0, ntile, (float *)(void *)mine, dp);
    }
    free(scratch_raw);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_attn_backward_cpu(const hexiseq_attn_params *p) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(hexiseq_attn_check_params(p, 1));
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
    if (scratch == NULL || delta == NULL || dqbuf == NULL || (split_dq && dqhi == NULL)) {
        free(scratch);
        free(delta);
        free(dqbuf);
        free(dqhi);
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
            if (f64)
                bwd_kv_task_f64(p, b, hk, c, nchunk, (const double *)(void *)delta, (double *)(void *)buf, hi,
                                (double *)(void *)mine, dp);
            else
                bwd_kv_task_f32(p, b, hk, c, nchunk, (const float *)(void *)delta, (float *)(void *)buf, hi,
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

#else /* ------------------------------------------------------------------------------------------ */
/* Typed kernels for T = HEXISEQ_ATTN_T (inner pass of the self-include). */

typedef HEXISEQ_ATTN_T HX(T);
#define T HX(T)

/* dst[r][c] (ld dp) = mul * src[off + r*rs + c*cs] for r < n, c < d; zero for c >= d and for
 * n <= r < rows_out. */
static void HX(load_rows)(T *restrict dst /* [rows_out][dp] */, const void *src, int32_t dtype, int64_t off,
                          int64_t rs, int64_t cs, int64_t n, int64_t rows_out, int32_t d, int32_t dp, T mul) {
    for (int64_t r = 0; r < n; ++r) {
        T *restrict row = dst + r * dp;
        const int64_t at = off + r * rs;
        if (dtype == HEXISEQ_DTYPE_F32 && cs == 1 && mul == 1 && sizeof(T) == sizeof(float)) {
            memcpy(row, (const float *)src + at, sizeof(float) * (size_t)d);
        } else if (dtype == HEXISEQ_DTYPE_F32 && cs == 1) {
            const float *restrict s = (const float *)src + at;
            for (int32_t c = 0; c < d; ++c)
                row[c] = mul * (T)s[c];
        } else {
            for (int32_t c = 0; c < d; ++c)
                row[c] = mul * HX_GET(src, dtype, at + c * cs);
        }
        for (int32_t c = d; c < dp; ++c)
            row[c] = 0;
    }
    for (int64_t r = n; r < rows_out; ++r)
        memset(dst + r * dp, 0, sizeof(T) * (size_t)dp);
}

/* Transposed load: dst[c][r] (ld ld) = mul * src[off + r*rs + c*cs] for r < n, c < d; zero for n <= r < ld.
 * Rows c >= d are not read by any kernel and are left as they are. */
static void HX(load_cols)(T *restrict dst /* [dp][ld] */, int64_t ld, const void *src, int32_t dtype, int64_t off,
                          int64_t rs, int64_t cs, int64_t n, int32_t d, T mul) {
    int64_t r = 0;
    if (dtype == HEXISEQ_DTYPE_F32 && cs == 1) {
        /* 16 source rows at a time, so they stay in L1 while each destination row gets 16 contiguous
         * elements (a row at a time would touch d destination lines per source row) */
        for (; r + 16 <= n; r += 16) {
            const float *restrict s = (const float *)src + off + r * rs;
            for (int32_t c = 0; c < d; ++c) {
                T *restrict out = dst + c * ld + r;
                for (int rr = 0; rr < 16; ++rr)
                    out[rr] = mul * (T)s[rr * rs + c];
            }
        }
    }
    for (; r < n; ++r) {
        const int64_t at = off + r * rs;
        if (dtype == HEXISEQ_DTYPE_F32 && cs == 1) {
            const float *restrict s = (const float *)src + at;
            for (int32_t c = 0; c < d; ++c)
                dst[c * ld + r] = mul * (T)s[c];
        } else {
            for (int32_t c = 0; c < d; ++c)
                dst[c * ld + r] = mul * HX_GET(src, dtype, at + c * cs);
        }
    }
    for (int32_t c = 0; c < d; ++c)
        for (int64_t r = n; r < ld; ++r)
            dst[c * ld + r] = 0;
}

/* C[m][n] = (accumulate ? C[m][n] * (rowscale ? rowscale[m] : 1) : 0)
 *           + sum_{k < K} A[m*a_rs + k*a_ks] * B[k*ldb + n]   for m < M, n < N.
 * The one small GEMM every product of the family maps onto: S = Q K^T (A = Q rows, B = K^T), O += P V,
 * dQ += dS K, and the transposed-A products dV += P^T dO, dK += dS^T Q (a_rs = 1, a_ks = row length).
 * Portable version: a block of SR rows x SC columns of C stays in registers over the k loop. */
static void HX(gemm)(T *restrict C, int64_t ldc, const T *restrict A, int64_t a_rs, int64_t a_ks,
                     const T *restrict B, int64_t ldb, int64_t M, int64_t N, int64_t K, int accumulate,
                     const T *restrict rowscale) {
    for (int64_t n0 = 0; n0 < N; n0 += SC) {
        const int64_t w = min64(SC, N - n0); /* SC except for a last partial block */
        int64_t m = 0;
        for (; m + SR <= M; m += SR) {
            T acc[SR][SC];
            for (int r = 0; r < SR; ++r)
                for (int j = 0; j < SC; ++j)
                    acc[r][j] = accumulate && j < w ? C[(m + r) * ldc + n0 + j] * (rowscale ? rowscale[m + r] : 1) : 0;
            if (w == SC) {
                for (int64_t k = 0; k < K; ++k) {
                    const T *restrict bk = B + k * ldb + n0;
                    for (int r = 0; r < SR; ++r) {
                        const T x = A[(m + r) * a_rs + k * a_ks];
                        for (int j = 0; j < SC; ++j)
                            acc[r][j] += x * bk[j];
                    }
                }
            } else {
                for (int64_t k = 0; k < K; ++k)
                    for (int r = 0; r < SR; ++r)
                        for (int64_t j = 0; j < w; ++j)
                            acc[r][j] += A[(m + r) * a_rs + k * a_ks] * B[k * ldb + n0 + j];
            }
            for (int r = 0; r < SR; ++r)
                for (int64_t j = 0; j < w; ++j)
                    C[(m + r) * ldc + n0 + j] = acc[r][j];
        }
        for (; m < M; ++m) {
            for (int64_t j = 0; j < w; ++j) {
                T acc = accumulate ? C[m * ldc + n0 + j] * (rowscale ? rowscale[m] : 1) : 0;
                for (int64_t k = 0; k < K; ++k)
                    acc += A[m * a_rs + k * a_ks] * B[k * ldb + n0 + j];
                C[m * ldc + n0 + j] = acc;
            }
        }
    }
}

/* Column form of the online-softmax step, for the transposed scores st[j][i] (ld ld) of nk keys x ncols
 * queries: column i sees keys j < jlim[i] (0 <= jlim[i] <= nk). Per column, m_new = max(mx, max_j st),
 * st[j][i] = exp(st[j][i] - m_new) for visible keys and 0 otherwise; mx, sum are updated and alpha[i] =
 * exp(old mx - m_new) is what the query's accumulator must be scaled by. */
static void HX(softmax_cols)(T *restrict st, int64_t ld, int64_t nk, int64_t ncols, const int32_t *restrict jlim,
                             T *restrict mx, T *restrict sum, T *restrict alpha) {
    for (int64_t i = 0; i < ncols; ++i) {
        T tile_max = -INFINITY;
        for (int64_t j = 0; j < jlim[i]; ++j)
            tile_max = st[j * ld + i] > tile_max ? st[j * ld + i] : tile_max;
        const T m_new = tile_max > mx[i] ? tile_max : mx[i];
        const T shift = m_new == -INFINITY ? 0 : m_new;
        alpha[i] = mx[i] == -INFINITY ? 0 : HX_EXP(mx[i] - m_new);
        T tile_sum = 0;
        for (int64_t j = 0; j < nk; ++j) {
            const T e = j < jlim[i] ? HX_EXP(st[j * ld + i] - shift) : 0;
            st[j * ld + i] = e;
            tile_sum += e;
        }
        sum[i] = sum[i] * alpha[i] + tile_sum;
        mx[i] = m_new;
    }
}

/* Backward row: s[j] = P = exp(s[j] - lse), ds[j] = P * (dP[j] - D) for j < jmax; 0 past jmax and
 * for a row that sees no key at all (lse = -inf). On entry ds holds dP. */
static void HX(bwd_row)(T *restrict s /* [BK] */, T *restrict ds /* [BK] */, int64_t jmax, T lse, T dd) {
    if (jmax <= 0 || lse == -INFINITY) {
        memset(s, 0, sizeof(T) * BK);
        memset(ds, 0, sizeof(T) * BK);
        return;
    }
    for (int64_t j = 0; j < jmax; ++j) {
        s[j] = HX_EXP(s[j] - lse);
        ds[j] = s[j] * (ds[j] - dd);
    }
    for (int64_t j = jmax; j < BK; ++j) {
        s[j] = 0;
        ds[j] = 0;
    }
}

/* hi[e] += (double)lo[e] for e < n (the backward's dK / dV fold). */
static void HX(fold)(double *restrict hi, const T *restrict lo, int64_t n) {
    for (int64_t e = 0; e < n; ++e)
        hi[e] += (double)lo[e];
}

/* The kernels a tile calls through; float picks a SIMD set at run time (see hx_simd_level). */
typedef struct {
    void (*gemm)(T *, int64_t, const T *, int64_t, int64_t, const T *, int64_t, int64_t, int64_t, int64_t, int,
                 const T *);
    void (*bwd_row)(T *, T *, int64_t, T, T);
    void (*softmax_cols)(T *, int64_t, int64_t, int64_t, const int32_t *, T *, T *, T *);
    void (*fold)(double *, const T *, int64_t);
} HX(ops);

static const HX(ops) *HX(get_ops)(void) {
    static const HX(ops) portable = {HX(gemm), HX(bwd_row), HX(softmax_cols), HX(fold)};
#if HX_USE_SIMD
    static const HX(ops) avx512 = {gemm_f32_avx512, bwd_row_f32_avx512, softmax_cols_f32_avx512, fold_f32_avx512};
    static const HX(ops) avx2 = {gemm_f32_avx2, bwd_row_f32_avx2, softmax_cols_f32_avx2, fold_f32_avx2};
    switch (hx_simd_level()) {
    case 2: return &avx512;
    case 1: return &avx2;
    default: break;
    }
#endif
    return &portable;
}

/* First row of a query tile at position qpos that sees any key of the key tile starting at k0. */
static inline int64_t HX(first_row)(const hexiseq_attn_params *p, int64_t qpos, int64_t k0) {
    return p->causal ? max64(0, p->k_pos0 + k0 - qpos) : 0;
}

/* Views of one query tile's forward scratch (fwd_tile_bytes): T working state, then the double folded state. */
typedef struct {
    T *qt;          /* [dp][QLD] scale * q, transposed, zero past nq */
    T *acc;         /* [BQ][ld] unnormalised o of the current piece, relative to mx */
    T *mx;          /* [BQ] running max of scores */
    T *sum;         /* [BQ] sum of exp(score - mx) over the current piece */
    T *alpha;       /* [BQ] rescale factor of the current key tile */
    double *acc_hi; /* [BQ][ld] unnormalised o of the folded pieces, relative to m_hi */
    double *sum_hi; /* [BQ] sum of exp(score - m_hi) over the folded pieces */
    double *m_hi;   /* [BQ] the max the folded pieces are relative to */
} HX(fwd_tile);

/* Tile t of a task of `group` tiles: working parts first, folded parts after all of them. */
static HX(fwd_tile) HX(fwd_tile_at)(char *tiles, int64_t t, int64_t group, int32_t dp) {
    const size_t tb = fwd_tile_bytes(dp, sizeof(T));
    HX(fwd_tile) f;
    f.qt = (T *)(void *)(tiles + tb * (size_t)t);
    f.acc = f.qt + (size_t)dp * QLD;
    f.mx = f.acc + (size_t)BQ * (size_t)dp;
    f.sum = f.mx + BQ;
    f.alpha = f.sum + BQ;
    f.acc_hi = (double *)(void *)(tiles + tb * (size_t)group + fwd_tile_hi_bytes(dp) * (size_t)t);
    f.sum_hi = f.acc_hi + (size_t)BQ * (size_t)dp;
    f.m_hi = f.sum_hi + BQ;
    return f;
}

/* Folds the piece (acc, sum, relative to mx) of rows [0, nq) into (acc_hi, sum_hi, relative to m_hi) in double
 * and restarts the piece at zero (mx is kept). A row whose max is still -inf has seen no finite score: its piece
 * holds nothing (the SIMD exp of -inf is a tiny non-zero, so it is cleared, not folded). */
static void HX(fold_piece)(HX(fwd_tile) f, int64_t nq, int32_t ld) {
    for (int64_t i = 0; i < nq; ++i) {
        T *restrict acc = f.acc + i * ld;
        double *restrict hi = f.acc_hi + i * ld;
        if (f.mx[i] == -INFINITY) {
            memset(acc, 0, sizeof(T) * (size_t)ld);
            f.sum[i] = 0;
            continue;
        }
        const double m = (double)f.mx[i];
        if (f.m_hi[i] == -INFINITY) { /* the first piece with a finite max: acc_hi is not initialised */
            for (int32_t c = 0; c < ld; ++c) {
                hi[c] = (double)acc[c];
                acc[c] = 0;
            }
            f.sum_hi[i] = (double)f.sum[i];
        } else {
            const double w = f.m_hi[i] == m ? 1.0 : exp(f.m_hi[i] - m);
            for (int32_t c = 0; c < ld; ++c) {
                hi[c] = hi[c] * w + (double)acc[c];
                acc[c] = 0;
            }
            f.sum_hi[i] = f.sum_hi[i] * w + (double)f.sum[i];
        }
        f.sum[i] = 0;
        f.m_hi[i] = m;
    }
}

/* Store dst[off + r*rs + c*cs] (+)= mul * src[r][c] for r < n, c < d, from double accumulators: computed in
 * double, rounded once (put_f64 rounds to half types without double rounding). */
static void HX(store_rows_f64)(void *dst, int32_t dtype, int64_t off, int64_t rs, int64_t cs, int64_t n, int32_t d,
                               const double *restrict src /* [n][dp] */, int32_t dp, double mul, int32_t accumulate) {
    for (int64_t r = 0; r < n; ++r) {
        const int64_t at = off + r * rs;
        const double *restrict row = src + r * dp;
        for (int32_t c = 0; c < d; ++c) {
            double x = mul * row[c];
            if (accumulate)
                x += get_f64(dst, dtype, at + c * cs);
            put_f64(dst, dtype, at + c * cs, x);
        }
    }
}

/* Forward for ntile query tiles (BQ rows each) from tile qt0 of (batch b, head h): online softmax over
 * key tiles, computed transposed: st = K (scale Q)^T is [keys][queries], so the softmax max/sum run down
 * columns (one SIMD lane per query) and Q^T is packed once per tile. The key loop is outside the tile
 * loop, so each K/V tile is packed once for all ntile query tiles; every query tile still does exactly
 * the arithmetic it would do alone, so results do not depend on ntile. The rescale of the accumulator
 * by alpha is folded into the P V gemm (rowscale).
 *
 * Accuracy over long key ranges: a running sum in T adds each key's term to a total that grows with the
 * number of keys, so its rounding error grows with it (in float, O and the row sum drift by per mille at 2^23
 * keys, and once the total passes 2^24 times a term, terms stop counting at all). The key range is therefore
 * cut into pieces of PIECE_TILES key tiles: within a piece the T accumulators run as above, at the end of each
 * piece they are folded into double accumulators by the log-sum-exp rule (fold_piece) and restarted, so no T
 * sum ever spans more than PIECE_TILES * BK keys, whatever seq_k is. The fold costs one pass over the
 * accumulator per PIECE_TILES key tiles. */
static void HX(fwd_tiles)(const hexiseq_attn_params *p, int64_t b, int32_t h, int64_t qt0, int64_t ntile,
                          T *scratch, int32_t dp) {
    const HX(ops) *ops = HX(get_ops)();
    const int32_t d = p->head_dim;
    const int32_t hk = h / (p->heads / p->kv_heads);
    const int32_t ld = dp;             /* row stride of ks, vs and acc */
    T *restrict ks = scratch;          /* [BK][ld] k */
    T *restrict vs = ks + BK * ld;     /* [BK][ld] v */
    T *restrict st = vs + BK * ld;     /* [BK][QLD] scores, then probabilities */
    char *tiles = (char *)(void *)(st + BK * QLD); /* per query tile: fwd_tile_bytes, see fwd_tile_at */
    int32_t jlim[BQ];

    const int64_t *qst = p->q_stride, *kst = p->k_stride, *vst = p->v_stride;
    int64_t kend_all = 0;
    for (int64_t t = 0; t < ntile; ++t) {
        const int64_t q0 = (qt0 + t) * BQ;
        const int64_t nq = min64(BQ, p->seq_q - q0);
        const HX(fwd_tile) f = HX(fwd_tile_at)(tiles, t, ntile, dp);
        HX(load_cols)(f.qt, QLD, p->q, p->dtype, b * qst[0] + q0 * qst[1] + h * qst[2], qst[1], qst[3], nq, d,
                      (T)p->scale);
        memset(f.acc, 0, sizeof(T) * (size_t)(nq * ld));
        for (int64_t i = 0; i < BQ; ++i) {
            f.mx[i] = -INFINITY;
            f.sum[i] = 0;
            f.sum_hi[i] = 0;
            f.m_hi[i] = -INFINITY; /* acc_hi is written by the first fold */
        }
        kend_all = max64(kend_all, visible_keys(p, p->q_pos0 + q0 + nq - 1));
    }
    for (int64_t k0 = 0; k0 < kend_all; k0 += BK) {
        const int64_t nk_all = min64(BK, kend_all - k0);
        /* the last tile of a piece that more keys follow (the final fold comes after the loop) */
        const int piece_end = (k0 / BK + 1) % PIECE_TILES == 0 && k0 + BK < kend_all;
        /* packed rows (ld dp): strided in-place rows of a [S, heads, d] tensor thrash L1 sets */
        HX(load_rows)(ks, p->k, p->dtype, b * kst[0] + k0 * kst[1] + hk * kst[2], kst[1], kst[3], nk_all, nk_all, d,
                      ld, 1);
        HX(load_rows)(vs, p->v, p->dtype, b * vst[0] + k0 * vst[1] + hk * vst[2], vst[1], vst[3], nk_all, nk_all, d,
                      ld, 1);
        for (int64_t t = 0; t < ntile; ++t) {
            const int64_t q0 = (qt0 + t) * BQ;
            const int64_t nq = min64(BQ, p->seq_q - q0);
            const int64_t qpos = p->q_pos0 + q0;
            const int64_t kend = visible_keys(p, qpos + nq - 1);
            if (k0 >= kend)
                continue;
            const int64_t nq16 = (nq + 15) / 16 * 16; /* SIMD kernels take whole groups of 16 queries */
            const HX(fwd_tile) f = HX(fwd_tile_at)(tiles, t, ntile, dp);
            const int64_t nk = min64(BK, kend - k0);
            /* queries before i0 see none of these keys (causal); the last one sees kmax of them */
            const int64_t i0 = HX(first_row)(p, qpos, k0);
            const int64_t c0 = i0 / 16 * 16;
            const int64_t kmax = min64(nk, visible_keys(p, qpos + nq - 1) - k0);
            for (int64_t i = c0; i < nq16; ++i)
                jlim[i] = i < nq ? (int32_t)max64(0, min64(nk, visible_keys(p, qpos + i) - k0)) : 0;
            ops->gemm(st + c0, QLD, ks, ld, 1, f.qt + c0, QLD, nk, nq16 - c0, d, 0, NULL);
            ops->softmax_cols(st + c0, QLD, nk, nq16 - c0, jlim + c0, f.mx + c0, f.sum + c0, f.alpha + c0);
            ops->gemm(f.acc + i0 * ld, ld, st + i0, 1, QLD, vs, ld, nq - i0, dp, kmax, 1, f.alpha + i0);
            if (piece_end)
                HX(fold_piece)(f, nq, ld);
        }
    }
    const int64_t *ost = p->o_stride, *lst = p->lse_stride;
    for (int64_t t = 0; t < ntile; ++t) {
        const int64_t q0 = (qt0 + t) * BQ;
        const int64_t nq = min64(BQ, p->seq_q - q0);
        const HX(fwd_tile) f = HX(fwd_tile_at)(tiles, t, ntile, dp);
        /* A block of at most one piece was never folded (piece_end needs more keys to follow): its T
         * accumulators are read directly (in double). */
        const int single_piece = kend_all <= (int64_t)PIECE_TILES * BK;
        if (!single_piece)
            HX(fold_piece)(f, nq, ld);
        for (int64_t i = 0; i < nq; ++i) {
            const int64_t lse_at = b * lst[0] + h * lst[1] + (q0 + i) * lst[2];
            const int64_t o_at = b * ost[0] + (q0 + i) * ost[1] + h * ost[2];
            const double m = single_piece ? (double)f.mx[i] : f.m_hi[i];
            const double sum = single_piece ? (double)f.sum[i] : f.sum_hi[i];
            /* A row that saw no key, or only scores of -inf, is fully masked: O = 0, LSE = -inf. Otherwise the
             * max term contributes exp(0) = 1, so sum >= 1. */
            if (m == -INFINITY || !(sum > 0)) {
                put_lse(p->lse, p->dtype, lse_at, -INFINITY);
                for (int32_t c = 0; c < d; ++c)
                    put_f64(p->o, p->dtype, o_at + c * ost[3], 0.0);
                continue;
            }
            const double inv = 1.0 / sum;
            put_lse(p->lse, p->dtype, lse_at, m + log(sum));
            const T *restrict lo = f.acc + i * ld;
            const double *restrict hi = f.acc_hi + i * ld;
            if (p->dtype == HEXISEQ_DTYPE_F32 && ost[3] == 1) {
                float *restrict out = (float *)p->o + o_at;
                for (int32_t c = 0; c < d; ++c)
                    out[c] = (float)((single_piece ? (double)lo[c] : hi[c]) * inv);
            } else {
                for (int32_t c = 0; c < d; ++c)
                    put_f64(p->o, p->dtype, o_at + c * ost[3], (single_piece ? (double)lo[c] : hi[c]) * inv);
            }
        }
    }
}

/* D for row r of [batch, heads, seq_q]: sum_c do[c] * o[c], in T. */
static void HX(delta_row)(const hexiseq_attn_params *p, int64_t r, T *delta /* [batch, heads, seq_q] */) {
    const int64_t b = r / ((int64_t)p->heads * p->seq_q);
    const int64_t h = r / p->seq_q % p->heads;
    const int64_t i = r % p->seq_q;
    const int64_t *ost = p->o_stride, *dst = p->do_stride;
    const int64_t o_at = b * ost[0] + i * ost[1] + h * ost[2];
    const int64_t do_at = b * dst[0] + i * dst[1] + h * dst[2];
    T acc = 0;
    for (int32_t c = 0; c < p->head_dim; ++c)
        acc += HX_GET(p->do_, p->dtype, do_at + c * dst[3]) * HX_GET(p->o, p->dtype, o_at + c * ost[3]);
    delta[r] = acc;
}

/* Loads the shared row data of a query tile: q (unscaled), do, lse, D. Rows whose lse is -inf are fully
 * masked everywhere; bwd_row gives them zero P and dS, and their q and do rows are loaded as zeros. */
static void HX(load_query_tile)(const hexiseq_attn_params *p, int64_t b, int32_t h, int64_t q0, int64_t nq,
                                const T *delta, T *restrict qs /* [BQ][dp] */, T *restrict dos /* [BQ][dp] */,
                                T *restrict lse /* [BQ] */, T *restrict dd /* [BQ] */, int32_t dp) {
    const int32_t d = p->head_dim;
    const int64_t *qst = p->q_stride, *dst = p->do_stride, *lst = p->lse_stride;
    HX(load_rows)(qs, p->q, p->dtype, b * qst[0] + q0 * qst[1] + h * qst[2], qst[1], qst[3], nq, nq, d, dp, 1);
    HX(load_rows)(dos, p->do_, p->dtype, b * dst[0] + q0 * dst[1] + h * dst[2], dst[1], dst[3], nq, nq, d, dp, 1);
    for (int64_t i = 0; i < nq; ++i) {
        lse[i] = (T)get_lse(p->lse, p->dtype, b * lst[0] + h * lst[1] + (q0 + i) * lst[2]);
        dd[i] = delta[(b * p->heads + h) * p->seq_q + q0 + i];
        if (lse[i] == -INFINITY) {
            /* its P and dS are 0, but 0 * inf is NaN: an infinite q or do entry (the usual cause of such a
             * row) must not reach dK or dV through the products */
            memset(qs + i * dp, 0, sizeof(T) * (size_t)dp);
            memset(dos + i * dp, 0, sizeof(T) * (size_t)dp);
        }
    }
}

/* One-pass backward for the key tiles kt0, kt0 + kstep, ... of (batch b, kv head hk), over every query
 * head sharing it. Per (query tile, key tile) pair, P and dS are computed once and feed three products:
 * dv_j += sum_i P_ij do_i, dk_j += scale * sum_i dS_ij q_i (the key tile's own accumulators, stored
 * when its query loop ends; the scale is applied to K^T for S and at the store for dK, so query tiles are
 * plain copies) and dq_i += sum_j dS_ij k_j, added into dqbuf [batch, heads, seq_q][dp],
 * a buffer this task owns for (b, hk's query heads). 5 GEMMs per pair. With dqhi (a double buffer of the same
 * shape, given when the task takes more than PIECE_TILES key tiles), dqbuf is folded into it every PIECE_TILES key
 * tiles, so no float sum of dq spans more keys than a forward piece. */
static void HX(bwd_kv_task)(const hexiseq_attn_params *p, int64_t b, int32_t hk, int64_t kt0, int64_t kstep,
                            const T *delta, T *dqbuf, double *dqhi, T *scratch, int32_t dp) {
    const HX(ops) *ops = HX(get_ops)();
    const int32_t d = p->head_dim;
    const int32_t group = p->heads / p->kv_heads;
    T *restrict qs = scratch;         /* [BQ][dp] q */
    T *restrict dos = qs + BQ * dp;   /* [BQ][dp] */
    T *restrict kt = dos + BQ * dp;   /* [dp][BK] scale * k, transposed */
    T *restrict vt = kt + dp * BK;    /* [dp][BK] */
    T *restrict ks = vt + dp * BK;    /* [BK][dp] */
    T *restrict dk = ks + BK * dp;    /* [BK][dp] dK of one query tile */
    T *restrict dv = dk + BK * dp;    /* [BK][dp] dV of one query tile */
    T *restrict s = dv + BK * dp;     /* [BQ][BK] scores, then P */
    T *restrict dpm = s + BQ * BK;    /* [BQ][BK] dP, then dS */
    T *restrict lse = dpm + BQ * BK;  /* [BQ] */
    T *restrict dd = lse + BQ;        /* [BQ] */
    double *restrict dk_hi = (double *)(void *)(dd + BQ); /* [BK][dp] dK of the key tile, all query tiles */
    double *restrict dv_hi = dk_hi + BK * dp;             /* [BK][dp] dV of the key tile */
    const int64_t *kst = p->k_stride, *vst = p->v_stride;
    const int64_t nkt = (p->seq_k + BK - 1) / BK;

    int64_t done = 0; /* key tiles this task has added into dqbuf since its last fold into dqhi */
    for (int64_t kti = kt0; kti < nkt; kti += kstep) {
        if (dqhi != NULL && done == PIECE_TILES) {
            /* dqbuf's float sums span at most PIECE_TILES key tiles: fold this task's rows into double */
            for (int32_t r = 0; r < group; ++r) {
                const size_t at = (size_t)(b * p->heads + hk * group + r) * (size_t)p->seq_q * (size_t)dp;
                ops->fold(dqhi + at, dqbuf + at, p->seq_q * (int64_t)dp);
                memset(dqbuf + at, 0, sizeof(T) * (size_t)p->seq_q * (size_t)dp);
            }
            done = 0;
        }
        ++done;
        const int64_t k0 = kti * BK;
        const int64_t nk = min64(BK, p->seq_k - k0);
        const int64_t k_at = b * kst[0] + k0 * kst[1] + hk * kst[2];
        HX(load_cols)(kt, BK, p->k, p->dtype, k_at, kst[1], kst[3], nk, d, (T)p->scale);
        HX(load_cols)(vt, BK, p->v, p->dtype, b * vst[0] + k0 * vst[1] + hk * vst[2], vst[1], vst[3], nk, d, 1);
        HX(load_rows)(ks, p->k, p->dtype, k_at, kst[1], kst[3], nk, nk, d, dp, 1);
        memset(dk_hi, 0, sizeof(double) * (size_t)(nk * dp));
        memset(dv_hi, 0, sizeof(double) * (size_t)(nk * dp));
        /* Under the causal mask only queries at positions >= k_pos0 + k0 see this tile. */
        const int64_t first_q = p->causal ? max64(0, p->k_pos0 + k0 - p->q_pos0) : 0;
        for (int32_t r = 0; r < group; ++r) {
            const int32_t h = hk * group + r;
            T *dqh = dqbuf + (b * p->heads + h) * p->seq_q * (int64_t)dp;
            for (int64_t q0 = first_q / BQ * BQ; q0 < p->seq_q; q0 += BQ) {
                const int64_t nq = min64(BQ, p->seq_q - q0);
                const int64_t qpos = p->q_pos0 + q0;
                const int64_t i0 = HX(first_row)(p, qpos, k0);
                if (i0 >= nq)
                    continue;
                const int64_t kmax = min64(nk, visible_keys(p, qpos + nq - 1) - k0);
                HX(load_query_tile)(p, b, h, q0, nq, delta, qs, dos, lse, dd, dp);
                ops->gemm(s + i0 * BK, BK, qs + i0 * dp, dp, 1, kt, BK, nq - i0, BK, d, 0, NULL);
                ops->gemm(dpm + i0 * BK, BK, dos + i0 * dp, dp, 1, vt, BK, nq - i0, BK, d, 0, NULL);
                for (int64_t i = i0; i < nq; ++i)
                    ops->bwd_row(s + i * BK, dpm + i * BK, min64(nk, visible_keys(p, qpos + i) - k0), lse[i], dd[i]);
                /* P and dS read transposed for dV and dK; this query tile's part, then added in double */
                ops->gemm(dv, dp, s + i0 * BK, 1, BK, dos + i0 * dp, dp, nk, dp, nq - i0, 0, NULL);
                ops->gemm(dk, dp, dpm + i0 * BK, 1, BK, qs + i0 * dp, dp, nk, dp, nq - i0, 0, NULL);
                ops->fold(dv_hi, dv, nk * dp);
                ops->fold(dk_hi, dk, nk * dp);
                ops->gemm(dqh + (q0 + i0) * dp, dp, dpm + i0 * BK, BK, 1, ks, dp, nq - i0, dp, kmax, 1, NULL);
            }
        }
        const int64_t *gk = p->dk_stride, *gv = p->dv_stride;
        HX(store_rows_f64)(p->dk, p->dtype, b * gk[0] + k0 * gk[1] + hk * gk[2], gk[1], gk[3], nk, d, dk_hi, dp,
                           p->scale, p->accumulate);
        HX(store_rows_f64)(p->dv, p->dtype, b * gv[0] + k0 * gv[1] + hk * gv[2], gv[1], gv[3], nk, d, dv_hi, dp, 1.0,
                           p->accumulate);
    }
}

/* dq row r of [batch, heads, seq_q] = scale * (sum over the nbuf buffers, in order, and over the nbuf folded double
 * buffers dqhi when there are any) (+ dq), in double, rounded once; 0 (+ dq) for a fully masked row (lse = -inf),
 * whose buffer rows may hold 0 * inf = NaN from an infinite k entry. */
static void HX(bwd_dq_row)(const hexiseq_attn_params *p, int64_t r, const T *dqbuf, const double *dqhi, int64_t nbuf,
                           size_t buf_elems, int32_t dp) {
    const int64_t b = r / ((int64_t)p->heads * p->seq_q);
    const int64_t h = r / p->seq_q % p->heads;
    const int64_t i = r % p->seq_q;
    double row[HEXISEQ_ATTN_MAX_HEAD_DIM];
    const int64_t *lst = p->lse_stride;
    if (get_lse(p->lse, p->dtype, b * lst[0] + h * lst[1] + i * lst[2]) == -INFINITY)
        nbuf = 0;
    for (int32_t c = 0; c < p->head_dim; ++c)
        row[c] = 0;
    for (int64_t u = 0; u < nbuf; ++u) {
        const size_t at = (size_t)u * buf_elems + (size_t)r * (size_t)dp;
        for (int32_t c = 0; c < p->head_dim; ++c)
            row[c] += (double)dqbuf[at + c] + (dqhi != NULL ? dqhi[at + c] : 0.0);
    }
    const int64_t *gst = p->dq_stride;
    HX(store_rows_f64)(p->dq, p->dtype, b * gst[0] + i * gst[1] + h * gst[2], 0, gst[3], 1, p->head_dim, row, dp,
                       p->scale, p->accumulate);
}

#undef T
#endif /* HEXISEQ_ATTN_T */
