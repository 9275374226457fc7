/* Unit tests of the cost model, layouts, strategies and input validation, through the public C API.
 *
 * Every expected time and memory term below is computed by hand in this file from the formulas stated
 * in the comments of csrc/model/cost*.c and docs/cost_model.md (never by calling the library's helpers):
 *   gemm rate   = peak * gemm_eff * n / (n + 128)     (n = the device's token rows)
 *   attn rate   = peak * attn_eff * n / (n + 384)     (n = shorter side of the ring block, in tokens, halved
 *                                                      when causal: the kernel runs zigzag half-chunks)
 *   backward    = 2.0 forwards (matmuls), 2.5 forwards (attention); checkpointing adds one forward
 *   attention   = 4 * visible pairs * head_dim * h_r FLOPs forward
 *   all-to-all  = per exchange max(send, receive), peers serialised; per layer (qkv + o) * (1 + ckpt) + (o + qkv)
 *   ring step   = max(compute, transfer) + sync; backward moves K, V and dK, dV (the block just used; dK, dV
 *                 in fp32, so 4 / dtype_bytes times the bytes of K, V, in messages of their own)
 *   latency     = per message, one message per peer and exchange, serialised like the bytes; default 10 us
 *                 inside a node, 20 us between nodes; a ring step's sync = the largest latency received
 *   gradients   = rings over devices 0..N-1 (slowest link, largest latency), layer by layer; a per-layer
 *                 collective c hidden behind per-layer compute x exposes max(c, L c - (L - 1) x)
 *   curves      = measured TFLOP/s, linear in log(size) between points, clamped outside
 * Tolerance: relative 1e-12. Each expected value is a few dozen IEEE double operations done in a different
 * order than the library's, so the two can differ by a few ulps (~1e-15 relative); 1e-12 leaves three
 * orders of headroom while any real formula difference (a missing factor, an off-by-one token) shows up
 * at 1e-3 or more. Exact zeros are compared exactly. */
#include "hexiseq.h"
#include "internal.h" /* hexiseq_causal_pairs (internal) */

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define REL_TOL 1e-12

static int near(double got, double want) {
    if (want == 0.0)
        return got == 0.0;
    return isfinite(got) && fabs(got - want) <= REL_TOL * fabs(want);
}

#define NEAR(got, want, what)                                                                        \
    EXPECT(near((got), (want)), "%s: got %.17g, want %.17g (rel err %.3g)", (what), (double)(got), \
           (double)(want), (want) != 0 ? fabs(((got) - (want)) / (want)) : fabs(got))

/* A call must fail with `status` and leave a last-error text that contains `needle` (the field). */
#define EXPECT_ERR(call, status, needle)                                                                  \
    do {                                                                                                  \
        hexiseq_status st_ = (call);                                                                      \
        const char *msg_ = hexiseq_last_error();                                                          \
        EXPECT(st_ == (status) && msg_ && msg_[0] && strstr(msg_, (needle)) != NULL,                      \
               "%s: got status %d (%s) msg '%s', want status %d naming '%s'", #call, (int)st_,            \
               hexiseq_status_string(st_), msg_ ? msg_ : "(null)", (int)(status), (needle));              \
    } while (0)

#define EXPECT_OK(call)                                                                                 \
    do {                                                                                                \
        hexiseq_status st_ = (call);                                                                    \
        EXPECT(st_ == HEXISEQ_OK, "%s: got status %d (%s): %s", #call, (int)st_, hexiseq_status_string(st_), \
               hexiseq_last_error());                                                                   \
    } while (0)

static const double GIB = 1073741824.0;

/* The two rate curves, written out from cost_terms.h's comment "rate = peak * eff * n / (n + half)". */
static double gemm_rate(double peak_tflops, double eff, double rows) { return peak_tflops * 1e12 * eff * rows / (rows + 128.0); }
static double attn_rate(double peak_tflops, double eff, double n) { return peak_tflops * 1e12 * eff * n / (n + 384.0); }

/* Visible (query, key) pairs between two explicit position lists, by brute force. */
static double brute_pairs(const int64_t *q, int nq, const int64_t *k, int nk, int causal) {
    double n = 0;
    for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nk; ++j)
            if (!causal || k[j] <= q[i])
                n += 1;
    return n;
}

static hexiseq_node_desc node(const char *gpu, int32_t count, double intra, double mem, double peak, double ge,
                              double ae) {
    hexiseq_node_desc n = {gpu, count, intra, mem, peak, ge, ae, 0.0};
    return n;
}

/* Fill a layout from literal arrays. */
static void fill_layout(hexiseq_layout *l, const int32_t *gsize, const int64_t *gseq, const int32_t *dev,
                        const int64_t *tok, const int32_t *lo, const int32_t *cnt) {
    memcpy(l->group_size, gsize, (size_t)l->n_groups * sizeof *gsize);
    memcpy(l->group_seq, gseq, (size_t)l->n_groups * sizeof *gseq);
    memcpy(l->device, dev, (size_t)l->n_devices * sizeof *dev);
    memcpy(l->tokens, tok, (size_t)l->n_devices * sizeof *tok);
    memcpy(l->head_lo, lo, (size_t)l->n_devices * sizeof *lo);
    memcpy(l->head_count, cnt, (size_t)l->n_devices * sizeof *cnt);
}

/* The tiny model of the hand-computed cases: L=2, H=8, A=4, A_kv=2 (GQA, 2 query heads per kv head), d=2,
 * F=16, V=32, bf16, GELU MLP. */
static const hexiseq_model TINY = {2, 8, 4, 2, 2, 16, 32, 2, 0, 0, 0, 0, 0};
/* Named copies of its numbers for the arithmetic. */
static const double L = 2, H = 8, A = 4, Akv = 2, d = 2, F = 16, V = 32, b = 2;

/* Forward FLOPs per token of one layer's matmuls (2 per multiply-add): q and o projections H x A*d, k and v
 * projections H x A_kv*d, MLP 2 matrices H x F (GELU) -> 2 * (64 + 64 + 64 + 256) = 896. */
static double tiny_layer_fpt(void) {
    double q = A * d, kv = Akv * d;
    return 2.0 * (H * q + 2.0 * H * kv + q * H + 2.0 * H * F);
}
/* Forward FLOPs per token of the output head: 2 * H * V = 512. */
static double tiny_head_fpt(void) { return 2.0 * H * V; }
/* Parameters: per layer q, k, v, o, MLP, 2 norms = 64+32+32+64+256+16 = 464; whole model adds the embedding,
 * an untied output head (V x H each) and the final norm (H): 2*464 + 2*256 + 8 = 1448. */
static double tiny_layer_params(void) {
    double q = A * d, kv = Akv * d;
    return H * q + 2.0 * H * kv + q * H + 2.0 * H * F + 2.0 * H;
}
static double tiny_params(void) { return L * tiny_layer_params() + 2.0 * V * H + H; }

/* The memory-bound work, written out from cost_terms.h: per token and layer the forward reads and writes 4H (two
 * norms: read H, write H) + 6H (two residual adds: read 2H, write H) + 2 (A d + Akv d) (rotary on q and k) + 2F (the
 * activation; TINY's MLP is not gated) elements of b bytes, over 3 passes (the forward and a backward of two), one
 * more with recompute; per token the loss moves V logits of 2b + 8 bytes; the optimizer step 28 + b bytes per
 * parameter the device updates; all at 0.75 of the device's memory bandwidth (GB/s). */
static double tiny_mem_elems(void) { return 4.0 * H + 6.0 * H + 2.0 * (A * d + Akv * d) + 2.0 * F; }
static double mem_rate(double hbm_gbps) { return hbm_gbps * 1e9 * 0.75; }
static double mem_bound(double hbm_gbps, double tokens, double seqs, int ckpt, double opt_params) {
    return (seqs * tokens * (L * tiny_mem_elems() * b * (3.0 + ckpt) + V * (2.0 * b + 8.0)) + opt_params * (28.0 + b)) /
           mem_rate(hbm_gbps);
}
/* One layer's memory-bound forward, one sequence. */
static double mem_fwd(double hbm_gbps, double tokens) { return tokens * tiny_mem_elems() * b / mem_rate(hbm_gbps); }
/* The catalog's bandwidths of the parts these tests use (GB/s). */
static const double HBM_A100 = 2039.0, HBM_H100 = 3350.0;

/* The gradient and parameter collectives of one step, from cost_sync.c's comments. The ring over devices
 * 0..N-1 has slowest link bw (bytes/s) and largest latency lat (s). One reduce-scatter or all-gather of all
 * P parameters, run layer by layer, costs A = (N-1)/N * P * b / bw + L * (N-1) * lat, a = A / L per layer.
 * A per-layer collective c behind per-layer compute x (slowest device, one sequence) exposes
 * max(c, L c - (L-1) x). ZeRO-3 gathers in every sequence's forward (behind b_fwd) and backward (+1 with
 * checkpointing, behind b_bwd) and reduce-scatters in the last backward; ZeRO-2 reduce-scatters behind the
 * last backward and then gathers the parameters in the open; ZeRO-1 and DDP all-reduce (2 a per layer)
 * behind the last backward. */
static double pipelined(double c, double x) { return fmax(c, L * c - (L - 1.0) * x); }
static void grad_by_hand(int32_t sharding, double N, double bw, double lat, double seqs, double ckpt, double b_fwd,
                         double b_bwd, double *sync, double *exposed) {
    const double A = (N - 1.0) / N * tiny_params() * b / bw + L * (N - 1.0) * lat, a = A / L;
    if (sharding == HEXISEQ_SHARD_FULL) {
        *sync = seqs * (2.0 + ckpt) * A + A;
        *exposed = seqs * pipelined(a, b_fwd) + (seqs - 1.0) * pipelined((1.0 + ckpt) * a, b_bwd) +
                   pipelined((2.0 + ckpt) * a, b_bwd);
    } else if (sharding == HEXISEQ_SHARD_GRAD_OPT) {
        *sync = 2.0 * A;
        *exposed = pipelined(a, b_bwd) + A;
    } else {
        *sync = 2.0 * A;
        *exposed = pipelined(2.0 * a, b_bwd);
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* 1 device, 1 group: only token-parallel compute and attention; no communication at all. */

/* The one-device case: an A100-80G of peak 2 TFLOP/s (gemm_eff 0.5, attn_eff 0.25), 10 tokens and all 4 heads in one
 * group, one sequence, FULL sharding with 0.5 GiB reserved. */
static void one_device(hexiseq_cluster **c, hexiseq_training *t, hexiseq_layout *l) {
    hexiseq_node_desc nd = node("A100-80G", 1, 100.0, 10.0, 2.0, 0.5, 0.25);
    EXPECT_OK(hexiseq_cluster_create(1, &nd, 10.0, NULL, c));
    const hexiseq_training one = {1, 0, HEXISEQ_SHARD_FULL, 0.5, HEXISEQ_STATES_EVEN, NULL, 0};
    *t = one;
    EXPECT_OK(hexiseq_layout_alloc(1, 1, l));
    const int32_t gs[] = {1}, dv[] = {0}, lo[] = {0}, cnt[] = {4};
    const int64_t gq[] = {10}, tk[] = {10};
    fill_layout(l, gs, gq, dv, tk, lo, cnt);
}

static void test_one_device(void) {
    hexiseq_cluster *c = NULL;
    hexiseq_training t;
    hexiseq_layout l;
    one_device(&c, &t, &l);
    hexiseq_device_cost per[1];
    hexiseq_plan_cost pc;
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, per, &pc));
    EXPECT(hexiseq_last_error()[0] == '\0', "last error not cleared after success: '%s'", hexiseq_last_error());

    const double peak = 2.0, ge = 0.5, ae = 0.25, S = 10, s0 = 10;
    /* gemm: 3 passes (forward + backward of 2 forwards) for layers and the head */
    const double fpt = L * tiny_layer_fpt() * 3.0 + tiny_head_fpt() * 3.0;
    const double gemm_s = 1.0 * s0 * fpt / gemm_rate(peak, ge, s0);
    /* attention: one group, positions 0..9 (front [0,5), back [5,10)), all 4 heads, 55 causal pairs */
    const int64_t pos[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    const double pairs = brute_pairs(pos, 10, pos, 10, 1);
    EXPECT(pairs == 55.0, "brute pairs %g", pairs);
    /* causal: the front and back chunks touch, so the runtime joins them and the kernel sees one block of 10 */
    const double fwd = 4.0 * pairs * d * A / attn_rate(peak, ae, S);
    const double attn_s = (fwd * 1.0 + 2.5 * fwd) * L * 1.0; /* per layer fwd + bwd, times layers x sequences */
    /* lower bound: total FLOPs over the plateau rates */
    const double lb = S * fpt / (peak * 1e12 * ge) + L * 4.0 * (S * (S + 1) / 2) * d * A * 3.5 / (peak * 1e12 * ae);
    /* memory, FULL sharding over N=1: (2b + 12) * P + 3 gathered layers; Adam m, v and fp32 master = 12 bytes */
    const double P = tiny_params();
    EXPECT(P == 1448.0, "tiny params %g", P);
    const double gathered = fmax(tiny_layer_params(), V * H) * b; /* 464 * 2 */
    const double states = (2.0 * b + 12.0) * P / 1.0 + 3.0 * gathered;
    /* activations per token and layer: 4 norm in/out of H, attention output A*d, 2 MLP intermediates of F */
    const double act_layer = b * (4.0 * H + A * d + 2.0 * F);
    const double act = s0 * L * act_layer + s0 * V * (b + 8.0); /* + bf16 logits, their fp32 softmax and its gradient */
    /* attention working set: Q, O (4 heads) and K, V (2 kv heads) of 10 tokens, plus fp32 LSE; L layers + 1 */
    const double qkvo = S * (2.0 * 4 + 2.0 * 2) * d * b + S * 4 * 4.0;
    const double attn_mem = qkvo * (L + 1.0);
    double params = 0;
    EXPECT_OK(hexiseq_model_params(&TINY, &params));
    NEAR(params, P, "model params");

    /* the memory-bound work: all 10 tokens, one sequence, and the optimizer over every parameter (one device) */
    const double mem_s = mem_bound(HBM_A100, s0, 1.0, 0, P);
    NEAR(per[0].gemm_s, gemm_s, "1dev gemm_s");
    NEAR(per[0].mem_bound_s, mem_s, "1dev mem_bound_s");
    NEAR(per[0].layer_mem_bound_s, 3.0 * mem_fwd(HBM_A100, s0), "1dev layer_mem_bound_s");
    NEAR(per[0].attn_s, attn_s, "1dev attn_s");
    NEAR(per[0].a2a_s, 0.0, "1dev a2a_s");
    NEAR(per[0].ring_exposed_s, 0.0, "1dev ring_exposed_s");
    NEAR(per[0].busy_s, gemm_s + mem_s + attn_s, "1dev busy_s");
    NEAR(pc.step_time_s, gemm_s + mem_s + attn_s, "1dev step_time_s");
    NEAR(pc.grad_sync_s, 0.0, "1dev grad_sync_s (nothing to synchronise)");
    NEAR(pc.grad_exposed_s, 0.0, "1dev grad_exposed_s");
    NEAR(per[0].layer_gemm_s, s0 * tiny_layer_fpt() * 3.0 / gemm_rate(peak, ge, s0), "1dev layer_gemm_s");
    NEAR(pc.gemm_phase_s, gemm_s + mem_s, "1dev gemm_phase_s");
    NEAR(pc.a2a_phase_s, 0.0, "1dev a2a_phase_s");
    NEAR(pc.ring_phase_s, attn_s, "1dev ring_phase_s");
    NEAR(pc.lower_bound_s, lb + mem_s, "1dev lower_bound_s (one device: its memory-bound work is the bound's)");
    NEAR(pc.tokens_per_s, S / (gemm_s + mem_s + attn_s), "1dev tokens_per_s");
    NEAR(per[0].mem_states_gib, states / GIB, "1dev mem_states_gib");
    NEAR(per[0].mem_act_gib, act / GIB, "1dev mem_act_gib");
    NEAR(per[0].mem_attn_gib, attn_mem / GIB, "1dev mem_attn_gib");
    NEAR(per[0].mem_ring_gib, 0.0, "1dev mem_ring_gib");
    NEAR(per[0].mem_total_gib, (states + act + attn_mem) / GIB + 0.5, "1dev mem_total_gib");
    NEAR(per[0].mem_cap_gib, 10.0, "1dev mem_cap_gib");
    EXPECT(per[0].kv_lo == 0 && per[0].kv_count == 2, "1dev kv %d+%d", per[0].kv_lo, per[0].kv_count);
    EXPECT(pc.fits == 1 && pc.short_device == -1, "1dev fits %d short %d", pc.fits, pc.short_device);
    EXPECT(pc.gemm_bottleneck == 0 && pc.ring_bottleneck == 0 && pc.a2a_bottleneck == 0, "1dev bottlenecks");
    EXPECT(pc.step_time_s >= pc.lower_bound_s, "1dev step %g < bound %g", pc.step_time_s, pc.lower_bound_s);

    /* Non-causal: 100 pairs instead of 55, nothing else changes. */
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 0, &l, per, &pc));
    const double fwd_full = 4.0 * brute_pairs(pos, 10, pos, 10, 0) * d * A / attn_rate(peak, ae, S);
    NEAR(per[0].attn_s, 3.5 * fwd_full * L, "1dev non-causal attn_s");
    NEAR(pc.lower_bound_s,
         S * fpt / (peak * 1e12 * ge) + L * 4.0 * S * S * d * A * 3.5 / (peak * 1e12 * ae) + mem_s,
         "1dev non-causal lower_bound_s");

    /* Too little memory: a 1e-6 GiB device cannot hold it; the shortfall is total - cap. */
    hexiseq_cluster *small = NULL;
    hexiseq_node_desc nd_small = node("A100-80G", 1, 100.0, 1e-6, 2.0, 0.5, 0.25);
    EXPECT_OK(hexiseq_cluster_create(1, &nd_small, 10.0, NULL, &small));
    EXPECT_OK(hexiseq_evaluate(small, &TINY, &t, 10, 1, &l, per, &pc));
    EXPECT(pc.fits == 0 && pc.short_device == 0, "small device fits=%d short=%d", pc.fits, pc.short_device);
    NEAR(pc.short_gib, (states + act + attn_mem) / GIB + 0.5 - 1e-6, "short_gib");

    /* The other shardings on one device (N = 1), same layout. */
    const double opt = 12.0;
    const struct {
        int32_t sharding;
        double states;
        const char *what;
    } shard[] = {
        {HEXISEQ_SHARD_GRAD_OPT, b * P + (b + opt) * P / 1.0 + gathered, "GRAD_OPT states"}, /* params + one gathered bucket */
        {HEXISEQ_SHARD_OPT, 2.0 * b * P + opt * P / 1.0, "OPT states"},                     /* params + grads replicated */
        {HEXISEQ_SHARD_NONE, (2.0 * b + opt) * P, "NONE states"},                          /* everything replicated */
    };
    for (size_t i = 0; i < sizeof shard / sizeof shard[0]; ++i) {
        hexiseq_training ts = t;
        ts.sharding = shard[i].sharding;
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &ts, 10, 1, &l, per, &pc));
        NEAR(per[0].mem_states_gib, shard[i].states / GIB, shard[i].what);
    }
    /* fp32 model: no separate master copy, optimizer 8 bytes */
    hexiseq_model m32 = TINY;
    m32.dtype_bytes = 4;
    hexiseq_training tn = t;
    tn.sharding = HEXISEQ_SHARD_NONE;
    EXPECT_OK(hexiseq_evaluate(c, &m32, &tn, 10, 1, &l, per, &pc));
    NEAR(per[0].mem_states_gib, (2.0 * 4 + 8.0) * P / GIB, "fp32 NONE states");

    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
    hexiseq_cluster_destroy(small);
}

/* ------------------------------------------------------------------------------------------------ */
/* 2 devices (two single-device nodes, different speeds) joined by an asymmetric bandwidth matrix:
 * 0 -> 1 at 0.5 GB/s, 1 -> 0 at 2 GB/s. Scored as one group (Ulysses-like, unequal shares, GQA split of
 * a kv head) and as two groups (ring, unequal S_g). */

static void test_two_devices(void) {
    hexiseq_node_desc nd[2] = {node("A100-80G", 1, 100.0, 10.0, 2.0, 0.5, 0.25),
                               node("H100-SXM", 1, 100.0, 20.0, 4.0, 0.75, 0.5)};
    const double bwm[4] = {NAN /* diagonal ignored */, 0.5, 2.0, NAN};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(2, nd, 10.0, bwm, &c));
    double g01 = 0, g10 = 0;
    EXPECT_OK(hexiseq_cluster_bandwidth(c, 0, 1, &g01));
    EXPECT_OK(hexiseq_cluster_bandwidth(c, 1, 0, &g10));
    EXPECT(g01 == 0.5 && g10 == 2.0, "matrix bandwidths %g %g", g01, g10);
    const double bw01 = 0.5e9, bw10 = 2.0e9; /* bytes/s */
    const double lat = 20 * 1e-6; /* no latency matrix: the default between two nodes, per message */
    double lus = 0;
    EXPECT_OK(hexiseq_cluster_latency(c, 1, 0, &lus));
    EXPECT(lus == 20.0, "default latency between nodes %g us", lus);
    const double pk[2] = {2.0, 4.0}, ge[2] = {0.5, 0.75}, ae[2] = {0.25, 0.5};
    hexiseq_training t = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    const double S = 10, N = 2, P = tiny_params(), opt = 12.0;
    const double fpt = L * tiny_layer_fpt() * 3.0 + tiny_head_fpt() * 3.0;
    const double states = (2.0 * b + opt) * P / N + 3.0 * fmax(tiny_layer_params(), V * H) * b;
    const double act_layer = b * (4.0 * H + A * d + 2.0 * F);
    /* the memory-bound work: each device's tokens, the optimizer over its half of the parameters (FULL sharding,
     * even shares); in the bound, all of it over both devices' bandwidth */
    const double hbm[2] = {HBM_A100, HBM_H100};
    const double lb = S * fpt / (pk[0] * 1e12 * ge[0] + pk[1] * 1e12 * ge[1]) +
                      L * 4.0 * (S * (S + 1) / 2) * d * A * 3.5 / (pk[0] * 1e12 * ae[0] + pk[1] * 1e12 * ae[1]) +
                      mem_bound(hbm[0] + hbm[1], S, 1.0, 0, P);
    const int64_t all[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    hexiseq_device_cost per[2];
    hexiseq_plan_cost pc;

    /* ---- one group of both: tokens 7 | 3, heads [0,3) | [3,4) -> kv heads [0,2) | [1,2) (kv 1 shared) */
    {
        hexiseq_layout l;
        EXPECT_OK(hexiseq_layout_alloc(1, 2, &l));
        const int32_t gs[] = {2}, dv[] = {0, 1}, lo[] = {0, 3}, cnt[] = {3, 1};
        const int64_t gq[] = {10}, tk[] = {7, 3};
        fill_layout(&l, gs, gq, dv, tk, lo, cnt);
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, per, &pc));
        const double s[2] = {7, 3}, h[2] = {3, 1}, kv[2] = {2, 1};
        EXPECT(per[0].kv_lo == 0 && per[0].kv_count == 2 && per[1].kv_lo == 1 && per[1].kv_count == 1,
               "1 group kv ranges %d+%d %d+%d", per[0].kv_lo, per[0].kv_count, per[1].kv_lo, per[1].kv_count);
        const double elem = d * b; /* bytes per head and token */
        /* device 0: sends its 7 tokens' Q of device 1's head and K, V of its kv head; receives 3 tokens of its
         * 3 heads + 2 kv heads; O goes back the other way. Every exchange is one message to the one peer. */
        const double qkv_send0 = s[0] * (h[1] + 2 * kv[1]) * elem / bw01 + lat,
                     qkv_recv0 = s[1] * (h[0] + 2 * kv[0]) * elem / bw10 + lat;
        const double o_send0 = s[1] * h[0] * elem / bw01 + lat, o_recv0 = s[0] * h[1] * elem / bw10 + lat;
        const double qkv_send1 = s[1] * (h[0] + 2 * kv[0]) * elem / bw10 + lat,
                     qkv_recv1 = s[0] * (h[1] + 2 * kv[1]) * elem / bw01 + lat;
        const double o_send1 = s[0] * h[1] * elem / bw10 + lat, o_recv1 = s[1] * h[0] * elem / bw01 + lat;
        /* backward: dO goes the way O came; dQ with dK, dV of the first-held kv heads only (device 0 first-holds
         * both of its kv heads, device 1 none: kv head 1 is device 0's) */
        const double f[2] = {2, 0};
        const double do_send0 = s[0] * h[1] * elem / bw01 + lat, do_recv0 = s[1] * h[0] * elem / bw10 + lat;
        const double g_send0 = s[1] * (h[0] + 2 * f[0]) * elem / bw01 + lat,
                     g_recv0 = s[0] * (h[1] + 2 * f[1]) * elem / bw10 + lat;
        const double do_send1 = s[1] * h[0] * elem / bw10 + lat, do_recv1 = s[0] * h[1] * elem / bw01 + lat;
        const double g_send1 = s[0] * (h[1] + 2 * f[1]) * elem / bw10 + lat,
                     g_recv1 = s[1] * (h[0] + 2 * f[0]) * elem / bw01 + lat;
        /* per layer: forward (qkv + o) and backward (dO + grads), no checkpointing; times L layers, 1 sequence */
        const double a2a0 = (fmax(qkv_send0, qkv_recv0) + fmax(o_send0, o_recv0) + fmax(do_send0, do_recv0) +
                             fmax(g_send0, g_recv0)) * L;
        const double a2a1 = (fmax(qkv_send1, qkv_recv1) + fmax(o_send1, o_recv1) + fmax(do_send1, do_recv1) +
                             fmax(g_send1, g_recv1)) * L;
        const double group_a2a = fmax(a2a0, a2a1);
        double gemm[2], attn[2], mem_act[2], mem_attn[2], b_fwd = 0, b_bwd = 0;
        const double pairs = brute_pairs(all, 10, all, 10, 1);
        for (int r = 0; r < 2; ++r) {
            /* the token-parallel phase: matmuls and memory-bound work */
            gemm[r] = s[r] * fpt / gemm_rate(pk[r], ge[r], s[r]) + mem_bound(hbm[r], s[r], 1.0, 0, P / N);
            /* all 10 tokens, my heads; the only group's chunks touch, so the runtime joins them: one block of S */
            attn[r] = 3.5 * (4.0 * pairs * d * h[r] / attn_rate(pk[r], ae[r], S)) * L;
            /* one layer, one sequence: forward, and backward at 2 (matmuls) and 2.5 (attention) forwards */
            double gf = s[r] * tiny_layer_fpt() / gemm_rate(pk[r], ge[r], s[r]);
            double af = 4.0 * pairs * d * h[r] / attn_rate(pk[r], ae[r], S);
            double mf = mem_fwd(hbm[r], s[r]);
            b_fwd = fmax(b_fwd, gf + af + mf);
            b_bwd = fmax(b_bwd, 2.0 * gf + 2.5 * af + 2.0 * mf);
            NEAR(per[r].layer_gemm_s, 3.0 * gf, "1 group layer_gemm_s");
            mem_act[r] = s[r] * L * act_layer + s[r] * V * (b + 8.0);
            mem_attn[r] = (S * (2.0 * h[r] + 2.0 * kv[r]) * d * b + S * h[r] * 4.0) * (L + 1.0);
            NEAR(per[r].gemm_s + per[r].mem_bound_s, gemm[r], "1 group gemm_s + mem_bound_s");
            NEAR(per[r].attn_s, attn[r], "1 group attn_s");
            NEAR(per[r].ring_exposed_s, 0.0, "1 group ring_exposed_s");
            NEAR(per[r].busy_s, gemm[r] + group_a2a + attn[r], "1 group busy_s");
            NEAR(per[r].mem_states_gib, states / GIB, "1 group mem_states_gib");
            NEAR(per[r].mem_act_gib, mem_act[r] / GIB, "1 group mem_act_gib");
            NEAR(per[r].mem_attn_gib, mem_attn[r] / GIB, "1 group mem_attn_gib");
            NEAR(per[r].mem_ring_gib, 0.0, "1 group mem_ring_gib");
            NEAR(per[r].mem_total_gib, (states + mem_act[r] + mem_attn[r]) / GIB, "1 group mem_total_gib");
        }
        NEAR(per[0].a2a_s, a2a0, "1 group a2a_s dev0");
        NEAR(per[1].a2a_s, a2a1, "1 group a2a_s dev1");
        NEAR(pc.gemm_phase_s, fmax(gemm[0], gemm[1]), "1 group gemm_phase_s");
        NEAR(pc.a2a_phase_s, group_a2a, "1 group a2a_phase_s");
        NEAR(pc.ring_phase_s, fmax(attn[0], attn[1]), "1 group ring_phase_s");
        /* ZeRO-3 over the ring 0 -> 1 -> 0: slowest link 0.5 GB/s, 20 us; with this tiny model the per-layer
         * collective outlasts the per-layer compute (the L c - (L-1) x branch) */
        double gsync, gexp;
        grad_by_hand(HEXISEQ_SHARD_FULL, N, bw01, lat, 1, 0, b_fwd, b_bwd, &gsync, &gexp);
        EXPECT(gexp > (1.0 / N) * P * b / bw01, "1 group: the collectives are mostly exposed");
        NEAR(pc.grad_sync_s, gsync, "1 group grad_sync_s");
        NEAR(pc.grad_exposed_s, gexp, "1 group grad_exposed_s");
        NEAR(pc.step_time_s, fmax(gemm[0], gemm[1]) + group_a2a + fmax(attn[0], attn[1]) + gexp, "1 group step_time_s");
        NEAR(pc.lower_bound_s, lb, "1 group lower_bound_s");
        EXPECT(pc.gemm_bottleneck == (gemm[0] >= gemm[1] ? 0 : 1), "gemm bottleneck %d", pc.gemm_bottleneck);
        EXPECT(pc.ring_bottleneck == (attn[0] >= attn[1] ? 0 : 1), "ring bottleneck %d", pc.ring_bottleneck);
        EXPECT(pc.step_time_s >= pc.lower_bound_s, "1 group step below bound");
        hexiseq_layout_free(&l);
    }

    /* ---- two groups (ring in order 0 -> 1 -> 0): S_0 = 6 on device 0, S_1 = 4 on device 1, all heads each.
     * Zigzag: group 0 front [0,3) back [7,10); group 1 front [3,5) back [5,7). */
    {
        hexiseq_layout l;
        EXPECT_OK(hexiseq_layout_alloc(2, 2, &l));
        const int32_t gs[] = {1, 1}, dv[] = {0, 1}, lo[] = {0, 0}, cnt[] = {4, 4};
        const int64_t gq[] = {6, 4}, tk[] = {6, 4};
        fill_layout(&l, gs, gq, dv, tk, lo, cnt);
        hexiseq_group_span sp[2];
        EXPECT_OK(hexiseq_layout_spans(&l, sp));
        EXPECT(sp[0].front_start == 0 && sp[0].front_len == 3 && sp[0].back_start == 7 && sp[0].back_len == 3 &&
                   sp[1].front_start == 3 && sp[1].front_len == 2 && sp[1].back_start == 5 && sp[1].back_len == 2,
               "2-group spans");
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, per, &pc));
        const int64_t pos0[] = {0, 1, 2, 7, 8, 9}, pos1[] = {3, 4, 5, 6};
        const double Sg[2] = {6, 4};
        const double p00 = brute_pairs(pos0, 6, pos0, 6, 1), p01 = brute_pairs(pos0, 6, pos1, 4, 1);
        const double p11 = brute_pairs(pos1, 4, pos1, 4, 1), p10 = brute_pairs(pos1, 4, pos0, 6, 1);
        EXPECT(p00 + p01 + p11 + p10 == 55.0, "pairs add up to 55: %g", p00 + p01 + p11 + p10);
        /* Ring bytes per token of a block: K and V (2 x d x b) for each of the 2 kv heads. Device 0 receives
         * from 1 over 1->0 and sends to 1 over 0->1; the slower direction (0->1) sets both devices' pace.
         * Each direction is one message per step to or from the one peer, 20 us each; the backward sends
         * K, V and dK, dV as two messages. */
        const double kvb = 2.0 * d * b * 2;
        const double per_tok0 = fmax(kvb / bw10, kvb / bw01), per_tok1 = fmax(kvb / bw01, kvb / bw10);
        const double pt[2] = {per_tok0, per_tok1};
        double attn[2], exposed[2], b_fwd = 0, b_bwd = 0;
        for (int g = 0; g < 2; ++g) {
            int o = 1 - g;
            /* step 0: own block (pairs gg), next block (the other group's, S_o tokens) arrives meanwhile */
            double pairs0 = g == 0 ? p00 : p11, pairs1 = g == 0 ? p01 : p10;
            /* group 1's chunks [3,5) and [5,7) touch: the runtime joins them, one block of 4 tokens; group 0's
             * own block runs as half-chunks of 3 */
            double fwd0 = 4.0 * pairs0 * d * A / attn_rate(pk[g], ae[g], g == 1 ? Sg[g] : Sg[g] / 2);
            double comm0 = pt[g] * Sg[o] + lat;
            /* + fp32 dK, dV of the own block, a second message */
            double bwd0 = 2.5 * fwd0, bcomm0 = pt[g] * Sg[o] + pt[g] * Sg[g] * (4.0 / b) + 2.0 * lat;
            /* step 1 (last): the other group's block; nothing more arrives; its dK, dV go back home */
            double fwd1 = 4.0 * pairs1 * d * A / attn_rate(pk[g], ae[g], fmin(Sg[g], Sg[o]) / 2);
            double comm1 = 0.0;
            double bwd1 = 2.5 * fwd1, bcomm1 = pt[g] * Sg[o] * (4.0 / b) + lat;
            attn[g] = (fwd0 + bwd0 + fwd1 + bwd1) * L;
            /* sync: step 0 forward and both backward steps receive a message (20 us); step 1's forward does not */
            exposed[g] = (fmax(0, comm0 - fwd0) + lat + fmax(0, bcomm0 - bwd0) + lat + fmax(0, comm1 - fwd1) +
                          fmax(0, bcomm1 - bwd1) + lat) * L;
            double gf = Sg[g] * tiny_layer_fpt() / gemm_rate(pk[g], ge[g], Sg[g]), mf = mem_fwd(hbm[g], Sg[g]);
            b_fwd = fmax(b_fwd, gf + fwd0 + fwd1 + mf);
            b_bwd = fmax(b_bwd, 2.0 * gf + bwd0 + bwd1 + 2.0 * mf);
            double mem_attn = (Sg[g] * (2.0 * 4 + 2.0 * 2) * d * b + Sg[g] * 4 * 4.0) * (L + 1.0);
            double mem_ring = 2.0 * 6 /* largest block */ * 2.0 * 2 /* kv heads */ * d * (b + 4.0);
            double mem_act = Sg[g] * L * act_layer + Sg[g] * V * (b + 8.0);
            NEAR(per[g].gemm_s, Sg[g] * fpt / gemm_rate(pk[g], ge[g], Sg[g]), "ring gemm_s");
            NEAR(per[g].attn_s, attn[g], "ring attn_s");
            NEAR(per[g].ring_exposed_s, exposed[g], "ring ring_exposed_s");
            NEAR(per[g].a2a_s, 0.0, "ring a2a_s");
            NEAR(per[g].mem_attn_gib, mem_attn / GIB, "ring mem_attn_gib");
            NEAR(per[g].mem_ring_gib, mem_ring / GIB, "ring mem_ring_gib");
            NEAR(per[g].mem_total_gib, (states + mem_act + mem_attn + mem_ring) / GIB, "ring mem_total_gib");
        }
        EXPECT(exposed[0] > 0 && exposed[1] > 0, "slow links should expose ring time: %g %g", exposed[0], exposed[1]);
        NEAR(pc.ring_phase_s, fmax(attn[0] + exposed[0], attn[1] + exposed[1]), "ring ring_phase_s");
        double gsync, gexp;
        grad_by_hand(HEXISEQ_SHARD_FULL, N, bw01, lat, 1, 0, b_fwd, b_bwd, &gsync, &gexp);
        NEAR(pc.grad_sync_s, gsync, "ring grad_sync_s");
        NEAR(pc.grad_exposed_s, gexp, "ring grad_exposed_s");
        NEAR(pc.step_time_s,
             fmax(6 * fpt / gemm_rate(pk[0], ge[0], 6) + mem_bound(hbm[0], 6, 1.0, 0, P / N),
                  4 * fpt / gemm_rate(pk[1], ge[1], 4) + mem_bound(hbm[1], 4, 1.0, 0, P / N)) +
                 fmax(attn[0] + exposed[0], attn[1] + exposed[1]) + gexp,
             "ring step_time_s");
        NEAR(pc.lower_bound_s, lb, "ring lower_bound_s (layout-independent)");
        EXPECT(pc.step_time_s >= pc.lower_bound_s, "ring step below bound");

        /* Same layout on fast links (default node links, 1e4 GB/s between nodes) without latency: nothing
         * exposed. */
        hexiseq_node_desc fast[2] = {nd[0], nd[1]};
        hexiseq_cluster *cf = NULL;
        const double zero_lat[4] = {0, 0, 0, 0};
        const hexiseq_cluster_options no_lat = {NULL, zero_lat};
        EXPECT_OK(hexiseq_cluster_create_ex(2, fast, 1e4, NULL, &no_lat, &cf));
        EXPECT_OK(hexiseq_evaluate(cf, &TINY, &t, 10, 1, &l, per, &pc));
        NEAR(per[0].ring_exposed_s, 0.0, "fast ring exposed dev0");
        NEAR(per[1].ring_exposed_s, 0.0, "fast ring exposed dev1");
        NEAR(per[0].attn_s, attn[0], "fast ring attn_s unchanged");
        hexiseq_cluster_destroy(cf);
        hexiseq_layout_free(&l);
    }
    hexiseq_cluster_destroy(c);
}

/* ------------------------------------------------------------------------------------------------ */
/* 3 devices: group 0 = {dev0, dev1} (same node, 50 GB/s) with S_0 = 7, group 1 = {dev2} (other node, 5 GB/s
 * between nodes) with S_1 = 5. Checkpointing, 3 sequences, ZeRO-2 sharding, 1 GiB reserved. GQA sub-rings:
 * dev0 heads [0,3) -> kv [0,2), dev1 head 3 -> kv 1; dev2 all heads -> kv [0,2). */

static void test_three_devices(void) {
    hexiseq_node_desc nd[2] = {node("A100-80G", 2, 50.0, 10.0, 2.0, 0.5, 0.25),
                               node("H100-SXM", 1, 50.0, 20.0, 4.0, 0.75, 0.5)};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(2, nd, 5.0, NULL, &c));
    EXPECT(hexiseq_cluster_num_devices(c) == 3 && hexiseq_cluster_num_nodes(c) == 2, "3-device cluster sizes");
    hexiseq_training t = {3, 1, HEXISEQ_SHARD_GRAD_OPT, 1.0, HEXISEQ_STATES_EVEN, NULL, 0};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(2, 3, &l));
    const int32_t gs[] = {2, 1}, dv[] = {0, 1, 2}, lo[] = {0, 3, 0}, cnt[] = {3, 1, 4};
    const int64_t gq[] = {7, 5}, tk[] = {5, 2, 5};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    hexiseq_device_cost per[3];
    hexiseq_plan_cost pc;
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 12, 1, &l, per, &pc));

    const double intra = 50e9, inter = 5e9, seqs = 3, S = 12, N = 3, P = tiny_params(), opt = 12.0;
    const double pk[3] = {2, 2, 4}, ge[3] = {0.5, 0.5, 0.75}, ae[3] = {0.25, 0.25, 0.5};
    const double s[3] = {5, 2, 5}, h[3] = {3, 1, 4}, kv[3] = {2, 1, 2}, Sg[3] = {7, 7, 5};
    EXPECT(per[0].kv_lo == 0 && per[0].kv_count == 2 && per[1].kv_lo == 1 && per[1].kv_count == 1 &&
               per[2].kv_lo == 0 && per[2].kv_count == 2,
           "3dev kv ranges");
    /* gemm: layers run 4 passes (forward, backward = 2, recompute), the head 3; 3 sequences */
    const double fpt = L * tiny_layer_fpt() * 4.0 + tiny_head_fpt() * 3.0;
    /* memory-bound work: 3 sequences with recompute, the optimizer over a third of the parameters (ZeRO-2, even) */
    const double hbm[3] = {HBM_A100, HBM_A100, HBM_H100};
    double gemm[3], tp[3]; /* matmuls; the token-parallel phase with the memory-bound work */
    for (int r = 0; r < 3; ++r) {
        gemm[r] = seqs * s[r] * fpt / gemm_rate(pk[r], ge[r], s[r]);
        tp[r] = gemm[r] + mem_bound(hbm[r], s[r], seqs, 1, P / N);
        NEAR(per[r].gemm_s, gemm[r], "3dev gemm_s");
        NEAR(per[r].mem_bound_s, tp[r] - gemm[r], "3dev mem_bound_s");
    }
    /* all-to-all in group 0 over the 50 GB/s link, elem = d * b = 4 bytes; one message per exchange to the
     * one peer, 10 us inside a node (no latency matrix) */
    const double elem = d * b, lat_in = 10 * 1e-6, lat_x = 20 * 1e-6;
    const double qs0 = s[0] * (h[1] + 2 * kv[1]) * elem / intra + lat_in, qr0 = s[1] * (h[0] + 2 * kv[0]) * elem / intra + lat_in;
    const double os0 = s[1] * h[0] * elem / intra + lat_in, or0 = s[0] * h[1] * elem / intra + lat_in;
    const double qs1 = s[1] * (h[0] + 2 * kv[0]) * elem / intra + lat_in, qr1 = s[0] * (h[1] + 2 * kv[1]) * elem / intra + lat_in;
    const double os1 = s[0] * h[1] * elem / intra + lat_in, or1 = s[1] * h[0] * elem / intra + lat_in;
    /* backward: dO the output's way back; dQ with dK, dV of first-held kv heads only: device 0 first-holds kv
     * heads 0 and 1, device 1 (kv head 1, held by device 0 first) none */
    const double f[3] = {2, 0, 2};
    EXPECT(per[0].first_count == 2 && per[1].first_count == 0, "3dev first holders");
    const double ds0 = or0, dr0 = os0, ds1 = or1, dr1 = os1; /* one latency both ways here */
    const double gs0 = s[1] * (h[0] + 2 * f[0]) * elem / intra + lat_in, gr0 = s[0] * (h[1] + 2 * f[1]) * elem / intra + lat_in;
    const double gs1 = s[0] * (h[1] + 2 * f[1]) * elem / intra + lat_in, gr1 = s[1] * (h[0] + 2 * f[0]) * elem / intra + lat_in;
    /* per layer: forward exchanges twice (checkpointing recomputes them) + backward once */
    const double a2a0 = ((fmax(qs0, qr0) + fmax(os0, or0)) * 2.0 + fmax(ds0, dr0) + fmax(gs0, gr0)) * L * seqs;
    const double a2a1 = ((fmax(qs1, qr1) + fmax(os1, or1)) * 2.0 + fmax(ds1, dr1) + fmax(gs1, gr1)) * L * seqs;
    /* bytes of one layer, one sequence: forward Q/K/V and O; backward dO and the gradients */
    NEAR(per[0].a2a_grad_send_bytes, (s[0] * h[1] + s[1] * (h[0] + 2 * f[0])) * elem, "3dev backward bytes sent");
    NEAR(per[0].a2a_grad_recv_bytes, (s[1] * h[0] + s[0] * (h[1] + 2 * f[1])) * elem, "3dev backward bytes received");
    NEAR(per[1].a2a_grad_send_bytes, per[0].a2a_grad_recv_bytes, "3dev backward bytes: what 0 gets, 1 sends");
    NEAR(per[0].a2a_s, a2a0, "3dev a2a dev0");
    NEAR(per[1].a2a_s, a2a1, "3dev a2a dev1");
    NEAR(per[2].a2a_s, 0.0, "3dev a2a dev2 (alone in its group)");
    const double ga[3] = {fmax(a2a0, a2a1), fmax(a2a0, a2a1), 0.0};

    /* ring bytes per token: K and V of one kv head = 8 bytes; every ring message crosses nodes (20 us).
     * dev0 receives kv 0, 1 from dev2 (holder in group 1; one message) and sends kv 0, 1 to dev2 (dev0 is
     *   the first holder of both in group 0; one message).
     * dev1 receives kv 1 from dev2 (one message), sends nothing (dev0 holds kv 1 first).
     * dev2 receives kv 0, 1 from dev0 (one message); sends kv 0, 1 to dev0 and kv 1 to dev1 (two messages).
     * A step moving T tokens' worth in m messages per peer takes max(recv_pt T + recv_lat m, send_pt T +
     * send_lat m); every message received adds a 20 us sync to its step. */
    const double hb = 2.0 * d * b;
    const double recv_pt[3] = {2 * hb / inter, hb / inter, 2 * hb / inter}, send_pt[3] = {2 * hb / inter, 0.0, 3 * hb / inter};
    const double recv_lat[3] = {lat_x, lat_x, lat_x}, send_lat[3] = {lat_x, 0.0, 2 * lat_x};
    /* zigzag positions: group 0 front [0,4) back [9,12); group 1 front [4,7) back [7,9) */
    const int64_t pos0[] = {0, 1, 2, 3, 9, 10, 11}, pos1[] = {4, 5, 6, 7, 8};
    const double p[2][2] = {{brute_pairs(pos0, 7, pos0, 7, 1), brute_pairs(pos0, 7, pos1, 5, 1)},
                            {brute_pairs(pos1, 5, pos0, 7, 1), brute_pairs(pos1, 5, pos1, 5, 1)}};
    const double GS[2] = {7, 5};
    double attn[3], exposed[3], b_fwd = 0, b_bwd = 0;
    for (int r = 0; r < 3; ++r) {
        int g = r < 2 ? 0 : 1, o = 1 - g;
        /* step 0: own block, the other group's block arrives; step 1: the other block, last */
        /* group 1's chunks [4,7) and [7,9) touch: joined by the runtime, its own block one of 5 tokens */
        double fwd0 = 4.0 * p[g][g] * d * h[r] / attn_rate(pk[r], ae[r], g == 1 ? GS[g] : GS[g] / 2);
        double fwd1 = 4.0 * p[g][o] * d * h[r] / attn_rate(pk[r], ae[r], fmin(GS[g], GS[o]) / 2);
        double comm0 = fmax(recv_pt[r] * GS[o] + recv_lat[r], send_pt[r] * GS[o] + send_lat[r]), comm1 = 0.0;
        /* backward: K, V of the next block and fp32 dK, dV of this one, two messages; the last step only dK, dV */
        double t0 = GS[o] + GS[g] * (4.0 / b), t1 = GS[o] * (4.0 / b);
        double bcomm0 = fmax(recv_pt[r] * t0 + 2 * recv_lat[r], send_pt[r] * t0 + 2 * send_lat[r]);
        double bcomm1 = fmax(recv_pt[r] * t1 + recv_lat[r], send_pt[r] * t1 + send_lat[r]);
        /* forward runs twice with checkpointing (2 forward passes), backward 2.5 forwards */
        attn[r] = (fwd0 * 2.0 + 2.5 * fwd0 + fwd1 * 2.0 + 2.5 * fwd1) * L * seqs;
        /* syncs: step 0's two forward passes and both backward steps */
        exposed[r] = (2.0 * (fmax(0, comm0 - fwd0) + lat_x) + fmax(0, bcomm0 - 2.5 * fwd0) + lat_x +
                      2.0 * fmax(0, comm1 - fwd1) + fmax(0, bcomm1 - 2.5 * fwd1) + lat_x) * L * seqs;
        NEAR(per[r].attn_s, attn[r], "3dev attn_s");
        NEAR(per[r].ring_exposed_s, exposed[r], "3dev ring_exposed_s");
        NEAR(per[r].busy_s, tp[r] + ga[r] + attn[r] + exposed[r], "3dev busy_s");
        /* per layer and sequence: forward; backward 2 + 1 recompute (matmuls, memory-bound), 2.5 + 1 (attention) */
        double gf = s[r] * tiny_layer_fpt() / gemm_rate(pk[r], ge[r], s[r]), mf = mem_fwd(hbm[r], s[r]);
        b_fwd = fmax(b_fwd, gf + fwd0 + fwd1 + mf);
        b_bwd = fmax(b_bwd, 3.0 * gf + 3.5 * (fwd0 + fwd1) + 3.0 * mf);
        NEAR(per[r].layer_gemm_s, 3.0 * gf, "3dev layer_gemm_s (no recompute)");
    }
    /* memory: ZeRO-2 = replicated bf16 params + sharded grads and optimizer + one gathered bucket */
    const double gathered = fmax(tiny_layer_params(), V * H) * b;
    const double states = b * P + (b + opt) * P / N + gathered;
    const double act_layer = b * (4.0 * H + A * d + 2.0 * F);
    for (int r = 0; r < 3; ++r) {
        /* checkpointing: every layer's input (H) + one layer's full activations; logits as always */
        double act = s[r] * (L * H * b + act_layer) + s[r] * V * (b + 8.0);
        /* one layer's Q, K, V, O, LSE saved + its gradients */
        double mem_attn = (Sg[r] * (2.0 * h[r] + 2.0 * kv[r]) * d * b + Sg[r] * h[r] * 4.0) * 2.0;
        double mem_ring = 2.0 * 7 /* largest block */ * 2.0 * kv[r] * d * (b + 4.0);
        NEAR(per[r].mem_states_gib, states / GIB, "3dev mem_states_gib");
        NEAR(per[r].mem_act_gib, act / GIB, "3dev mem_act_gib");
        NEAR(per[r].mem_attn_gib, mem_attn / GIB, "3dev mem_attn_gib");
        NEAR(per[r].mem_ring_gib, mem_ring / GIB, "3dev mem_ring_gib");
        NEAR(per[r].mem_total_gib, (states + act + mem_attn + mem_ring) / GIB + 1.0, "3dev mem_total_gib");
    }
    NEAR(pc.gemm_phase_s, fmax(tp[0], fmax(tp[1], tp[2])), "3dev gemm_phase_s");
    NEAR(pc.a2a_phase_s, ga[0], "3dev a2a_phase_s");
    const double ring_phase = fmax(attn[0] + exposed[0], fmax(attn[1] + exposed[1], attn[2] + exposed[2]));
    NEAR(pc.ring_phase_s, ring_phase, "3dev ring_phase_s");
    /* ZeRO-2 over the ring 0 -> 1 -> 2 -> 0: slowest link 5 GB/s, largest latency 20 us */
    double gsync, gexp;
    grad_by_hand(HEXISEQ_SHARD_GRAD_OPT, N, inter, lat_x, seqs, 1, b_fwd, b_bwd, &gsync, &gexp);
    NEAR(pc.grad_sync_s, gsync, "3dev grad_sync_s");
    NEAR(pc.grad_exposed_s, gexp, "3dev grad_exposed_s");
    NEAR(pc.step_time_s, pc.gemm_phase_s + ga[0] + ring_phase + gexp, "3dev step_time_s");
    NEAR(pc.tokens_per_s, seqs * S / pc.step_time_s, "3dev tokens_per_s");
    const double gemm_flops = seqs * S * fpt, attn_flops = seqs * L * 4.0 * (S * (S + 1) / 2) * d * A * 4.5;
    const double lb = gemm_flops / ((2 * 2 * 0.5 + 4 * 0.75) * 1e12) + attn_flops / ((2 * 2 * 0.25 + 4 * 0.5) * 1e12) +
                      mem_bound(hbm[0] + hbm[1] + hbm[2], S, seqs, 1, P);
    NEAR(pc.lower_bound_s, lb, "3dev lower_bound_s");
    EXPECT(pc.step_time_s >= pc.lower_bound_s, "3dev step below bound");
    EXPECT(pc.a2a_bottleneck == (a2a0 >= a2a1 ? 0 : 1), "3dev a2a bottleneck %d", pc.a2a_bottleneck);
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

/* ------------------------------------------------------------------------------------------------ */
/* 4 devices, catalog rates (no overrides), a ring of 4 single-device groups with unequal blocks,
 * non-causal. Ring order 0 -> 1 -> 2 -> 3 -> 0: links 0->1 and 2->3 inside a node (100 GB/s), 1->2 and
 * 3->0 between nodes (10 GB/s). Then the strategies against uniform layouts written here. */

static void test_four_devices(void) {
    hexiseq_node_desc nd[2] = {node("H100", 2, 100.0, 0, 0, 0, 0), node("a100", 2, 100.0, 0, 0, 0, 0)};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(2, nd, 10.0, NULL, &c));
    hexiseq_gpu_spec h100, a100;
    EXPECT_OK(hexiseq_gpu_find("H100-SXM", &h100));
    EXPECT_OK(hexiseq_gpu_find("A100-80G", &a100));
    double pk[4], ge[4], ae[4], hbm[4];
    for (int r = 0; r < 4; ++r) {
        hexiseq_device_info di;
        const hexiseq_gpu_spec *sp = r < 2 ? &h100 : &a100;
        EXPECT_OK(hexiseq_cluster_device(c, r, &di));
        EXPECT(di.node == r / 2 && di.peak_tflops == sp->peak_tflops && di.gemm_eff == sp->gemm_eff &&
                   di.attn_eff == sp->attn_eff && di.memory_gib == sp->memory_gib,
               "device %d takes the catalog values of %s", r, sp->name);
        pk[r] = sp->peak_tflops;
        ge[r] = sp->gemm_eff;
        ae[r] = sp->attn_eff;
        hbm[r] = sp->hbm_gbps;
        NEAR(di.hbm_gbps, sp->hbm_gbps, "the catalog's memory bandwidth");
    }
    hexiseq_training t = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(4, 4, &l));
    const int32_t gs[] = {1, 1, 1, 1}, dv[] = {0, 1, 2, 3}, lo[] = {0, 0, 0, 0}, cnt[] = {4, 4, 4, 4};
    const int64_t gq[] = {3, 1, 2, 2}, tk[] = {3, 1, 2, 2};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    hexiseq_device_cost per[4];
    hexiseq_plan_cost pc;
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 8, 0, &l, per, &pc));
    const double Sg[4] = {3, 1, 2, 2};
    /* link into device g from its ring predecessor and out to its successor, bytes/s */
    const double in_bw[4] = {10e9, 100e9, 10e9, 100e9}, out_bw[4] = {100e9, 10e9, 100e9, 10e9};
    /* and the default latencies of those links: 20 us between nodes, 10 us inside one */
    const double in_lat[4] = {20e-6, 10e-6, 20e-6, 10e-6}, out_lat[4] = {10e-6, 20e-6, 10e-6, 20e-6};
    const double kvb = 2.0 * d * b * 2; /* K, V of both kv heads per token */
    const double fpt = L * tiny_layer_fpt() * 3.0 + tiny_head_fpt() * 3.0;
    double ring_phase = 0, gemm_phase = 0, b_fwd = 0, b_bwd = 0;
    for (int g = 0; g < 4; ++g) {
        double attn = 0, exposed = 0, fwd_sum = 0;
        for (int k = 0; k < 4; ++k) {
            int src = (g - k + 4) % 4, nxt = (g - k - 1 + 8) % 4;
            double pairs = Sg[g] * Sg[src]; /* non-causal: every query sees every key */
            double fwd = 4.0 * pairs * d * A / attn_rate(pk[g], ae[g], fmin(Sg[g], Sg[src])); /* non-causal: whole blocks */
            /* one message each way per step (two in the backward: K, V and dK, dV; one at the last step) */
            double t = k < 3 ? Sg[nxt] : 0.0, m = k < 3 ? 1.0 : 0.0;
            double comm = k < 3 ? fmax(kvb / in_bw[g] * t + in_lat[g], kvb / out_bw[g] * t + out_lat[g]) : 0.0;
            double bt = t + Sg[src] * (4.0 / b);
            double bcomm = fmax(kvb / in_bw[g] * bt + in_lat[g] * (m + 1), kvb / out_bw[g] * bt + out_lat[g] * (m + 1));
            attn += fwd + 2.5 * fwd;
            fwd_sum += fwd;
            /* syncs: the largest latency received, in every step that receives (the last forward step does not) */
            exposed += fmax(0, comm - fwd) + m * in_lat[g] + fmax(0, bcomm - 2.5 * fwd) + in_lat[g];
        }
        attn *= L;
        exposed *= L;
        double gemm = Sg[g] * fpt / gemm_rate(pk[g], ge[g], Sg[g]);
        double gf = Sg[g] * tiny_layer_fpt() / gemm_rate(pk[g], ge[g], Sg[g]), mf = mem_fwd(hbm[g], Sg[g]);
        /* the optimizer over a quarter of the parameters (ZeRO-3, even shares) */
        double mem = mem_bound(hbm[g], Sg[g], 1.0, 0, tiny_params() / 4);
        b_fwd = fmax(b_fwd, gf + fwd_sum + mf);
        b_bwd = fmax(b_bwd, 2.0 * gf + 2.5 * fwd_sum + 2.0 * mf);
        NEAR(per[g].attn_s, attn, "4dev attn_s");
        NEAR(per[g].ring_exposed_s, exposed, "4dev ring_exposed_s");
        NEAR(per[g].gemm_s, gemm, "4dev gemm_s");
        NEAR(per[g].mem_bound_s, mem, "4dev mem_bound_s");
        ring_phase = fmax(ring_phase, attn + exposed);
        gemm_phase = fmax(gemm_phase, gemm + mem);
    }
    /* ZeRO-3 over the ring 0 -> 1 -> 2 -> 3 -> 0: slowest link 10 GB/s, largest latency 20 us */
    double gsync, gexp;
    grad_by_hand(HEXISEQ_SHARD_FULL, 4, 10e9, 20e-6, 1, 0, b_fwd, b_bwd, &gsync, &gexp);
    NEAR(pc.grad_sync_s, gsync, "4dev grad_sync_s");
    NEAR(pc.grad_exposed_s, gexp, "4dev grad_exposed_s");
    NEAR(pc.step_time_s, gemm_phase + ring_phase + gexp, "4dev step_time_s");
    double gsum = 0, asum = 0;
    for (int r = 0; r < 4; ++r) {
        gsum += pk[r] * 1e12 * ge[r];
        asum += pk[r] * 1e12 * ae[r];
    }
    NEAR(pc.lower_bound_s,
         8 * fpt / gsum + L * 4.0 * 64 * d * A * 3.5 / asum + mem_bound(hbm[0] + hbm[1] + hbm[2] + hbm[3], 8, 1.0, 0,
                                                                        tiny_params()),
         "4dev lower_bound_s");
    hexiseq_layout_free(&l);

    /* Strategies: ring = 4 groups of 1, ulysses = 1 group of 4, usp = best of hp in {1, 2, 4}; each must
     * equal the uniform layout scored directly, S = 10 split 3,3,2,2 / 5,5 / 10 (larger shares first). */
    const int64_t S = 10;
    double step_of_hp[5] = {0};
    for (int hp = 1; hp <= 4; hp *= 2) {
        int cp = 4 / hp;
        hexiseq_layout u;
        EXPECT_OK(hexiseq_layout_alloc(cp, 4, &u));
        for (int g = 0; g < cp; ++g) {
            u.group_size[g] = hp;
            u.group_seq[g] = S / cp + (g < S % cp);
            for (int i = 0; i < hp; ++i) {
                int r = g * hp + i;
                u.device[r] = r;
                u.tokens[r] = u.group_seq[g] / hp + (i < u.group_seq[g] % hp);
                u.head_lo[r] = i * (4 / hp);
                u.head_count[r] = 4 / hp;
            }
        }
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, S, 1, &u, per, &pc));
        step_of_hp[hp] = pc.step_time_s;
        hexiseq_layout_free(&u);
    }
    const struct {
        hexiseq_strategy s;
        double want;
        int groups;
    } strat[] = {
        {HEXISEQ_STRATEGY_RING, step_of_hp[1], 4},
        {HEXISEQ_STRATEGY_ULYSSES, step_of_hp[4], 1},
        {HEXISEQ_STRATEGY_USP, fmin(step_of_hp[1], fmin(step_of_hp[2], step_of_hp[4])), -1},
    };
    for (size_t i = 0; i < 3; ++i) {
        hexiseq_layout out;
        EXPECT_OK(hexiseq_plan_strategy(c, &TINY, &t, S, 1, strat[i].s, &out, &pc));
        NEAR(pc.step_time_s, strat[i].want, hexiseq_strategy_name(strat[i].s));
        EXPECT(strat[i].groups < 0 || out.n_groups == strat[i].groups, "%s groups %d",
               hexiseq_strategy_name(strat[i].s), out.n_groups);
        hexiseq_layout_free(&out);
    }
    hexiseq_cluster_destroy(c);
}

/* ------------------------------------------------------------------------------------------------ */

static void test_causal_pairs(void) {
    /* every range pair in [0, 13)^4, including empty and reversed ones, before / after / overlapping */
    int bad = 0;
    for (int64_t q0 = 0; q0 < 13; ++q0)
        for (int64_t q1 = 0; q1 < 13; ++q1)
            for (int64_t k0 = 0; k0 < 13; ++k0)
                for (int64_t k1 = 0; k1 < 13; ++k1) {
                    int64_t want = 0;
                    for (int64_t q = q0; q < q1; ++q)
                        for (int64_t k = k0; k < k1; ++k)
                            want += k <= q;
                    int64_t got = hexiseq_causal_pairs(q0, q1, k0, k1);
                    if (got != want && bad++ < 5)
                        fprintf(stderr, "causal_pairs(%lld,%lld,%lld,%lld) = %lld, want %lld\n", (long long)q0,
                                (long long)q1, (long long)k0, (long long)k1, (long long)got, (long long)want);
                }
    EXPECT(bad == 0, "%d causal_pairs mismatches", bad);
    /* large offsets: keys entirely after queries see nothing, entirely before see everything */
    EXPECT(hexiseq_causal_pairs(0, 1000, 1000, 5000) == 0, "keys after queries");
    EXPECT(hexiseq_causal_pairs(5000, 6000, 0, 1000) == 1000 * 1000, "keys before queries");
    const int64_t S = (int64_t)1 << 30; /* HEXISEQ_MAX_SEQ_LEN: S(S+1)/2 must not overflow */
    EXPECT(hexiseq_causal_pairs(0, S, 0, S) == S / 2 * (S + 1), "full causal square at the max seq_len");
}

static void check_spans(const int64_t *seq, int32_t n) {
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(n, n, &l));
    int64_t S = 0;
    for (int32_t g = 0; g < n; ++g) {
        l.group_seq[g] = seq[g];
        S += seq[g];
    }
    hexiseq_group_span sp[16];
    EXPECT_OK(hexiseq_layout_spans(&l, sp));
    unsigned char *cover = calloc((size_t)S + 1, 1);
    int64_t front = 0, back_end = S;
    int ok = 1;
    for (int32_t g = 0; g < n; ++g) {
        /* front chunk gets the odd token: ceil(S_g / 2); back chunk floor(S_g / 2) */
        ok &= sp[g].front_start == front && sp[g].front_len == seq[g] - seq[g] / 2;
        ok &= sp[g].back_len == seq[g] / 2 && sp[g].back_start + sp[g].back_len == back_end;
        front += sp[g].front_len;
        back_end = sp[g].back_start;
        for (int64_t p = sp[g].front_start; p < sp[g].front_start + sp[g].front_len; ++p)
            ok &= p >= 0 && p < S && cover[p]++ == 0;
        for (int64_t p = sp[g].back_start; p < sp[g].back_start + sp[g].back_len; ++p)
            ok &= p >= 0 && p < S && cover[p]++ == 0;
    }
    for (int64_t p = 0; p < S; ++p)
        ok &= cover[p] == 1;
    EXPECT(ok, "spans of %d groups (first S_g %lld) do not tile [0, %lld) as zigzag", n, (long long)seq[0], (long long)S);
    free(cover);
    hexiseq_layout_free(&l);
}

static void test_spans(void) {
    const int64_t a[] = {7, 1, 4, 10, 3};
    check_spans(a, 5);
    const int64_t b2[] = {1};
    check_spans(b2, 1);
    const int64_t c3[] = {2, 2, 2};
    check_spans(c3, 3);
    const int64_t d4[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    check_spans(d4, 16);
    const int64_t e[] = {1000003, 17, 999, 2};
    check_spans(e, 4);
    const int64_t z[] = {5, 0, 3}; /* an empty group is representable: zero-length chunks */
    check_spans(z, 3);
}

/* A layout from plan_strategy must pass every structural rule and re-score to the same cost. */
static void check_valid_layout(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                               int64_t S, const hexiseq_layout *l, const hexiseq_plan_cost *pc, const char *what) {
    int32_t n = hexiseq_cluster_num_devices(c);
    int ok = l->n_devices == n && l->n_groups >= 1 && l->n_groups <= n;
    unsigned char seen[64] = {0};
    int64_t seq_sum = 0;
    int32_t r = 0, members = 0;
    for (int32_t g = 0; ok && g < l->n_groups; ++g) {
        members += l->group_size[g];
        seq_sum += l->group_seq[g];
        int64_t tok = 0;
        int32_t next = 0;
        for (int32_t i = 0; i < l->group_size[g] && r < n; ++i, ++r) {
            ok &= l->device[r] >= 0 && l->device[r] < n && !seen[l->device[r]];
            if (ok)
                seen[l->device[r]] = 1;
            ok &= l->head_lo[r] == next && l->head_count[r] >= 0 && l->tokens[r] >= 0;
            /* uniform shares: within one token of each other */
            ok &= l->tokens[r] * l->group_size[g] >= l->group_seq[g] - l->group_size[g] &&
                  l->tokens[r] * l->group_size[g] <= l->group_seq[g] + l->group_size[g];
            next += l->head_count[r];
            tok += l->tokens[r];
        }
        ok &= tok == l->group_seq[g] && next == m->heads;
    }
    ok &= members == n && seq_sum == S;
    EXPECT(ok, "%s: layout is not valid", what);
    hexiseq_device_cost per[64];
    hexiseq_plan_cost again;
    EXPECT_OK(hexiseq_evaluate(c, m, t, S, 1, l, per, &again));
    NEAR(again.step_time_s, pc->step_time_s, what);
}

static void test_strategies_odd_sizes(void) {
    /* 12 devices in three nodes of 4, 40 query heads over 8 kv heads, S = 1000003 (prime-ish, odd) */
    hexiseq_node_desc nd[3] = {node("H100-SXM", 4, 450, 0, 0, 0, 0), node("A100-80G", 4, 300, 0, 0, 0, 0),
                               node("L40S", 4, 64, 0, 0, 0, 0)};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(3, nd, 25.0, NULL, &c));
    hexiseq_model m = {2, 5120, 40, 8, 128, 13824, 8192, 2, 1, 0, 0, 0, 0};
    hexiseq_training t;
    hexiseq_training_default(&t);
    t.checkpointing = 1;
    const int64_t S = 1000003;
    hexiseq_layout out;
    hexiseq_plan_cost pc;
    EXPECT_OK(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_RING, &out, &pc));
    EXPECT(out.n_groups == 12, "ring groups %d", out.n_groups);
    check_valid_layout(c, &m, &t, S, &out, &pc, "ring 12 devices");
    hexiseq_layout_free(&out);
    EXPECT_OK(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_USP, &out, &pc));
    EXPECT(40 % out.group_size[0] == 0 && 12 % out.group_size[0] == 0, "usp group size %d", out.group_size[0]);
    check_valid_layout(c, &m, &t, S, &out, &pc, "usp 12 devices");
    hexiseq_layout_free(&out);
    /* 40 % 12 != 0: Ulysses cannot split the heads; the message names the heads */
    EXPECT_ERR(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_ULYSSES, &out, &pc), HEXISEQ_ERR_UNSUPPORTED,
               "heads");
    EXPECT(out.group_size == NULL && out.device == NULL, "failed plan leaves no allocation");
    hexiseq_cluster_destroy(c);

    /* 10 devices: 40 % 10 == 0, Ulysses works; 1000003 tokens split 100001 x 3 + 100000 x 7 */
    hexiseq_node_desc nd10[2] = {node("H100-SXM", 8, 450, 0, 0, 0, 0), node("A800", 2, 200, 0, 0, 0, 0)};
    EXPECT_OK(hexiseq_cluster_create(2, nd10, 25.0, NULL, &c));
    EXPECT_OK(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_ULYSSES, &out, &pc));
    EXPECT(out.n_groups == 1 && out.tokens[0] == 100001 && out.tokens[9] == 100000, "ulysses shares %lld..%lld",
           (long long)out.tokens[0], (long long)out.tokens[9]);
    check_valid_layout(c, &m, &t, S, &out, &pc, "ulysses 10 devices");
    hexiseq_layout_free(&out);
    /* fewer tokens than devices: no uniform split */
    EXPECT_ERR(hexiseq_plan_strategy(c, &m, &t, 7, 1, HEXISEQ_STRATEGY_RING, &out, &pc), HEXISEQ_ERR_UNSUPPORTED,
               "seq_len");
    /* a model that fits nowhere: MEMORY, with the least-short layout returned and the device named */
    hexiseq_model huge = {100, 16384, 128, 8, 128, 65536, 128256, 2, 1, 0, 0, 0, 0};
    hexiseq_status st = hexiseq_plan_strategy(c, &huge, &t, S, 1, HEXISEQ_STRATEGY_RING, &out, &pc);
    EXPECT(st == HEXISEQ_ERR_MEMORY && pc.fits == 0 && out.group_size != NULL && strstr(hexiseq_last_error(), "device") &&
               strstr(hexiseq_last_error(), "GiB"),
           "huge model: status %d '%s'", st, hexiseq_last_error());
    hexiseq_layout_free(&out);
    hexiseq_cluster_destroy(c);
}

/* Device names as CUDA reports them read as catalog models: the longer piece before the shorter one it contains,
 * any case; a name no piece is found in, or NULL, reads as no model. */
static void test_device_names(void) {
    static const struct {
        const char *device, *gpu;
    } cases[] = {{"NVIDIA H100 80GB HBM3", "H100-SXM"},   {"NVIDIA H100 PCIe", "H100-PCIe"},
                 {"nvidia h100 pcie", "H100-PCIe"},       {"NVIDIA H200", "H200"},
                 {"NVIDIA H800", "H800"},                 {"NVIDIA A100-SXM4-40GB", "A100-40G"},
                 {"NVIDIA A100-PCIE-40GB", "A100-40G"},   {"NVIDIA A100-SXM4-80GB", "A100-80G"},
                 {"NVIDIA A800-SXM4-80GB", "A800"},       {"NVIDIA L40S", "L40S"},
                 {"NVIDIA L40", "L40"},                   {"NVIDIA RTX A6000", "A6000"},
                 {"NVIDIA GeForce RTX 4090", "RTX4090"},  {"NVIDIA GeForce RTX 3090", "RTX3090"},
                 {"Tesla V100-SXM2-32GB", "V100"},        {"NVIDIA GeForce GTX 1080 Ti", NULL},
                 {"NVIDIA B200", NULL},                   {"", NULL},
                 {"H10", NULL}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        const char *gpu = hexiseq_gpu_from_device_name(cases[i].device);
        EXPECT(cases[i].gpu ? gpu && strcmp(gpu, cases[i].gpu) == 0 : gpu == NULL, "'%s' read as %s, expected %s",
               cases[i].device, gpu ? gpu : "none", cases[i].gpu ? cases[i].gpu : "none");
        hexiseq_gpu_spec spec;
        if (gpu)
            EXPECT_OK(hexiseq_gpu_find(gpu, &spec));
    }
    EXPECT(hexiseq_gpu_from_device_name(NULL) == NULL, "NULL reads as no model");
}

/* ------------------------------------------------------------------------------------------------ */
/* Garbage input: every pointer NULL, every size out of range, every number NaN / inf / negative. */

static void test_garbage_catalog_and_cluster(void) {
    hexiseq_gpu_spec spec;
    EXPECT(hexiseq_gpu_catalog_size() >= 23, "catalog size %d", hexiseq_gpu_catalog_size());
    EXPECT_ERR(hexiseq_gpu_catalog_get(0, NULL), HEXISEQ_ERR_NULL, "out");
    EXPECT_ERR(hexiseq_gpu_catalog_get(-1, &spec), HEXISEQ_ERR_INVALID, "index");
    EXPECT_ERR(hexiseq_gpu_catalog_get(hexiseq_gpu_catalog_size(), &spec), HEXISEQ_ERR_INVALID, "index");
    EXPECT_ERR(hexiseq_gpu_catalog_get(INT_MAX, &spec), HEXISEQ_ERR_INVALID, "index");
    EXPECT_ERR(hexiseq_gpu_find(NULL, &spec), HEXISEQ_ERR_NULL, "name");
    EXPECT_ERR(hexiseq_gpu_find("H100", NULL), HEXISEQ_ERR_NULL, "out");
    EXPECT_ERR(hexiseq_gpu_find("H999", &spec), HEXISEQ_ERR_UNKNOWN_GPU, "H999");
    EXPECT(strstr(hexiseq_last_error(), "H100-SXM") && strstr(hexiseq_last_error(), "V100"),
           "unknown GPU message lists the known models: '%s'", hexiseq_last_error());
    EXPECT_ERR(hexiseq_gpu_find("", &spec), HEXISEQ_ERR_UNKNOWN_GPU, "unknown GPU");
    EXPECT_ERR(hexiseq_gpu_find("H100-SXMX", &spec), HEXISEQ_ERR_UNKNOWN_GPU, "H100-SXMX");
    char longname[300];
    memset(longname, 'Z', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    EXPECT_ERR(hexiseq_gpu_find(longname, &spec), HEXISEQ_ERR_UNKNOWN_GPU, "ZZZZ");
    for (int i = 0; i < hexiseq_gpu_catalog_size(); ++i) {
        EXPECT_OK(hexiseq_gpu_catalog_get(i, &spec));
        EXPECT(spec.name && spec.source && spec.source[0] && spec.peak_tflops > 0 && spec.memory_gib > 0 &&
                   spec.hbm_gbps > 0 && spec.gemm_eff > 0 && spec.gemm_eff <= 1 && spec.attn_eff > 0 && spec.attn_eff <= 1,
               "catalog entry %d", i);
    }
    /* the parts of mixed fleets added later, by name and short name, with their dense bf16 peaks and memory */
    static const struct {
        const char *name, *canonical;
        double peak, memory_gib;
    } later[] = {{"H20", "H20", 148.0, 95.6},          {"h20-96g", "H20", 148.0, 95.6},
                 {"L20", "L20", 119.5, 45.0},          {"B200", "B200", 2250.0, 179.1},
                 {"B200-180G", "B200", 2250.0, 179.1}, {"gb200", "GB200", 2500.0, 185.1},
                 {"MI325X", "MI325X", 1307.4, 255.7}};
    for (size_t i = 0; i < sizeof later / sizeof later[0]; ++i) {
        EXPECT_OK(hexiseq_gpu_find(later[i].name, &spec));
        EXPECT(strcmp(spec.name, later[i].canonical) == 0 && spec.peak_tflops == later[i].peak &&
                   spec.memory_gib == later[i].memory_gib,
               "%s: %s, %g TFLOP/s, %g GiB", later[i].name, spec.name, spec.peak_tflops, spec.memory_gib);
    }

    hexiseq_cluster *c = (hexiseq_cluster *)(uintptr_t)1; /* must be overwritten with NULL on failure */
    hexiseq_node_desc ok = node("H100", 2, 450, 0, 0, 0, 0);
    EXPECT_ERR(hexiseq_cluster_create(1, NULL, 25, NULL, &c), HEXISEQ_ERR_NULL, "nodes");
    EXPECT_ERR(hexiseq_cluster_create(1, &ok, 25, NULL, NULL), HEXISEQ_ERR_NULL, "out");
    EXPECT_ERR(hexiseq_cluster_create(0, &ok, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes");
    EXPECT(c == NULL, "out set to NULL on failure");
    EXPECT_ERR(hexiseq_cluster_create(-1, &ok, 25, NULL, &c), HEXISEQ_ERR_INVALID, "-1");
    EXPECT_ERR(hexiseq_cluster_create(INT32_MAX, &ok, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes");
    const double bad_num[] = {0.0, -1.0, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < sizeof bad_num / sizeof bad_num[0]; ++i) {
        EXPECT_ERR(hexiseq_cluster_create(1, &ok, bad_num[i], NULL, &c), HEXISEQ_ERR_INVALID, "inter_node_gbps");
        hexiseq_node_desc n = ok;
        n.intra_gbps = bad_num[i];
        EXPECT_ERR(hexiseq_cluster_create(1, &n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[0].intra_gbps");
    }
    const double nonfinite[] = {NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < 3; ++i) {
        hexiseq_node_desc n[2] = {ok, ok};
        n[1].memory_gib = nonfinite[i];
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[1].memory_gib");
        n[1] = ok;
        n[1].peak_tflops = nonfinite[i];
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[1].peak_tflops");
        n[1] = ok;
        n[1].gemm_eff = nonfinite[i];
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[1].gemm_eff");
        n[1] = ok;
        n[1].attn_eff = nonfinite[i];
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[1].attn_eff");
    }
    {
        hexiseq_node_desc n = ok;
        n.gemm_eff = 1.5;
        EXPECT_ERR(hexiseq_cluster_create(1, &n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[0].gemm_eff");
        n = ok;
        n.attn_eff = 2.0;
        EXPECT_ERR(hexiseq_cluster_create(1, &n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[0].attn_eff");
    }
    const int32_t bad_count[] = {0, -1, -3, INT32_MIN, 65537, INT32_MAX};
    for (size_t i = 0; i < sizeof bad_count / sizeof bad_count[0]; ++i) {
        hexiseq_node_desc n[2] = {ok, ok};
        n[1].count = bad_count[i];
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "nodes[1].count");
    }
    {
        hexiseq_node_desc n[2] = {ok, ok};
        n[0].count = n[1].count = 40000; /* each valid, together over the device limit */
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_INVALID, "devices");
        n[0] = n[1] = ok;
        n[1].gpu = NULL;
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_NULL, "nodes[1].gpu");
        n[1].gpu = "B200-ish";
        EXPECT_ERR(hexiseq_cluster_create(2, n, 25, NULL, &c), HEXISEQ_ERR_UNKNOWN_GPU, "nodes[1].gpu");
        EXPECT(strstr(hexiseq_last_error(), "B200-ish") && strstr(hexiseq_last_error(), "A100-80G"),
               "unknown node GPU message: '%s'", hexiseq_last_error());
    }
    /* bandwidth matrix: any bad off-diagonal entry is named by its indices; the diagonal is ignored */
    for (size_t i = 0; i < sizeof bad_num / sizeof bad_num[0]; ++i) {
        double m4[4] = {1, 5, 5, 1};
        m4[2] = bad_num[i];
        EXPECT_ERR(hexiseq_cluster_create(1, &ok, 25, m4, &c), HEXISEQ_ERR_INVALID, "bandwidth_gbps[1][0]");
        double diag[4] = {bad_num[i], 5, 5, bad_num[i]};
        EXPECT_OK(hexiseq_cluster_create(1, &ok, 25, diag, &c));
        hexiseq_cluster_destroy(c);
        c = NULL;
    }

    /* queries on a valid cluster */
    EXPECT_OK(hexiseq_cluster_create(1, &ok, 25, NULL, &c));
    hexiseq_device_info di;
    double g;
    EXPECT_ERR(hexiseq_cluster_device(NULL, 0, &di), HEXISEQ_ERR_NULL, "cluster");
    EXPECT_ERR(hexiseq_cluster_device(c, 0, NULL), HEXISEQ_ERR_NULL, "out");
    EXPECT_ERR(hexiseq_cluster_device(c, -1, &di), HEXISEQ_ERR_INVALID, "device");
    EXPECT_ERR(hexiseq_cluster_device(c, 2, &di), HEXISEQ_ERR_INVALID, "device");
    EXPECT_ERR(hexiseq_cluster_device(c, INT32_MIN, &di), HEXISEQ_ERR_INVALID, "device");
    EXPECT_ERR(hexiseq_cluster_bandwidth(NULL, 0, 1, &g), HEXISEQ_ERR_NULL, "cluster");
    EXPECT_ERR(hexiseq_cluster_bandwidth(c, 0, 1, NULL), HEXISEQ_ERR_NULL, "gbps");
    EXPECT_ERR(hexiseq_cluster_bandwidth(c, 0, 0, &g), HEXISEQ_ERR_INVALID, "devices");
    EXPECT_ERR(hexiseq_cluster_bandwidth(c, -1, 1, &g), HEXISEQ_ERR_INVALID, "devices");
    EXPECT_ERR(hexiseq_cluster_bandwidth(c, 0, 2, &g), HEXISEQ_ERR_INVALID, "devices");
    EXPECT_OK(hexiseq_cluster_bandwidth(c, 1, 0, &g));
    EXPECT(g == 450.0, "intra-node bandwidth %g", g);
    EXPECT(hexiseq_cluster_num_devices(NULL) == 0 && hexiseq_cluster_num_nodes(NULL) == 0, "NULL cluster sizes");
    hexiseq_cluster_destroy(c);
    hexiseq_cluster_destroy(NULL);
}

static void test_garbage_model_layout(void) {
    double p;
    EXPECT_ERR(hexiseq_model_validate(NULL), HEXISEQ_ERR_NULL, "model");
    EXPECT_ERR(hexiseq_model_params(NULL, &p), HEXISEQ_ERR_NULL, "model");
    EXPECT_ERR(hexiseq_model_params(&TINY, NULL), HEXISEQ_ERR_NULL, "params");
    const char *names[] = {"layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "dtype_bytes"};
    const size_t offs[] = {offsetof(hexiseq_model, layers),   offsetof(hexiseq_model, hidden),
                           offsetof(hexiseq_model, heads),    offsetof(hexiseq_model, kv_heads),
                           offsetof(hexiseq_model, head_dim), offsetof(hexiseq_model, ffn),
                           offsetof(hexiseq_model, vocab),    offsetof(hexiseq_model, dtype_bytes)};
    const int32_t bad[] = {0, -1, INT32_MIN, INT32_MAX};
    for (int f = 0; f < 8; ++f)
        for (int i = 0; i < 4; ++i) {
            hexiseq_model m = TINY;
            int32_t *field = (int32_t *)((char *)&m + offs[f]);
            *field = bad[i];
            char want[32];
            snprintf(want, sizeof want, "model.%s", names[f]);
            /* heads = INT32_MAX fails the range check; kv_heads > heads is named by the divisibility rule */
            hexiseq_status st = hexiseq_model_validate(&m);
            EXPECT(st == HEXISEQ_ERR_INVALID && strstr(hexiseq_last_error(), want), "model.%s = %d: status %d '%s'",
                   names[f], bad[i], st, hexiseq_last_error());
        }
    hexiseq_model m = TINY;
    m.kv_heads = 3; /* 4 % 3 != 0 */
    EXPECT_ERR(hexiseq_model_validate(&m), HEXISEQ_ERR_INVALID, "kv_heads");
    m = TINY;
    m.gated_mlp = 2;
    EXPECT_ERR(hexiseq_model_validate(&m), HEXISEQ_ERR_INVALID, "gated_mlp");
    m.gated_mlp = -1;
    EXPECT_ERR(hexiseq_model_validate(&m), HEXISEQ_ERR_INVALID, "gated_mlp");
    hexiseq_training_default(NULL); /* must not crash */

    hexiseq_layout l;
    EXPECT_ERR(hexiseq_layout_alloc(1, 1, NULL), HEXISEQ_ERR_NULL, "out");
    EXPECT_ERR(hexiseq_layout_alloc(0, 1, &l), HEXISEQ_ERR_INVALID, "groups");
    EXPECT_ERR(hexiseq_layout_alloc(1, 0, &l), HEXISEQ_ERR_INVALID, "devices");
    EXPECT_ERR(hexiseq_layout_alloc(2, 1, &l), HEXISEQ_ERR_INVALID, "groups");
    EXPECT_ERR(hexiseq_layout_alloc(-1, -1, &l), HEXISEQ_ERR_INVALID, "groups");
    EXPECT_ERR(hexiseq_layout_alloc(1, INT32_MAX, &l), HEXISEQ_ERR_INVALID, "devices");
    EXPECT(l.group_size == NULL && l.device == NULL, "failed alloc leaves a zeroed layout");
    hexiseq_layout_free(NULL);
    hexiseq_layout_free(&l); /* zeroed: freeing again is harmless */
    hexiseq_group_span sp[2];
    EXPECT_OK(hexiseq_layout_alloc(2, 2, &l));
    EXPECT_ERR(hexiseq_layout_spans(NULL, sp), HEXISEQ_ERR_NULL, "layout");
    EXPECT_ERR(hexiseq_layout_spans(&l, NULL), HEXISEQ_ERR_NULL, "spans");
    l.group_seq[1] = -5;
    EXPECT_ERR(hexiseq_layout_spans(&l, sp), HEXISEQ_ERR_LAYOUT, "group_seq[1]");
    hexiseq_layout_free(&l);
    hexiseq_layout_free(&l);

    EXPECT(strcmp(hexiseq_strategy_name(HEXISEQ_STRATEGY_RING), "ring") == 0 &&
               strcmp(hexiseq_strategy_name(HEXISEQ_STRATEGY_ULYSSES), "ulysses") == 0 &&
               strcmp(hexiseq_strategy_name(HEXISEQ_STRATEGY_USP), "usp") == 0 &&
               strcmp(hexiseq_strategy_name((hexiseq_strategy)-1), "unknown") == 0 &&
               strcmp(hexiseq_strategy_name((hexiseq_strategy)99), "unknown") == 0,
           "strategy names");
    for (int s = -1; s <= 11; ++s)
        EXPECT(hexiseq_status_string((hexiseq_status)s) && hexiseq_status_string((hexiseq_status)s)[0],
               "status string of %d", s);
}

/* A valid 4-device setup (2 nodes of 2) and a valid 2-group layout to break one field at a time. */
typedef struct {
    hexiseq_cluster *c;
    hexiseq_model m;
    hexiseq_training t;
    hexiseq_layout l;
    hexiseq_device_cost per[4];
    hexiseq_plan_cost pc;
} fixture;

static void fixture_reset(fixture *f) {
    const int32_t gs[] = {2, 2}, dv[] = {0, 1, 2, 3}, lo[] = {0, 3, 0, 2}, cnt[] = {3, 1, 2, 2};
    const int64_t gq[] = {60, 40}, tk[] = {30, 30, 25, 15};
    f->l.n_groups = 2;
    f->l.n_devices = 4;
    fill_layout(&f->l, gs, gq, dv, tk, lo, cnt);
    f->m = TINY;
    hexiseq_training_default(&f->t);
}

#define EVAL(f, S, causal) hexiseq_evaluate((f)->c, &(f)->m, &(f)->t, (S), (causal), &(f)->l, (f)->per, &(f)->pc)

static void test_garbage_evaluate(void) {
    fixture f;
    hexiseq_node_desc nd[2] = {node("H100", 2, 450, 0, 0, 0, 0), node("A100", 2, 300, 0, 0, 0, 0)};
    EXPECT_OK(hexiseq_cluster_create(2, nd, 25, NULL, &f.c));
    EXPECT_OK(hexiseq_layout_alloc(2, 4, &f.l));
    fixture_reset(&f);
    EXPECT_OK(EVAL(&f, 100, 1));

    /* NULL for every pointer argument */
    EXPECT_ERR(hexiseq_evaluate(NULL, &f.m, &f.t, 100, 1, &f.l, f.per, &f.pc), HEXISEQ_ERR_NULL, "cluster");
    EXPECT_ERR(hexiseq_evaluate(f.c, NULL, &f.t, 100, 1, &f.l, f.per, &f.pc), HEXISEQ_ERR_NULL, "model");
    EXPECT_ERR(hexiseq_evaluate(f.c, &f.m, NULL, 100, 1, &f.l, f.per, &f.pc), HEXISEQ_ERR_NULL, "training");
    EXPECT_ERR(hexiseq_evaluate(f.c, &f.m, &f.t, 100, 1, NULL, f.per, &f.pc), HEXISEQ_ERR_NULL, "layout");
    EXPECT_ERR(hexiseq_evaluate(f.c, &f.m, &f.t, 100, 1, &f.l, NULL, &f.pc), HEXISEQ_ERR_NULL, "per_device");
    EXPECT_ERR(hexiseq_evaluate(f.c, &f.m, &f.t, 100, 1, &f.l, f.per, NULL), HEXISEQ_ERR_NULL, "out");
    {
        int32_t *saved = f.l.head_count;
        f.l.head_count = NULL;
        EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_NULL, "layout arrays");
        f.l.head_count = saved;
        int64_t *saved_seq = f.l.group_seq;
        f.l.group_seq = NULL;
        EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_NULL, "layout arrays");
        f.l.group_seq = saved_seq;
    }
    /* seq_len and causal out of range */
    const int64_t bad_seq[] = {0, -1, INT64_MIN, INT64_MAX, ((int64_t)1 << 30) + 1};
    for (size_t i = 0; i < sizeof bad_seq / sizeof bad_seq[0]; ++i)
        EXPECT_ERR(EVAL(&f, bad_seq[i], 1), HEXISEQ_ERR_INVALID, "seq_len");
    EXPECT_ERR(EVAL(&f, 100, 2), HEXISEQ_ERR_INVALID, "causal");
    EXPECT_ERR(EVAL(&f, 100, -1), HEXISEQ_ERR_INVALID, "causal");
    /* training */
    f.t.sequences = 0;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_INVALID, "training.sequences");
    f.t.sequences = -7;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_INVALID, "training.sequences");
    fixture_reset(&f);
    f.t.checkpointing = 2;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_INVALID, "training.checkpointing");
    fixture_reset(&f);
    f.t.sharding = 4;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_INVALID, "training.sharding");
    f.t.sharding = -1;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_INVALID, "training.sharding");
    const double bad_res[] = {NAN, INFINITY, -INFINITY, -1.0};
    for (size_t i = 0; i < 4; ++i) {
        fixture_reset(&f);
        f.t.reserved_gib = bad_res[i];
        EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_INVALID, "training.reserved_gib");
    }
    fixture_reset(&f);
    f.m.kv_heads = 3;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_INVALID, "kv_heads");

    /* layouts */
    fixture_reset(&f);
    f.l.n_devices = 3;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "devices");
    fixture_reset(&f);
    f.l.n_groups = 0;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups");
    fixture_reset(&f);
    f.l.n_groups = -2;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups");
    fixture_reset(&f);
    f.l.group_size[1] = 0;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups[1]");
    fixture_reset(&f);
    f.l.group_size[0] = -2;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups[0]");
    fixture_reset(&f);
    f.l.group_size[0] = 3; /* 3 + 2 = 5 devices listed for 4 */
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "group sizes");
    fixture_reset(&f);
    f.l.group_size[0] = INT32_MAX;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "group sizes");
    fixture_reset(&f);
    f.l.group_seq[1] = 0;
    EXPECT_ERR(EVAL(&f, 60, 1), HEXISEQ_ERR_LAYOUT, "groups[1].seq");
    fixture_reset(&f);
    f.l.group_seq[0] = -60;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups[0].seq");
    fixture_reset(&f);
    EXPECT_ERR(EVAL(&f, 101, 1), HEXISEQ_ERR_LAYOUT, "seq_len=101"); /* group sequences add to 100 */
    fixture_reset(&f);
    f.l.device[3] = 0; /* device 0 twice, device 3 missing */
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "device 0 appears twice");
    fixture_reset(&f);
    f.l.device[2] = 4;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "device 4");
    fixture_reset(&f);
    f.l.device[2] = -1;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "device -1");
    fixture_reset(&f);
    f.l.device[0] = INT32_MIN;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups[0] lists device");
    fixture_reset(&f);
    f.l.tokens[3] = 16; /* group 1 tokens 25 + 16 != 40 */
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "token shares of groups[1]");
    fixture_reset(&f);
    f.l.tokens[0] = -30;
    f.l.tokens[1] = 90;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "tokens of device 0");
    fixture_reset(&f);
    f.l.head_lo[1] = 2; /* device 1 overlaps device 0's heads [0,3) */
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "head ranges in groups[0]");
    fixture_reset(&f);
    f.l.head_lo[0] = 1; /* head 0 uncovered */
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "head ranges in groups[0]");
    fixture_reset(&f);
    f.l.head_count[2] = -2;
    f.l.head_lo[3] = -2;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "head_count of device 2");
    fixture_reset(&f);
    f.l.head_count[3] = 3; /* 2 + 3 > 4 heads */
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "exceed");
    fixture_reset(&f);
    f.l.head_count[3] = 1; /* 2 + 1 < 4 heads */
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "head counts of groups[1]");
    fixture_reset(&f);
    EXPECT_OK(EVAL(&f, 100, 1));
    EXPECT(hexiseq_last_error()[0] == '\0', "error text cleared by a successful call");

    /* plan_strategy */
    hexiseq_layout out;
    EXPECT_ERR(hexiseq_plan_strategy(NULL, &f.m, &f.t, 100, 1, HEXISEQ_STRATEGY_RING, &out, &f.pc), HEXISEQ_ERR_NULL, "cluster");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, NULL, &f.t, 100, 1, HEXISEQ_STRATEGY_RING, &out, &f.pc), HEXISEQ_ERR_NULL, "model");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, NULL, 100, 1, HEXISEQ_STRATEGY_RING, &out, &f.pc), HEXISEQ_ERR_NULL, "training");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &f.t, 100, 1, HEXISEQ_STRATEGY_RING, NULL, &f.pc), HEXISEQ_ERR_NULL, "out");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &f.t, 100, 1, HEXISEQ_STRATEGY_RING, &out, NULL), HEXISEQ_ERR_NULL, "cost");
    for (size_t i = 0; i < sizeof bad_seq / sizeof bad_seq[0]; ++i)
        EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &f.t, bad_seq[i], 1, HEXISEQ_STRATEGY_RING, &out, &f.pc),
                   HEXISEQ_ERR_INVALID, "seq_len");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &f.t, 100, 1, (hexiseq_strategy)-1, &out, &f.pc), HEXISEQ_ERR_INVALID, "strategy");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &f.t, 100, 1, HEXISEQ_STRATEGY_COUNT, &out, &f.pc), HEXISEQ_ERR_INVALID, "strategy");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &f.t, 100, 2, HEXISEQ_STRATEGY_RING, &out, &f.pc), HEXISEQ_ERR_INVALID, "causal");
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &f.t, 3, 1, HEXISEQ_STRATEGY_USP, &out, &f.pc), HEXISEQ_ERR_UNSUPPORTED, "seq_len");
    hexiseq_training bt = f.t;
    bt.reserved_gib = NAN;
    EXPECT_ERR(hexiseq_plan_strategy(f.c, &f.m, &bt, 100, 1, HEXISEQ_STRATEGY_RING, &out, &f.pc), HEXISEQ_ERR_INVALID,
               "reserved_gib");

    hexiseq_layout_free(&f.l);
    hexiseq_cluster_destroy(f.c);
}

/* Sums of huge but individually in-range values must be reported as layout errors, not overflow
 * (signed overflow is undefined behaviour: the sanitize build aborts on it). Kept last in main. */
static void test_garbage_overflow(void) {
    fixture f;
    hexiseq_node_desc nd[2] = {node("H100", 2, 450, 0, 0, 0, 0), node("A100", 2, 300, 0, 0, 0, 0)};
    EXPECT_OK(hexiseq_cluster_create(2, nd, 25, NULL, &f.c));
    EXPECT_OK(hexiseq_layout_alloc(2, 4, &f.l));

    fixture_reset(&f);
    f.l.group_seq[0] = INT64_MAX; /* group sequence sum overflows int64 */
    f.l.group_seq[1] = INT64_MAX;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "seq");

    fixture_reset(&f);
    f.l.tokens[0] = INT64_MAX; /* token share sum of group 0 overflows int64 */
    f.l.tokens[1] = INT64_MAX;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups[0]");

    fixture_reset(&f);
    f.l.head_count[0] = 1; /* head range end 1 + INT32_MAX overflows int32 */
    f.l.head_lo[1] = 1;
    f.l.head_count[1] = INT32_MAX;
    EXPECT_ERR(EVAL(&f, 100, 1), HEXISEQ_ERR_LAYOUT, "groups[0]");

    hexiseq_group_span sp[2];
    fixture_reset(&f);
    f.l.group_seq[0] = INT64_MAX; /* spans: total overflows int64 */
    f.l.group_seq[1] = 2;
    EXPECT_ERR(hexiseq_layout_spans(&f.l, sp), HEXISEQ_ERR_LAYOUT, "group_seq");

    hexiseq_layout_free(&f.l);
    hexiseq_cluster_destroy(f.c);
}

/* ------------------------------------------------------------------------------------------------ */
/* Measured rate curves. Curves (size -> TFLOP/s), read linearly in log(size) between points and clamped
 * outside:  gemm {10: 1, 40: 3},  attn {1: 0.25, 4: 0.5, 16: 1.5},  attn_causal {1: 0.125, 4: 0.25, 16: 0.75}. */

static hexiseq_rate_curve curve2(double s0, double t0, double s1, double t1) {
    hexiseq_rate_curve c;
    memset(&c, 0, sizeof c);
    c.n = 2;
    c.size[0] = s0, c.tflops[0] = t0, c.size[1] = s1, c.tflops[1] = t1;
    return c;
}
static hexiseq_rate_curve curve3(double s0, double t0, double s1, double t1, double s2, double t2) {
    hexiseq_rate_curve c = curve2(s0, t0, s1, t1);
    c.n = 3;
    c.size[2] = s2, c.tflops[2] = t2;
    return c;
}
/* y at x on the straight line through (x0, y0), (x1, y1) in log(x) */
static double lerp_log(double x, double x0, double y0, double x1, double y1) {
    return y0 + (y1 - y0) * log(x / x0) / log(x1 / x0);
}
/* A runtime curve of two points (elements, ns per element) read as total ns at x: x y0 up to x0, x y1 from x1, and
 * between them the time linear in the elements, from x0 y0 to x1 y1. */
static double runtime_total(double x, double x0, double y0, double x1, double y1) {
    if (x <= x0)
        return x * y0;
    if (x >= x1)
        return x * y1;
    return x0 * y0 + (x - x0) * (x1 * y1 - x0 * y0) / (x1 - x0);
}
/* A one-group, one-device layout of S tokens and all 4 heads. */
static void one_device_layout(hexiseq_layout *l, int64_t S) {
    l->group_size[0] = 1, l->group_seq[0] = S, l->device[0] = 0, l->tokens[0] = S, l->head_lo[0] = 0,
    l->head_count[0] = 4;
}

static void test_curves(void) {
    hexiseq_node_desc nd = node("A100-80G", 1, 100.0, 10.0, 2.0, 0.5, 0.25);
    hexiseq_device_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.memory_gib = 7.0; /* replaces the node's 10 GiB */
    dd.gemm = curve2(10, 1.0, 40, 3.0);
    dd.attn = curve3(1, 0.25, 4, 0.5, 16, 1.5);
    dd.attn_causal = curve3(1, 0.125, 4, 0.25, 16, 0.75);
    const hexiseq_cluster_options opt = {&dd, NULL};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &opt, &c));
    hexiseq_device_info di;
    EXPECT_OK(hexiseq_cluster_device(c, 0, &di));
    EXPECT(di.gemm_curve.n == 2 && di.attn_curve.n == 3 && di.attn_causal_curve.n == 3 && di.attn_curve.size[2] == 16 &&
               di.memory_gib == 7.0 && di.gpu_index >= 0 && strcmp(di.gpu_name, "A100-80G") == 0,
           "device info carries the curves and the device's memory");
    hexiseq_training t = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    const double fpt = L * tiny_layer_fpt() * 3.0 + tiny_head_fpt() * 3.0;
    hexiseq_device_cost per[2];
    hexiseq_plan_cost pc;
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(1, 1, &l));

    /* non-causal: the matmuls run at gemm(S), the one S x S block at attn(S) */
    const struct {
        int64_t S;
        double gemm_tflops, attn_tflops;
        const char *what;
    } pts[] = {
        {4, 1.0, 0.5, "below the gemm curve (clamped), on an inner attn point"},
        {10, 1.0, lerp_log(10, 4, 0.5, 16, 1.5), "on the first gemm point, between attn points"},
        {16, lerp_log(16, 10, 1.0, 40, 3.0), 1.5, "between gemm points (log, not linear), on the last attn point"},
        {20, 2.0, 1.5, "halfway in log(size) between 10 and 40; attn clamped above"},
        {80, 3.0, 1.5, "above both curves (clamped)"},
    };
    for (size_t i = 0; i < sizeof pts / sizeof pts[0]; ++i) {
        double S = (double)pts[i].S;
        one_device_layout(&l, pts[i].S);
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, pts[i].S, 0, &l, per, &pc));
        NEAR(per[0].gemm_s, S * fpt / (pts[i].gemm_tflops * 1e12), pts[i].what);
        NEAR(per[0].layer_gemm_s, S * tiny_layer_fpt() * 3.0 / (pts[i].gemm_tflops * 1e12), pts[i].what);
        NEAR(per[0].attn_s, 3.5 * 4.0 * S * S * d * A * L / (pts[i].attn_tflops * 1e12), pts[i].what);
        /* lower bound: the curves' largest rates, and the memory-bound work at the catalog's bandwidth */
        NEAR(pc.lower_bound_s,
             S * fpt / 3e12 + L * 4.0 * S * S * d * A * 3.5 / 1.5e12 + mem_bound(HBM_A100, S, 1.0, 0, tiny_params()),
             "curve lower bound");
        NEAR(per[0].mem_cap_gib, 7.0, "device memory from the device description");
    }
    EXPECT(lerp_log(16, 10, 1.0, 40, 3.0) > 1.6, "log interpolation differs from linear (1.4) at 16");

    /* causal, one group: front chunk [0, fl), back chunk [fl, S) touch, so the runtime joins them: one causal
     * diagonal block of S tokens, its S (S+1)/2 pairs at the causal curve at S (above its last point, 16:
     * clamped to 0.75 TFLOP/s). Ring groups whose chunks do not touch split theirs (the 2-group ring below). */
    const int64_t sizes[] = {12, 20, 21};
    for (int i = 0; i < 3; ++i) {
        double S = (double)sizes[i];
        double t_causal = S * (S + 1) / 2 / ((S > 16 ? 0.75 : lerp_log(S, 4, 0.25, 16, 0.75)) * 1e12);
        one_device_layout(&l, sizes[i]);
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, sizes[i], 1, &l, per, &pc));
        NEAR(per[0].attn_s, 3.5 * 4.0 * d * A * t_causal * L, "causal diagonal at the causal curve");
        NEAR(pc.lower_bound_s,
             S * fpt / 3e12 + L * 4.0 * (S * (S + 1) / 2) * d * A * 3.5 / 1.5e12 +
                 mem_bound(HBM_A100, S, 1.0, 0, tiny_params()),
             "causal lower bound");
    }
    hexiseq_cluster_destroy(c);

    /* No causal curve: the diagonal falls back to the attn curve at the block's length (20: clamped, 1.5). */
    dd.attn_causal.n = 0;
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &opt, &c));
    one_device_layout(&l, 20);
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 20, 1, &l, per, &pc));
    NEAR(per[0].attn_s, 3.5 * 4.0 * d * A * 210.0 / 1.5e12 * L, "diagonal at the attn curve");
    hexiseq_cluster_destroy(c);

    /* Only a causal curve: the one joined diagonal block at it (20: clamped, 0.75); the catalog formula (peak 2,
     * attn_eff 0.25) would price full blocks, of which one group has none. The
     * attention plateau is the larger of peak * attn_eff (0.5) and the causal curve's best (0.75) when causal,
     * peak * attn_eff without a mask. The gemm curve stays (plateau 3 TFLOP/s). */
    dd.attn.n = 0;
    dd.attn_causal = curve3(1, 0.125, 4, 0.25, 16, 0.75);
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &opt, &c));
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 20, 1, &l, per, &pc));
    double t_mixed = 210.0 / 0.75e12;
    NEAR(per[0].attn_s, 3.5 * 4.0 * d * A * t_mixed * L, "causal curve + catalog formula");

    const double mem20 = mem_bound(HBM_A100, 20, 1.0, 0, tiny_params());
    NEAR(pc.lower_bound_s, 20 * fpt / 3e12 + L * 4.0 * 210.0 * d * A * 3.5 / 0.75e12 + mem20, "mixed causal lower bound");
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 20, 0, &l, per, &pc));
    NEAR(per[0].attn_s, 3.5 * 4.0 * d * A * 400.0 / attn_rate(2.0, 0.25, 20) * L, "non-causal ignores the causal curve");
    NEAR(pc.lower_bound_s, 20 * fpt / 3e12 + L * 4.0 * 400.0 * d * A * 3.5 / 0.5e12 + mem20, "non-causal lower bound");
    hexiseq_cluster_destroy(c);
    /* a measured memory-bound rate (GB/s of the bytes the model counts) replaces bandwidth x 0.75 */
    dd.mem_bound_gbps = 5.0;
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &opt, &c));
    EXPECT_OK(hexiseq_cluster_device(c, 0, &di));
    EXPECT(di.mem_bound_gbps == 5.0 && di.hbm_gbps == HBM_A100, "measured rate %g, catalog bandwidth %g",
           di.mem_bound_gbps, di.hbm_gbps);
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 20, 1, &l, per, &pc));
    NEAR(per[0].mem_bound_s, mem_bound(5.0 / 0.75, 20, 1.0, 0, tiny_params()), "measured memory-bound rate");
    dd.mem_bound_gbps = 0.0;
    hexiseq_cluster_destroy(c);
    hexiseq_layout_free(&l);

    /* A 2-group ring (S = 10 as 6 | 4, as in test_two_devices): only ring step 0 splits off the diagonal.
     * Group 0 front [0,3) back [7,10): step 0 = 6 + 6 diagonal pairs at causal(3), 3 * 3 at attn(3);
     * step 1 = p01 pairs against group 1 at attn(min(6, 4) / 2 = 2). Group 1 front [3,5) back [5,7) touch
     * (joined by the runtime): step 0 = its 10 pairs as one causal block at causal(4); step 1 = p10 at attn(2). */
    hexiseq_node_desc two[2] = {nd, nd};
    hexiseq_device_desc dd2[2];
    memset(dd2, 0, sizeof dd2);
    dd2[0].attn = dd2[1].attn = curve3(1, 0.25, 4, 0.5, 16, 1.5);
    dd2[0].attn_causal = dd2[1].attn_causal = curve3(1, 0.125, 4, 0.25, 16, 0.75);
    const hexiseq_cluster_options opt2 = {dd2, NULL};
    EXPECT_OK(hexiseq_cluster_create_ex(2, two, 10.0, NULL, &opt2, &c));
    EXPECT_OK(hexiseq_layout_alloc(2, 2, &l));
    const int32_t gs[] = {1, 1}, dv[] = {0, 1}, lo[] = {0, 0}, cnt[] = {4, 4};
    const int64_t gq[] = {6, 4}, tk[] = {6, 4};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, per, &pc));
    const int64_t pos0[] = {0, 1, 2, 7, 8, 9}, pos1[] = {3, 4, 5, 6};
    const double p00 = brute_pairs(pos0, 6, pos0, 6, 1), p01 = brute_pairs(pos0, 6, pos1, 4, 1);
    const double p11 = brute_pairs(pos1, 4, pos1, 4, 1), p10 = brute_pairs(pos1, 4, pos0, 6, 1);
    EXPECT(p00 == 21 && p11 == 10, "own-position pairs %g %g", p00, p11);
    const double c3 = lerp_log(3, 1, 0.125, 4, 0.25) * 1e12;
    const double a3 = lerp_log(3, 1, 0.25, 4, 0.5) * 1e12, a2 = lerp_log(2, 1, 0.25, 4, 0.5) * 1e12;
    const double t0 = 12.0 / c3 + 9.0 / a3 + p01 / a2, t1 = 10.0 / (0.25 * 1e12) + p10 / a2;
    NEAR(per[0].attn_s, 3.5 * 4.0 * d * A * t0 * L, "ring group 0 attn_s with curves");
    NEAR(per[1].attn_s, 3.5 * 4.0 * d * A * t1 * L, "ring group 1 attn_s with curves");
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

/* Measured runtime curves (ns per element of the runtime's work around the kernels): a member is charged
 * sequences * layers * (g * runtime(g) + a * runtime_a2a(a)) * 1e-9 * (passes / 3.5), g = S_g * (h + 2 kv) * d its
 * group's side, a = s_r * (A + 2 A_kv) * d its all-to-all side, only in a group of more than one. The charge joins
 * the device's attention phase and busy time; without the curves every figure is as before, bit for bit. Layout:
 * one group of two (S = 10 as 6 + 4 tokens, heads 3 + 1; kv ranges [0, 2) and [1, 2)) and a ring of two single
 * devices (no all-to-all side; the ring's side runtime_ring(r) per element of the other group's K, V,
 * r = (S - S_g) * 2 kv * d). */
static void test_runtime_curve(void) {
    hexiseq_node_desc nd = node("A100-80G", 2, 100.0, 10.0, 2.0, 0.5, 0.25);
    hexiseq_device_desc dd[2];
    memset(dd, 0, sizeof dd);
    for (int i = 0; i < 2; ++i) {
        dd[i].attn = curve3(1, 0.25, 4, 0.5, 16, 1.5);
        dd[i].runtime = curve2(10, 4.0, 1000, 2.0); /* time linear in the elements between points */
        dd[i].runtime_a2a = curve2(10, 9.0, 1000, 3.0);
        dd[i].runtime_ring = curve2(10, 5.0, 1000, 1.0);
    }
    const hexiseq_cluster_options with = {dd, NULL};
    hexiseq_device_desc plain_dd[2];
    memcpy(plain_dd, dd, sizeof dd);
    for (int i = 0; i < 2; ++i)
        plain_dd[i].runtime.n = plain_dd[i].runtime_a2a.n = plain_dd[i].runtime_ring.n = 0;
    const hexiseq_cluster_options without = {plain_dd, NULL};
    hexiseq_cluster *c = NULL, *p = NULL;
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &with, &c));
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &without, &p));
    for (int ckpt = 0; ckpt < 2; ++ckpt) {
        hexiseq_training t = {3, ckpt, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
        for (int ring = 0; ring < 2; ++ring) {
            hexiseq_layout l;
            EXPECT_OK(hexiseq_layout_alloc(ring ? 2 : 1, 2, &l));
            const int32_t gs1[] = {2}, gs2[] = {1, 1}, dv[] = {0, 1}, lo1[] = {0, 3}, cnt1[] = {3, 1}, lo2[] = {0, 0},
                          cnt2[] = {4, 4};
            const int64_t gq1[] = {10}, gq2[] = {6, 4}, tk[] = {6, 4};
            if (ring)
                fill_layout(&l, gs2, gq2, dv, tk, lo2, cnt2);
            else
                fill_layout(&l, gs1, gq1, dv, tk, lo1, cnt1);
            hexiseq_device_cost a[2], b2[2];
            hexiseq_plan_cost pa, pb;
            EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, a, &pa));
            EXPECT_OK(hexiseq_evaluate(p, &TINY, &t, 10, 1, &l, b2, &pb));
            double phase = 0;
            for (int r = 0; r < 2; ++r) {
                const double own = (double)tk[r] * (A + 2 * Akv) * d;
                const double heads = ring ? 4 : cnt1[r], kv = ring ? 2 : (r == 0 ? 2 : 1);
                const double group = (ring ? (double)gq2[r] : 10.0) * (heads + 2 * kv) * d;
                const double recv = ring ? (10.0 - (double)gq2[r]) * 2 * kv * d : 0.0; /* the other group's K, V */
                const double side = ring ? runtime_total(recv, 10, 5.0, 1000, 1.0)
                                         : runtime_total(own, 10, 9.0, 1000, 3.0);
                const double ns = runtime_total(group, 10, 4.0, 1000, 2.0) + side;
                const double want = 3 * L * ns * 1e-9 * (3.5 + ckpt) / 3.5;
                NEAR(a[r].runtime_s, want, "runtime_s of a member");
                EXPECT(b2[r].runtime_s == 0.0, "no curve, no charge");
                EXPECT(a[r].attn_s == b2[r].attn_s && a[r].ring_exposed_s == b2[r].ring_exposed_s &&
                           a[r].gemm_s == b2[r].gemm_s && a[r].a2a_s == b2[r].a2a_s,
                       "the other terms do not see the curve (ring %d)", ring);
                NEAR(a[r].busy_s, b2[r].busy_s + want, "busy time carries it");
                phase = fmax(phase, a[r].attn_s + a[r].ring_exposed_s + a[r].runtime_s);
            }
            NEAR(pa.ring_phase_s, phase, "the attention phase carries it");
            NEAR(pa.step_time_s - pb.step_time_s, pa.ring_phase_s - pb.ring_phase_s, "and so the step");
            EXPECT(pa.lower_bound_s == pb.lower_bound_s, "the lower bound is the work's, without it");
            hexiseq_layout_free(&l);
        }
    }
    hexiseq_cluster_destroy(c);
    hexiseq_cluster_destroy(p);
}

/* ------------------------------------------------------------------------------------------------ */
/* Latency: per message (a2a, ring) and per ring step. Three devices in one node, peak 1e-6 TFLOP/s so
 * that attention outlasts every transfer and only the per-step syncs are exposed. Latency matrix (us):
 * lat[a][b] = 1 + a + 3 b off the diagonal. */

static void test_latency(void) {
    hexiseq_node_desc nd = node("A100-80G", 3, 100.0, 10.0, 1e-6, 0.5, 0.25);
    double lat_us[9];
    for (int a = 0; a < 3; ++a)
        for (int bb = 0; bb < 3; ++bb)
            lat_us[a * 3 + bb] = a == bb ? NAN /* ignored */ : 1.0 + a + 3.0 * bb;
#define LAT(a, bb) ((1.0 + (a) + 3.0 * (bb)) * 1e-6)
    const hexiseq_cluster_options opt = {NULL, lat_us};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &opt, &c));
    double us = 0;
    EXPECT_OK(hexiseq_cluster_latency(c, 2, 1, &us));
    EXPECT(us == 6.0, "latency 2 -> 1: %g us", us);
    EXPECT_ERR(hexiseq_cluster_latency(c, 1, 1, &us), HEXISEQ_ERR_INVALID, "devices");
    EXPECT_ERR(hexiseq_cluster_latency(c, 0, 3, &us), HEXISEQ_ERR_INVALID, "devices");
    EXPECT_ERR(hexiseq_cluster_latency(NULL, 0, 1, &us), HEXISEQ_ERR_NULL, "cluster");
    EXPECT_ERR(hexiseq_cluster_latency(c, 0, 1, NULL), HEXISEQ_ERR_NULL, "us");
    hexiseq_device_cost per[3];
    hexiseq_plan_cost pc;

    /* Ring of 3 single-device groups (0 -> 1 -> 2 -> 0) against a ring of 2 (group {0, 2 parked}, group
     * {1}). Every transfer hides, so a device's exposed ring time is its syncs: the largest latency it
     * receives, in every forward step but the last (times 2 with checkpointing) and every backward step:
     * per layer and sequence ((G - 1) * fwd_passes + G) * lat(prev -> me). */
    for (int ck = 0; ck <= 1; ++ck) {
        hexiseq_training t = {2, ck, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
        const double reps = L * 2.0, fp = 1.0 + ck;
        hexiseq_layout l3, l2;
        EXPECT_OK(hexiseq_layout_alloc(3, 3, &l3));
        const int32_t gs3[] = {1, 1, 1}, dv3[] = {0, 1, 2}, lo3[] = {0, 0, 0}, cnt3[] = {4, 4, 4};
        const int64_t gq3[] = {4, 4, 4}, tk3[] = {4, 4, 4};
        fill_layout(&l3, gs3, gq3, dv3, tk3, lo3, cnt3);
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 12, 1, &l3, per, &pc));
        const double ex3[3] = {(2 * fp + 3) * LAT(2, 0) * reps, (2 * fp + 3) * LAT(0, 1) * reps, (2 * fp + 3) * LAT(1, 2) * reps};
        for (int r = 0; r < 3; ++r)
            NEAR(per[r].ring_exposed_s, ex3[r], "3-group ring: only the syncs are exposed");
        EXPECT_OK(hexiseq_layout_alloc(2, 3, &l2));
        const int32_t gs2[] = {2, 1}, dv2[] = {0, 2, 1}, lo2[] = {0, 4, 0}, cnt2[] = {4, 0, 4};
        const int64_t gq2[] = {6, 6}, tk2[] = {6, 0, 6};
        fill_layout(&l2, gs2, gq2, dv2, tk2, lo2, cnt2);
        EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 12, 1, &l2, per, &pc));
        NEAR(per[0].ring_exposed_s, (fp + 2) * LAT(1, 0) * reps, "2-group ring dev0 syncs");
        NEAR(per[2].ring_exposed_s, (fp + 2) * LAT(0, 1) * reps, "2-group ring dev1 syncs");
        NEAR(per[1].ring_exposed_s, 0.0, "parked device: no ring");
        NEAR(per[0].a2a_s, 0.0, "a parked peer exchanges no messages");
        /* With one latency for all links (5 us) the 3-group ring pays (fp + 1) more syncs per layer and
         * sequence on every device. */
        double flat[9];
        for (int i = 0; i < 9; ++i)
            flat[i] = 5.0;
        const hexiseq_cluster_options fo = {NULL, flat};
        hexiseq_cluster *cf = NULL;
        EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &fo, &cf));
        double e2, e3;
        EXPECT_OK(hexiseq_evaluate(cf, &TINY, &t, 12, 1, &l2, per, &pc));
        e2 = per[0].ring_exposed_s;
        EXPECT_OK(hexiseq_evaluate(cf, &TINY, &t, 12, 1, &l3, per, &pc));
        e3 = per[0].ring_exposed_s;
        NEAR(e3 - e2, (fp + 1) * 5e-6 * reps, "a 3-group ring costs (fp + 1) syncs more than a 2-group ring");
        hexiseq_cluster_destroy(cf);
        hexiseq_layout_free(&l3);
        hexiseq_layout_free(&l2);
    }

    /* Group {0 (heads 0-1: kv 0), 1 (heads 2-3: kv 1)} and group {2}: device 2 receives kv 0 from 0 and kv 1
     * from 1 (two messages; its sync is the larger latency); sends kv 0 to 0 and kv 1 to 1. The all-to-all
     * inside group 0 pays lat(0 -> 1) per message device 0 sends and lat(1 -> 0) per message it receives. */
    hexiseq_training t = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(2, 3, &l));
    const int32_t gs[] = {2, 1}, dv[] = {0, 1, 2}, lo[] = {0, 2, 0}, cnt[] = {2, 2, 4};
    const int64_t gq[] = {6, 6}, tk[] = {4, 2, 6};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 12, 1, &l, per, &pc));
    NEAR(per[2].ring_exposed_s, (1 + 2) * fmax(LAT(0, 2), LAT(1, 2)) * L, "sync = largest latency received");
    const double bw = 100e9, elem = d * b;
    const double s0 = 4, s1 = 2, h0 = 2, h1 = 2, kv0 = 1, kv1 = 1;
    const double qs0 = s0 * (h1 + 2 * kv1) * elem / bw + LAT(0, 1), qr0 = s1 * (h0 + 2 * kv0) * elem / bw + LAT(1, 0);
    const double os0 = s1 * h0 * elem / bw + LAT(0, 1), or0 = s0 * h1 * elem / bw + LAT(1, 0);
    /* backward: dO goes the output's way back, the gradients Q/K/V's (here every held kv head is first-held) */
    const double ds0 = s0 * h1 * elem / bw + LAT(0, 1), dr0 = s1 * h0 * elem / bw + LAT(1, 0);
    const double gs0 = s1 * (h0 + 2 * kv0) * elem / bw + LAT(0, 1), gr0 = s0 * (h1 + 2 * kv1) * elem / bw + LAT(1, 0);
    NEAR(per[0].a2a_s, (fmax(qs0, qr0) + fmax(os0, or0) + fmax(ds0, dr0) + fmax(gs0, gr0)) * L,
         "a2a latency per message");
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
#undef LAT
}

/* ------------------------------------------------------------------------------------------------ */
/* Gradient collectives, every sharding, in both regimes of the pipelined overlap: collectives longer than
 * a layer's compute (fast devices) and shorter (peak 1e-6 TFLOP/s). Two devices of one node, bandwidth
 * 0 -> 1 at 50 GB/s and 1 -> 0 at 80, latency 3 us and 7 us: the ring's slowest link is 50 GB/s and its
 * largest latency 7 us. One group of both devices, non-causal, tokens 5 | 5, heads 2 | 2. */

/* The memory-bound work on its own: a gated MLP reads gate and up and writes their product (3F elements), and
 * without sharding every device's optimizer step covers every parameter; with it, the device's share. Two A100s
 * of one node, one group, tokens 6 | 4, 2 sequences with recompute. */
static void test_memory_bound_work(void) {
    hexiseq_node_desc nd = node("A100-80G", 2, 100.0, 10.0, 2.0, 0.5, 0.25);
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(1, &nd, 10.0, NULL, &c));
    hexiseq_model gated = TINY;
    gated.gated_mlp = 1;
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(1, 2, &l));
    const int32_t gs[] = {2}, dv[] = {0, 1}, lo[] = {0, 2}, cnt[] = {2, 2};
    const int64_t gq[] = {10}, tk[] = {6, 4};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    double P = 0;
    EXPECT_OK(hexiseq_model_params(&gated, &P));
    /* per token and layer: 4H + 6H + 2 (A d + Akv d) + 3F elements, as tiny_mem_elems with the gated MLP */
    const double elems = 4.0 * H + 6.0 * H + 2.0 * (A * d + Akv * d) + 3.0 * F, rate = mem_rate(HBM_A100);
    const double s[2] = {6, 4};
    for (int32_t sh = HEXISEQ_SHARD_FULL; sh <= HEXISEQ_SHARD_NONE; sh += HEXISEQ_SHARD_NONE - HEXISEQ_SHARD_FULL) {
        hexiseq_training t = {2, 1, sh, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
        hexiseq_device_cost per[2];
        hexiseq_plan_cost pc;
        EXPECT_OK(hexiseq_evaluate(c, &gated, &t, 10, 1, &l, per, &pc));
        const double opt = sh == HEXISEQ_SHARD_NONE ? P : P / 2; /* every parameter, or half of them */
        for (int r = 0; r < 2; ++r) {
            const double want = (2.0 * s[r] * (L * elems * b * 4.0 + V * (2.0 * b + 8.0)) + opt * (28.0 + b)) / rate;
            NEAR(per[r].mem_bound_s, want, sh == HEXISEQ_SHARD_NONE ? "unsharded memory-bound" : "sharded memory-bound");
            NEAR(per[r].layer_mem_bound_s, s[r] * elems * b * 3.0 / rate, "one layer's memory-bound work");
        }
        NEAR(pc.gemm_phase_s, fmax(per[0].gemm_s + per[0].mem_bound_s, per[1].gemm_s + per[1].mem_bound_s),
             "the token-parallel phase holds the memory-bound work");
    }
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

static void test_grad_collectives(void) {
    const double bwm[4] = {0, 50, 80, 0}, latm[4] = {0, 3, 7, 0};
    const hexiseq_cluster_options opt = {NULL, latm};
    const double peaks[2] = {1000.0, 1e-6};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(1, 2, &l));
    const int32_t gs[] = {2}, dv[] = {0, 1}, lo[] = {0, 2}, cnt[] = {2, 2};
    const int64_t gq[] = {10}, tk[] = {5, 5};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    for (int pi = 0; pi < 2; ++pi) {
        hexiseq_node_desc nd = node("H100", 2, 100.0, 10.0, peaks[pi], 0.5, 0.25);
        hexiseq_cluster *c = NULL;
        EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, bwm, &opt, &c));
        /* one layer, one sequence, either device (they are alike): matmuls of 5 rows, attention of 10 x 10
         * pairs for 2 heads on the whole 10-token block */
        const double gf = 5 * tiny_layer_fpt() / gemm_rate(peaks[pi], 0.5, 5);
        const double af = 4.0 * 100 * d * 2 / attn_rate(peaks[pi], 0.25, 10);
        const double a = 0.5 * tiny_params() * b / 50e9 / L + 7e-6; /* one layer's reduce-scatter or gather */
        EXPECT(pi == 0 ? a > 4.5 * (gf + af) : 3 * a < gf + af, "regime %d: per-layer collective vs compute", pi);
        for (int32_t sh = HEXISEQ_SHARD_FULL; sh <= HEXISEQ_SHARD_NONE; ++sh)
            for (int ck = 0; ck <= 1; ++ck)
                for (int seqs = 1; seqs <= 3; seqs += 2) {
                    hexiseq_training t = {seqs, ck, sh, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
                    hexiseq_device_cost per[2];
                    hexiseq_plan_cost pc;
                    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 0, &l, per, &pc));
                    double gsync, gexp;
                    const double mf = mem_fwd(HBM_H100, 5); /* one layer's memory-bound forward, 5 tokens */
                    grad_by_hand(sh, 2, 50e9, 7e-6, seqs, ck, gf + af + mf,
                                 (2.0 + ck) * gf + (2.5 + ck) * af + (2.0 + ck) * mf, &gsync, &gexp);
                    char what[96];
                    snprintf(what, sizeof what, "grad sharding %d ckpt %d seqs %d peak %g", sh, ck, seqs, peaks[pi]);
                    NEAR(pc.grad_sync_s, gsync, what);
                    NEAR(pc.grad_exposed_s, gexp, what);
                    NEAR(pc.step_time_s, pc.gemm_phase_s + pc.a2a_phase_s + pc.ring_phase_s + gexp, what);
                    if (pi == 1) { /* compute hides all but the last layer's collective */
                        double A = a * L, last;
                        if (sh == HEXISEQ_SHARD_FULL)
                            last = seqs * a + (seqs - 1) * (1 + ck) * a + (2 + ck) * a;
                        else if (sh == HEXISEQ_SHARD_GRAD_OPT)
                            last = a + A;
                        else
                            last = 2 * a;
                        NEAR(pc.grad_exposed_s, last, what);
                    }
                }
        hexiseq_cluster_destroy(c);
    }
    hexiseq_layout_free(&l);
}

/* ------------------------------------------------------------------------------------------------ */
/* A GPU model outside the catalog, fully described by the node's overrides or by measured curves. */

static void test_unknown_gpu(void) {
    char name[16] = "XPU-900";
    hexiseq_node_desc nd = node(name, 2, 100.0, 64.0, 500.0, 0.6, 0.4);
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(1, &nd, 10.0, NULL, &c));
    strcpy(name, "XXXXX"); /* the cluster keeps its own copy of the name */
    hexiseq_device_info di;
    EXPECT_OK(hexiseq_cluster_device(c, 1, &di));
    EXPECT(di.gpu_index == -1 && strcmp(di.gpu_name, "XPU-900") == 0 && di.memory_gib == 64.0 && di.peak_tflops == 500.0 &&
               di.gemm_eff == 0.6 && di.attn_eff == 0.4,
           "unknown GPU device: index %d name %s", di.gpu_index, di.gpu_name);
    hexiseq_training t = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(1, 2, &l));
    const int32_t gs[] = {2}, dv[] = {0, 1}, lo[] = {0, 2}, cnt[] = {2, 2};
    const int64_t gq[] = {10}, tk[] = {6, 4};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    hexiseq_device_cost per[2];
    hexiseq_plan_cost pc;
    const double fpt = L * tiny_layer_fpt() * 3.0 + tiny_head_fpt() * 3.0;
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, per, &pc));
    NEAR(per[0].gemm_s, 6 * fpt / gemm_rate(500.0, 0.6, 6), "unknown GPU gemm_s from the node's rates");
    /* no catalog entry, so no memory bandwidth: its memory-bound work is not charged, nor in the bound */
    EXPECT(di.hbm_gbps == 0.0 && per[0].mem_bound_s == 0.0 && per[0].layer_mem_bound_s == 0.0,
           "unknown GPU: memory-bound work %g s at %g GB/s", per[0].mem_bound_s, di.hbm_gbps);
    hexiseq_layout out;
    EXPECT_OK(hexiseq_plan_strategy(c, &TINY, &t, 1000, 1, HEXISEQ_STRATEGY_HEXISEQ, &out, &pc));
    hexiseq_layout_free(&out);
    hexiseq_cluster_destroy(c);
    /* too little memory: the error names the model */
    strcpy(name, "XPU-900");
    nd.memory_gib = 1e-6;
    EXPECT_OK(hexiseq_cluster_create(1, &nd, 10.0, NULL, &c));
    EXPECT_ERR(hexiseq_plan_strategy(c, &TINY, &t, 1000, 1, HEXISEQ_STRATEGY_RING, &out, &pc), HEXISEQ_ERR_MEMORY, "XPU-900");
    hexiseq_layout_free(&out);
    EXPECT_ERR(hexiseq_plan_strategy(c, &TINY, &t, 1000, 1, HEXISEQ_STRATEGY_HEXISEQ, &out, &pc), HEXISEQ_ERR_MEMORY, "XPU-900");
    hexiseq_layout_free(&out);
    hexiseq_cluster_destroy(c);

    /* Not fully described: the error names the node, the model, what to give, and the catalog. */
    hexiseq_node_desc bad = node("XPU-900", 2, 100.0, 0.0, 500.0, 0.6, 0.4);
    EXPECT_ERR(hexiseq_cluster_create(1, &bad, 10.0, NULL, &c), HEXISEQ_ERR_UNKNOWN_GPU, "nodes[0].gpu 'XPU-900'");
    EXPECT(strstr(hexiseq_last_error(), "memory_gib, peak_tflops, gemm_eff and attn_eff") &&
               strstr(hexiseq_last_error(), "H100-SXM") && strstr(hexiseq_last_error(), "device 0 has no memory_gib"),
           "unknown GPU message: '%s'", hexiseq_last_error());
    EXPECT(c == NULL, "no cluster on failure");
    bad = node("XPU-900", 2, 100.0, 64.0, 500.0, 0.6, 0.0);
    EXPECT_ERR(hexiseq_cluster_create(1, &bad, 10.0, NULL, &c), HEXISEQ_ERR_UNKNOWN_GPU, "attention rate");
    bad = node("XPU-900", 2, 100.0, 64.0, 0.0, 0.6, 0.4);
    EXPECT_ERR(hexiseq_cluster_create(1, &bad, 10.0, NULL, &c), HEXISEQ_ERR_UNKNOWN_GPU, "matmul rate");

    /* Described by measurements only: each device's memory and gemm, attn curves. */
    hexiseq_node_desc nodes[2] = {node("A100-80G", 1, 100.0, 0, 0, 0, 0), node("XPU-900", 2, 100.0, 0, 0, 0, 0)};
    hexiseq_device_desc dd[3];
    memset(dd, 0, sizeof dd);
    for (int i = 1; i < 3; ++i) {
        dd[i].memory_gib = 100.0 + i;
        dd[i].gemm = curve2(10, 1.0, 40, 3.0);
        dd[i].attn = curve2(1, 0.25, 16, 1.5);
    }
    const hexiseq_cluster_options opt = {dd, NULL};
    EXPECT_OK(hexiseq_cluster_create_ex(2, nodes, 10.0, NULL, &opt, &c));
    EXPECT_OK(hexiseq_cluster_device(c, 2, &di));
    EXPECT(di.gpu_index == -1 && strcmp(di.gpu_name, "XPU-900") == 0 && di.memory_gib == 102.0 && di.peak_tflops == 0.0,
           "curve-described device: index %d name %s memory %g peak %g", di.gpu_index, di.gpu_name, di.memory_gib,
           di.peak_tflops);
    EXPECT_OK(hexiseq_cluster_device(c, 0, &di));
    EXPECT(di.gpu_index >= 0 && strcmp(di.gpu_name, "A100-80G") == 0, "catalog device next to it");
    hexiseq_layout l3;
    EXPECT_OK(hexiseq_layout_alloc(3, 3, &l3));
    const int32_t gs3[] = {1, 1, 1}, dv3[] = {0, 1, 2}, lo3[] = {0, 0, 0}, cnt3[] = {4, 4, 4};
    const int64_t gq3[] = {10, 20, 10}, tk3[] = {10, 20, 10};
    fill_layout(&l3, gs3, gq3, dv3, tk3, lo3, cnt3);
    hexiseq_device_cost per3[3];
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 40, 1, &l3, per3, &pc));
    NEAR(per3[1].gemm_s, 20 * fpt / 2e12, "curve-described gemm_s (halfway in log between 10 and 40)");
    NEAR(per3[2].mem_cap_gib, 102.0, "curve-described memory");
    EXPECT_OK(hexiseq_plan_strategy(c, &TINY, &t, 4000, 1, HEXISEQ_STRATEGY_HEXISEQ, &out, &pc));
    hexiseq_layout_free(&out);
    hexiseq_layout_free(&l3);
    hexiseq_cluster_destroy(c);
    dd[2].attn.n = 0; /* device 2 without an attention rate */
    EXPECT_ERR(hexiseq_cluster_create_ex(2, nodes, 10.0, NULL, &opt, &c), HEXISEQ_ERR_UNKNOWN_GPU, "nodes[1].gpu 'XPU-900'");
    EXPECT(strstr(hexiseq_last_error(), "device 2 has no attention rate"), "names the device: '%s'", hexiseq_last_error());
    dd[2].attn = curve2(1, 0.25, 16, 1.5);
    dd[2].memory_gib = 0; /* nor memory */
    EXPECT_ERR(hexiseq_cluster_create_ex(2, nodes, 10.0, NULL, &opt, &c), HEXISEQ_ERR_UNKNOWN_GPU, "device 2 has no memory_gib");
    EXPECT_ERR(hexiseq_cluster_create(2, nodes, 10.0, NULL, &c), HEXISEQ_ERR_UNKNOWN_GPU, "device 1 has no memory_gib");
    hexiseq_layout_free(&l);
}

/* Bad curves, device memories and latencies are named by field and index. */
static void test_garbage_measurements(void) {
    hexiseq_node_desc nd = node("H100", 3, 450, 0, 0, 0, 0);
    hexiseq_device_desc dd[3];
    hexiseq_cluster_options opt = {dd, NULL};
    hexiseq_cluster *c = (hexiseq_cluster *)(uintptr_t)1;
    memset(dd, 0, sizeof dd);
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c)); /* all-empty descriptions are fine */
    hexiseq_cluster_destroy(c);
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 25, NULL, NULL, &c));
    hexiseq_cluster_destroy(c);

    dd[2].attn = curve2(1024, 100, 512, 200);
    EXPECT_ERR(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c), HEXISEQ_ERR_INVALID,
               "devices[2].attn_tflops[1]: sizes must increase, got 512 after 1024");
    EXPECT(c == NULL, "out set to NULL on failure");
    dd[2].attn = curve2(512, 100, 512, 200);
    EXPECT_ERR(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c), HEXISEQ_ERR_INVALID, "devices[2].attn_tflops[1]");
    memset(dd, 0, sizeof dd);
    const double bad[] = {0.0, -1.0, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        memset(dd, 0, sizeof dd);
        dd[1].attn_causal = curve2(bad[i], 100, 512, 200);
        EXPECT_ERR(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c), HEXISEQ_ERR_INVALID,
                   "devices[1].attn_causal_tflops[0]: size");
        memset(dd, 0, sizeof dd);
        dd[0].gemm = curve2(256, 100, 512, bad[i]);
        EXPECT_ERR(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c), HEXISEQ_ERR_INVALID, "devices[0].gemm_tflops[1]: tflops");
    }
    const int32_t bad_n[] = {-1, HEXISEQ_MAX_CURVE + 1, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof bad_n / sizeof bad_n[0]; ++i) {
        memset(dd, 0, sizeof dd);
        dd[0].gemm.n = bad_n[i];
        EXPECT_ERR(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c), HEXISEQ_ERR_INVALID, "devices[0].gemm_tflops");
    }
    const double nonfinite[] = {NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < 3; ++i) {
        memset(dd, 0, sizeof dd);
        dd[1].memory_gib = nonfinite[i];
        EXPECT_ERR(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c), HEXISEQ_ERR_INVALID, "devices[1].memory_gib");
    }
    /* latency: finite and >= 0 off the diagonal; the diagonal is ignored */
    opt.devices = NULL;
    const double bad_lat[] = {-1.0, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < sizeof bad_lat / sizeof bad_lat[0]; ++i) {
        double m9[9] = {0, 1, 1, 1, 0, 1, 1, 1, 0};
        m9[5] = bad_lat[i];
        opt.latency_us = m9;
        EXPECT_ERR(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c), HEXISEQ_ERR_INVALID, "latency_us[1][2]");
        double diag[9] = {bad_lat[i], 0, 0, 0, bad_lat[i], 0, 0, 0, bad_lat[i]};
        opt.latency_us = diag;
        EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 25, NULL, &opt, &c));
        hexiseq_cluster_destroy(c);
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* Model states shared by memory: a device holds a share of the sharded states in proportion to the memory it
 * has beyond the unsharded part and the reserve; the collectives move the largest share per step. */

static void test_state_shares(void) {
    const double P = tiny_params(), S = (2.0 * b + 12.0) * P; /* ZeRO-3: parameters, gradients, Adam + master */
    const double fixed = 3.0 * fmax(tiny_layer_params(), V * H) * b;  /* a layer gathered, prefetched, its grads */
    /* three devices with room for 0.75 S beyond the unsharded part, one with 0.15 S: 1/4 of S each (even) does
     * not fit the small one */
    hexiseq_node_desc nodes[2] = {node("H100", 3, 100.0, (fixed + 0.75 * S) / GIB, 100.0, 0.5, 0.5),
                                  node("A100", 1, 100.0, (fixed + 0.15 * S) / GIB, 100.0, 0.5, 0.5)};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(2, nodes, 10.0, NULL, &c));
    hexiseq_training even = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    hexiseq_training mem = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_BY_MEMORY, NULL, 0};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(4, 4, &l));
    const int32_t gs[] = {1, 1, 1, 1}, dv[] = {0, 1, 2, 3}, lo[] = {0, 0, 0, 0}, cnt[] = {4, 4, 4, 4};
    const int64_t gq[] = {1, 1, 1, 1}, tk[] = {1, 1, 1, 1};
    fill_layout(&l, gs, gq, dv, tk, lo, cnt);
    hexiseq_device_cost pe[4], pm[4];
    hexiseq_plan_cost ce, cm;
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &even, 4, 1, &l, pe, &ce));
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &mem, 4, 1, &l, pm, &cm));
    const double want[4] = {0.75 / 2.4, 0.75 / 2.4, 0.75 / 2.4, 0.15 / 2.4};
    double sum = 0;
    for (int r = 0; r < 4; ++r) {
        char what[64];
        snprintf(what, sizeof what, "device %d", r);
        NEAR(pe[r].state_share, 0.25, what);
        NEAR(pe[r].mem_states_gib, (fixed + S / 4) / GIB, what);
        NEAR(pm[r].state_share, want[r], what);
        NEAR(pm[r].mem_states_gib, (fixed + want[r] * S) / GIB, what);
        sum += pm[r].state_share;
    }
    NEAR(sum, 1.0, "shares sum to 1");
    EXPECT(!ce.fits && pe[3].mem_total_gib > pe[3].mem_cap_gib, "even shares overflow the small device");
    EXPECT(cm.fits, "shares by memory fit");
    /* ZeRO-3, one sequence, no checkpointing: 3 collectives over the ring 0 -> 1 -> 2 -> 3 -> 0 (inter-node
     * link 10 GB/s, 20 us), each N - 1 steps of the largest share */
    double lat = TINY.layers * 3 * 20e-6;
    NEAR(ce.grad_sync_s, 3 * (0.75 * P * b / 10e9 + lat), "even collectives");
    NEAR(cm.grad_sync_s, 3 * (3 * want[0] * P * b / 10e9 + lat), "padded uneven collectives");
    /* the planners: no layout fits with even shares, one does by memory */
    hexiseq_layout out;
    EXPECT_ERR(hexiseq_plan_strategy(c, &TINY, &even, 8, 1, HEXISEQ_STRATEGY_HEXISEQ, &out, &ce), HEXISEQ_ERR_MEMORY,
               "short");
    hexiseq_layout_free(&out);
    EXPECT_OK(hexiseq_plan_strategy(c, &TINY, &mem, 8, 1, HEXISEQ_STRATEGY_HEXISEQ, &out, &cm));
    EXPECT(cm.fits, "the scheduler's plan by memory fits");
    hexiseq_layout_free(&out);
    hexiseq_cluster_destroy(c);
    /* alike devices: shares by memory are the even ones */
    nodes[1] = node("H100", 1, 100.0, (fixed + 0.75 * S) / GIB, 100.0, 0.5, 0.5);
    EXPECT_OK(hexiseq_cluster_create(2, nodes, 10.0, NULL, &c));
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &mem, 4, 1, &l, pm, &cm));
    for (int r = 0; r < 4; ++r)
        NEAR(pm[r].state_share, 0.25, "alike devices");
    NEAR(cm.grad_sync_s, 3 * (0.75 * P * b / 10e9 + lat), "alike devices' collectives");
    /* replicated states have no shares to move; a bad mode is refused by name */
    hexiseq_training none = {1, 0, HEXISEQ_SHARD_NONE, 0.0, HEXISEQ_STATES_BY_MEMORY, NULL, 0};
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &none, 4, 1, &l, pm, &cm));
    NEAR(pm[0].mem_states_gib, (2.0 * b + 12.0) * P / GIB, "replicated states");
    hexiseq_training bad = {1, 0, HEXISEQ_SHARD_FULL, 0.0, 7, NULL, 0};
    EXPECT_ERR(hexiseq_evaluate(c, &TINY, &bad, 4, 1, &l, pm, &cm), HEXISEQ_ERR_INVALID, "training.state_shares");
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

/* Sliding windows: the pairs inside a window, one device with one windowed layer of two (by hand), a window that
 * covers the whole sequence (the same cost as none, exactly), a window that cuts a contiguous ring short, and the
 * model's window fields refused out of range. */
static void test_window(void) {
    /* q - window < k <= q. [0,10) x [0,10), W = 3: query q sees min(q + 1, 3) keys: 1 + 2 + 3 * 8 = 27. [20,30) x
     * [0,10), W = 15: query 20 sees keys 6..9, 21 sees 7..9, 22 two, 23 one, later ones none: 10. */
    EXPECT(hexiseq_window_pairs(0, 10, 0, 10, 3) == 27, "window pairs %lld", (long long)hexiseq_window_pairs(0, 10, 0, 10, 3));
    EXPECT(hexiseq_window_pairs(20, 30, 0, 10, 15) == 10, "window pairs %lld",
           (long long)hexiseq_window_pairs(20, 30, 0, 10, 15));
    for (int64_t q0 = 0; q0 < 24; q0 += 5) /* against brute force on odd ranges */
        for (int64_t k0 = 0; k0 < 24; k0 += 7)
            for (int64_t w = 1; w < 20; w += 6) {
                int64_t n = 0;
                for (int64_t q = q0; q < q0 + 9; ++q)
                    for (int64_t k = k0; k < k0 + 11; ++k)
                        n += k <= q && q - k < w;
                EXPECT(hexiseq_window_pairs(q0, q0 + 9, k0, k0 + 11, w) == n, "window pairs q0 %lld k0 %lld w %lld",
                       (long long)q0, (long long)k0, (long long)w);
            }

    hexiseq_cluster *c = NULL;
    hexiseq_training t;
    hexiseq_layout l;
    one_device(&c, &t, &l);
    hexiseq_device_cost per[3], ref[3];
    hexiseq_plan_cost pc, pref;
    hexiseq_model m = TINY;
    m.window = 3;
    m.window_layers = 1;
    EXPECT_OK(hexiseq_evaluate(c, &m, &t, 10, 1, &l, per, &pc));
    /* the full layer: 55 pairs in one block of 10 (the only group's chunks, joined); the windowed one: 27 pairs on
     * rows of at most 3 keys */
    const double peak = 2.0, ae = 0.25, S = 10;
    const double fwd_full = 4.0 * 55 * d * A / attn_rate(peak, ae, S), fwd_w = 4.0 * 27 * d * A / attn_rate(peak, ae, 3);
    NEAR(per[0].attn_s, 3.5 * (fwd_full + fwd_w), "window attn_s (one layer of two windowed)");
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, ref, &pref));
    const double lb_attn_full = L * 4.0 * 55 * d * A * 3.5 / (peak * 1e12 * ae);
    NEAR(pref.lower_bound_s - pc.lower_bound_s, lb_attn_full * (55.0 - 27.0) / (2.0 * 55.0),
         "window lower bound: one layer's pairs 55 -> 27");
    /* a window as long as the sequence: the cost of full attention, bit for bit */
    m.window = 10;
    m.window_layers = 2;
    EXPECT_OK(hexiseq_evaluate(c, &m, &t, 10, 1, &l, per, &pc));
    EXPECT(per[0].attn_s == ref[0].attn_s && pc.step_time_s == pref.step_time_s, "a window of the whole sequence: %g vs %g",
           per[0].attn_s, ref[0].attn_s);
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);

    /* Three groups of one device in contiguous chunks [0,4) [4,8) [8,12), W = 2: at ring step 1 group 1 meets key
     * 3 from query 4, at step 2 no group meets a key within 2 positions: the windowed ring takes 2 steps, so every
     * device's exposed ring time and the step drop below full attention's (attention alone need not: rows of 2
     * keys run at the rate of 2-token blocks, against 4 for the full layer's, and at these sizes that costs more
     * than the pairs it saves). */
    hexiseq_node_desc n3 = node("A100-80G", 3, 100.0, 10.0, 2.0, 0.5, 0.25);
    EXPECT_OK(hexiseq_cluster_create(1, &n3, 10.0, NULL, &c));
    hexiseq_layout l3;
    EXPECT_OK(hexiseq_layout_alloc(3, 3, &l3));
    const int32_t gs3[] = {1, 1, 1}, dv3[] = {0, 1, 2}, lo3[] = {0, 0, 0}, cnt3[] = {4, 4, 4};
    const int64_t gq3[] = {4, 4, 4}, tk3[] = {4, 4, 4};
    fill_layout(&l3, gs3, gq3, dv3, tk3, lo3, cnt3);
    l3.chunking = HEXISEQ_CHUNK_CONTIGUOUS;
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 12, 1, &l3, ref, &pref));
    m = TINY;
    m.window = 2;
    m.window_layers = 2;
    EXPECT_OK(hexiseq_evaluate(c, &m, &t, 12, 1, &l3, per, &pc));
    for (int r = 0; r < 3; ++r)
        EXPECT(per[r].ring_exposed_s < ref[r].ring_exposed_s, "3 groups, W = 2, device %d: exposed %g vs %g", r,
               per[r].ring_exposed_s, ref[r].ring_exposed_s);
    EXPECT(pc.step_time_s < pref.step_time_s, "3 groups, W = 2: step %g vs %g", pc.step_time_s, pref.step_time_s);
    /* group 0 meets only its own block (its step-1 and step-2 sources lie after it): its windowed pairs are
     * those of [0,4) x [0,4) with W = 2, 4 + 3 = 7, against 10 causal, on rows of 2 keys, against blocks of 4 */
    NEAR(per[0].attn_s, 3.5 * L * 4.0 * 7 * d * A / attn_rate(peak, ae, 2), "group 0 windowed attention");
    hexiseq_layout_free(&l3);

    m = TINY;
    m.window = 5;
    m.window_layers = 3;
    EXPECT_ERR(hexiseq_model_validate(&m), HEXISEQ_ERR_INVALID, "model.window_layers");
    m.window_layers = 0;
    EXPECT_ERR(hexiseq_model_validate(&m), HEXISEQ_ERR_INVALID, "give both");
    m.window = -1;
    EXPECT_ERR(hexiseq_model_validate(&m), HEXISEQ_ERR_INVALID, "model.window");
    hexiseq_cluster_destroy(c);
}

/* Pipeline stages: a model without its embedding or its head (no_embedding, no_head) is a stage of it. By hand on the
 * one-device case: the head's matmuls, its logits' activations and the loss's memory-bound work leave a stage without
 * the head, the embedding's parameters one without the embedding; and a model cut into a first stage (no head) and a
 * last (no embedding) costs, in every term that is additive in layers and parameters, what the whole model does. */
static void test_pipeline_stages(void) {
    hexiseq_cluster *c = NULL;
    hexiseq_training t;
    hexiseq_layout l;
    one_device(&c, &t, &l);
    hexiseq_model first = TINY, last = TINY, middle = TINY;
    first.layers = 1, first.no_head = 1;
    last.layers = 1, last.no_embedding = 1;
    middle.layers = 1, middle.no_embedding = 1, middle.no_head = 1;
    double p_first = 0, p_last = 0, p_mid = 0;
    EXPECT_OK(hexiseq_model_params(&first, &p_first));
    EXPECT_OK(hexiseq_model_params(&last, &p_last));
    EXPECT_OK(hexiseq_model_params(&middle, &p_mid));
    NEAR(p_first, tiny_layer_params() + V * H, "first stage params: a layer and the embedding");
    NEAR(p_last, tiny_layer_params() + V * H + H, "last stage params: a layer, the head and the final norm");
    NEAR(p_mid, tiny_layer_params(), "middle stage params: its layer");
    NEAR(p_first + p_last, tiny_params(), "the stages' parameters add up to the model's");

    hexiseq_device_cost whole[1], a[1], z[1], mid[1];
    hexiseq_plan_cost pw, pa, pz, pm;
    EXPECT_OK(hexiseq_evaluate(c, &TINY, &t, 10, 1, &l, whole, &pw));
    EXPECT_OK(hexiseq_evaluate(c, &first, &t, 10, 1, &l, a, &pa));
    EXPECT_OK(hexiseq_evaluate(c, &last, &t, 10, 1, &l, z, &pz));
    EXPECT_OK(hexiseq_evaluate(c, &middle, &t, 10, 1, &l, mid, &pm));
    const double peak = 2.0, ge = 0.5, s0 = 10;
    NEAR(a[0].gemm_s, s0 * tiny_layer_fpt() * 3.0 / gemm_rate(peak, ge, s0), "first stage gemm_s: its layer only");
    NEAR(z[0].gemm_s, s0 * (tiny_layer_fpt() + tiny_head_fpt()) * 3.0 / gemm_rate(peak, ge, s0),
         "last stage gemm_s: its layer and the head");
    NEAR(mid[0].gemm_s, a[0].gemm_s, "middle stage gemm_s");
    const double act_layer = b * (4.0 * H + A * d + 2.0 * F);
    NEAR(a[0].mem_act_gib, s0 * act_layer / GIB, "first stage activations: no logits");
    NEAR(z[0].mem_act_gib, (s0 * act_layer + s0 * V * (b + 8.0)) / GIB, "last stage activations: the logits too");
    /* the memory-bound work of a layer's tokens, the loss on the last stage, the optimizer over each one's params */
    NEAR(a[0].mem_bound_s + z[0].mem_bound_s, whole[0].mem_bound_s, "mem_bound_s adds up over the stages");
    NEAR(mid[0].mem_bound_s, (s0 * tiny_mem_elems() * b * 3.0 + p_mid * (28.0 + b)) / mem_rate(HBM_A100),
         "middle stage mem_bound_s: its layer's tokens and the optimizer over its parameters, no loss");
    NEAR(a[0].gemm_s + z[0].gemm_s, whole[0].gemm_s, "gemm_s adds up over the stages");
    NEAR(a[0].attn_s + z[0].attn_s, whole[0].attn_s, "attn_s adds up over the stages");
    /* bad flags */
    hexiseq_model bad = TINY;
    bad.no_head = 2;
    EXPECT(hexiseq_model_validate(&bad) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "model.no_head must be 0 or 1, got 2"),
           "no_head 2: %s", hexiseq_last_error());
    bad = TINY, bad.no_embedding = -1;
    EXPECT(hexiseq_model_validate(&bad) == HEXISEQ_ERR_INVALID && strstr(hexiseq_last_error(), "model.no_embedding"),
           "no_embedding -1: %s", hexiseq_last_error());
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

int main(void) {
    test_window();
    test_one_device();
    test_pipeline_stages();
    test_two_devices();
    test_three_devices();
    test_four_devices();
    test_curves();
    test_runtime_curve();
    test_latency();
    test_grad_collectives();
    test_memory_bound_work();
    test_unknown_gpu();
    test_state_shares();
    test_garbage_measurements();
    test_causal_pairs();
    test_spans();
    test_strategies_odd_sizes();
    test_device_names();
    test_garbage_catalog_and_cluster();
    test_garbage_model_layout();
    test_garbage_evaluate();
    test_garbage_overflow();
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
