/* Private to the CPU attention kernels: what the tile code (attention_cpu.c, attention_tile.inc) and the x86-64
 * SIMD micro-kernels (attention_simd.c) share. Not part of the library's interface. */
#ifndef HEXISEQ_ATTENTION_SIMD_H
#define HEXISEQ_ATTENTION_SIMD_H

#include <stdint.h>

/* Tile shape: BQ query rows and BK key rows per tile, head_dim padded to a multiple of DCHUNK. The backward's
 * row kernel (bwd_row) works on score rows of exactly BK elements, in every implementation. */
enum { BQ = 128, BK = 64, DCHUNK = 32 };

/* exp(x) in float, one recipe for the scalar path (hx_expf) and every SIMD width: n = round(x log2(e)), a
 * Cody-Waite reduction r = x - n ln2 with ln2 split in two (HX_EXP_LN2_HI exact in a few bits, so n * HI is
 * exact), then the Cephes polynomial exp(r) ~ 1 + r + r^2 P(r), P(r) = P0 r^5 + ... + P5 (Horner from P0);
 * relative error < 1e-7 for x in [-87, 88]. The forms differ in how they clamp x, group the last Horner steps
 * and build 2^n, so their results may differ in the last bit. */
#define HX_EXP_LOG2E 1.44269504088896341f
#define HX_EXP_LN2_HI 0.693359375f
#define HX_EXP_LN2_LO 2.12194440e-4f /* added: ln2 = HI - LO */
#define HX_EXP_P0 1.9875691500e-4f
#define HX_EXP_P1 1.3981999507e-3f
#define HX_EXP_P2 8.3334519073e-3f
#define HX_EXP_P3 4.1665795894e-2f
#define HX_EXP_P4 1.6666665459e-1f
#define HX_EXP_P5 5.0000001201e-1f

/* The kernels a tile calls through, for accumulator type T (see the portable versions in attention_tile.inc
 * for each contract): gemm C (+)= A B, bwd_row (P and dS of one score row), softmax_cols (forward online softmax
 * down the columns of a transposed score tile), fold (hi += (double)lo). */
#define HX_ATTN_OPS_STRUCT(T)                                                                                   \
    struct {                                                                                                    \
        void (*gemm)(T *, int64_t, const T *, int64_t, int64_t, const T *, int64_t, int64_t, int64_t, int64_t, \
                     int, const T *);                                                                           \
        void (*bwd_row)(T *, T *, int64_t, T, T);                                                               \
        void (*softmax_cols)(T *, int64_t, int64_t, int64_t, const int32_t *, T *, T *, T *);                   \
        void (*fold)(double *, const T *, int64_t);                                                             \
    }
typedef HX_ATTN_OPS_STRUCT(double) attn_ops_f64;
typedef HX_ATTN_OPS_STRUCT(float) attn_ops_f32;

/* The float SIMD set for this machine: AVX-512F, else AVX2 + FMA, capped by the environment variable
 * HEXISEQ_ATTN_SIMD=0|1|2 (so tests can cover each path); NULL when none applies (the portable kernels then).
 * The choice depends only on the machine and the environment, never on the thread count, so results stay
 * deterministic. */
const attn_ops_f32 *hexiseq_attn_simd_ops_f32(void);

#endif /* HEXISEQ_ATTENTION_SIMD_H */
