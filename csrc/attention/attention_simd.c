/* x86-64 SIMD micro-kernels of the CPU attention for float (F32, F16, BF16 all compute in float): the AVX-512F
 * and AVX2 + FMA sets of the ops the tile code calls through (attention_simd.h), and the run-time choice of one.
 *
 * Built with per-function target attributes, so the file still compiles with plain -O3 (no -march)
 * and runs anywhere: hexiseq_attn_simd_ops_f32() picks AVX-512F, AVX2+FMA or none (the portable C kernels
 * of attention_tile.inc) at run time. Each set provides the ops of the typed kernels: gemm (register-blocked
 * micro-kernel, explicit FMA), softmax_cols (forward online softmax, one lane per query), bwd_row (P and dS
 * of a BK = 64 score row, vectorised exp, masked past jmax) and fold (float into double). */
#include "attention_simd.h"

#include <stddef.h>
#include <stdlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>

#define HX_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define HX_AVX2 __attribute__((target("avx2,fma")))
#define HX_INLINE static inline __attribute__((always_inline))

/* 2: AVX-512F, 1: AVX2 + FMA, 0: neither; HEXISEQ_ATTN_SIMD can only lower it. */
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

/* ---- AVX-512F ---- */

/* exp(x) for x <= 88 or NaN, no upper clamp (the forward's shifted scores are <= 0): range reduction by ln 2,
 * Cephes polynomial, Horner tail 1 + r (1 + r P(r)); relative error ~1e-7; -inf and x < -100 give ~0, NaN
 * stays NaN. */
HX_INLINE HX_AVX512 __m512 hx_exp512_neg(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-100.0f), x); /* max(c, NaN) = NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(HX_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(HX_EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(HX_EXP_LN2_LO), r);
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
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(HX_EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(HX_EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(HX_EXP_LN2_LO), r);
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

const attn_ops_f32 *hexiseq_attn_simd_ops_f32(void) {
    static const attn_ops_f32 avx512 = {gemm_f32_avx512, bwd_row_f32_avx512, softmax_cols_f32_avx512, fold_f32_avx512};
    static const attn_ops_f32 avx2 = {gemm_f32_avx2, bwd_row_f32_avx2, softmax_cols_f32_avx2, fold_f32_avx2};
    switch (hx_simd_level()) {
    case 2: return &avx512;
    case 1: return &avx2;
    default: return NULL;
    }
}

#else /* no x86-64 SIMD: the portable kernels everywhere */

const attn_ops_f32 *hexiseq_attn_simd_ops_f32(void) { return NULL; }

#endif /* x86-64 SIMD */
