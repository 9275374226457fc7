/* Unit tests of the memory features (offloaded checkpoints, tiled MLP, tiled loss) through the public C API: the
 * memory and the time each adds, computed by hand from the formulas in csrc/model/cost_memory.c, cost_gemm.c and
 * docs/cost_model.md (never by calling the library's helpers), which combination the cost model chooses per device,
 * the host memory limit, and the scheduler planning shares that only fit with them.
 *
 * The model is cost_test's tiny one with 6 layers: L=6, H=8, A=4, A_kv=2, d=2, F=16 (GELU), V=32, bf16. Per token,
 * with checkpointing (bytes):
 *   checkpoints   L H b = 96          (offloaded: two layers' stay, 2 H b = 32; the host holds 96)
 *   one layer     b (4H + A d + 2F) = 144, of which the MLP's intermediates b 2F = 64 (tiled: one tile's)
 *   logits        V (b + 8) = 320     (the fp32 softmax and its gradient; tiled: one tile's)
 *   attention     per token of the group: ((2A + 2A_kv) d b + 4A) (1 + 1) = 128
 * A tile is 4096 tokens. Tolerance: relative 1e-12 (see test_cost.c). */
#include "hexiseq.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "internal.h" /* hexiseq_memory_tokens_bound */

#define REL_TOL 1e-12
#define NEAR(got, want, what)                                                                                    \
    EXPECT((want) == 0.0 ? (got) == 0.0 : fabs((got) - (want)) <= REL_TOL * fabs(want),                          \
           "%s: got %.17g, want %.17g", (what), (double)(got), (double)(want))
#define EXPECT_OK(call)                                                                                          \
    do {                                                                                                         \
        hexiseq_status st_ = (call);                                                                             \
        EXPECT(st_ == HEXISEQ_OK, "%s: status %d: %s", #call, (int)st_, hexiseq_last_error());                   \
    } while (0)

static const double GIB = 1073741824.0;
static const hexiseq_model M6 = {6, 8, 4, 2, 2, 16, 32, 2, 0, 0, 0, 0, 0};
static const double L = 6, H = 8, F = 16, V = 32, b = 2, TILE = 4096;
static const double PEAK = 100.0, EFF = 0.5; /* node overrides: matmuls at 50 TFLOP/s on large shapes */
static const double MEM_RATE = 2039.0 * 1e9 * 0.75; /* A100-80G's memory-bound rate: 0.75 of its bandwidth */
static const double HOST_RATE = 32.0 * 1e9 * 0.8;   /* its PCIe 4.0 x16 link at HEXISEQ_HOST_LINK_EFF */

/* Model states of one device holding everything (ZeRO-3 over one device): three gathered layers (the largest of a
 * layer's 464 parameters and the 256 of the embedding) and 16 bytes per parameter of P = 6 * 464 + 2 * 256 + 8. */
static double states_bytes(void) { return 3.0 * 464.0 * b + 16.0 * (6.0 * 464.0 + 2.0 * 256.0 + 8.0); }
/* The same with even shares over two devices: each holds half of the sharded 16 bytes per parameter. */
static double states_bytes_of_two(void) { return 3.0 * 464.0 * b + 8.0 * (6.0 * 464.0 + 2.0 * 256.0 + 8.0); }

/* Bytes on the device for n tokens (one group of n) with features f. */
static double device_bytes(double n, int f) {
    double per = 96.0 + 144.0 + 320.0 + 128.0, tile = 0.0;
    if (f & HEXISEQ_OFFLOAD)
        per -= 64.0;
    if (f & HEXISEQ_TILE_MLP)
        per -= 64.0, tile += 64.0;
    if (f & HEXISEQ_TILE_LOSS)
        per -= 320.0, tile += 320.0;
    return states_bytes() + per * n + tile * fmin(n, TILE);
}

static double gemm_rate(double rows) { return PEAK * 1e12 * EFF * rows / (rows + 128.0); }

/* What tiling adds, by hand: the MLP (2 * 2F * H = 512 FLOPs a token forward) runs its 4 passes (forward,
 * recompute, backward of two) plus one at a tile's rows, and its activation (2F elements) once more; the head
 * (2 H V = 512) runs 3 passes plus one at a tile's rows, and the logits and their softmax (V (b + 4) bytes) once more. */
static double tiling_s(double n, int f) {
    double s = 0.0;
    if (f & HEXISEQ_TILE_MLP)
        s += L * n * 512.0 * (5.0 / gemm_rate(fmin(n, TILE)) - 4.0 / gemm_rate(n)) + L * n * 2.0 * F * b / MEM_RATE;
    if (f & HEXISEQ_TILE_LOSS)
        s += n * 2.0 * H * V * (4.0 / gemm_rate(fmin(n, TILE)) - 3.0 / gemm_rate(n)) + n * V * (b + 4.0) / MEM_RATE;
    return s;
}

/* One device, one group of all n tokens, `mem_gib` of memory, host memory `host_gib` (<= 0: the default) and a
 * measured host link (<= 0: the catalog's). */
static void one_device(double n, double mem_gib, double host_gib, double host_gbps, int features,
                       hexiseq_device_cost *dc, hexiseq_plan_cost *pc) {
    hexiseq_node_desc nd = {"A100-80G", 1, 100.0, mem_gib, PEAK, EFF, EFF, host_gib};
    hexiseq_device_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.host_gbps = host_gbps;
    hexiseq_cluster_options opt = {&dd, NULL};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &opt, &c));
    hexiseq_training t = {1, 1, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, features};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(1, 1, &l));
    l.group_size[0] = 1, l.group_seq[0] = (int64_t)n, l.device[0] = 0, l.tokens[0] = (int64_t)n;
    l.head_lo[0] = 0, l.head_count[0] = 4;
    EXPECT_OK(hexiseq_evaluate(c, &M6, &t, (int64_t)n, 1, &l, dc, pc));
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

static void test_choice(void) {
    const double n = 100000;
    hexiseq_device_cost none, dc;
    hexiseq_plan_cost pnone, pc;
    /* room for everything: no feature, and the same numbers as a training that allows none */
    double roomy = device_bytes(n, 0) / GIB * 1.01;
    one_device(n, roomy, 0, 0, 0, &none, &pnone);
    one_device(n, roomy, 0, 0, HEXISEQ_MEMORY_FEATURES_ALL, &dc, &pc);
    EXPECT(dc.features == 0 && pc.fits, "room for everything: features %d", dc.features);
    NEAR(dc.mem_total_gib, device_bytes(n, 0) / GIB, "memory without features");
    EXPECT(pc.step_time_s == pnone.step_time_s && dc.busy_s == none.busy_s, "the same step with features allowed");
    NEAR(dc.host_cap_gib, 2.0 * roomy, "host memory by default: twice the device's");
    /* short of 30 bytes a token: offloading alone fits and its copies hide behind the attention (62.5 us a layer
     * against milliseconds), so it costs nothing and is chosen */
    double mem = (device_bytes(n, 0) - 30.0 * n) / GIB;
    one_device(n, mem, 0, 0, HEXISEQ_MEMORY_FEATURES_ALL, &dc, &pc);
    EXPECT(dc.features == HEXISEQ_OFFLOAD && pc.fits, "offload chosen: %d", dc.features);
    NEAR(dc.mem_total_gib, device_bytes(n, HEXISEQ_OFFLOAD) / GIB, "memory with offload");
    NEAR(dc.mem_host_gib, 96.0 * n / GIB, "host memory of the checkpoints");
    EXPECT(n * H * b / HOST_RATE < dc.attn_s / (L * 4.5), "a copy is shorter than a layer's attention forward");
    EXPECT(dc.offload_s == 0.0 && dc.tiling_s == 0.0, "hidden copies: %g %g", dc.offload_s, dc.tiling_s);
    EXPECT(pc.step_time_s == pnone.step_time_s, "a hidden offload adds nothing to the step");
    /* offloading not allowed: the tiled loss saves more than the tiled MLP; either fits: the cheaper is chosen */
    int tiles = HEXISEQ_TILE_MLP | HEXISEQ_TILE_LOSS;
    one_device(n, mem, 0, 0, tiles, &dc, &pc);
    int cheaper = tiling_s(n, HEXISEQ_TILE_MLP) < tiling_s(n, HEXISEQ_TILE_LOSS) ? HEXISEQ_TILE_MLP : HEXISEQ_TILE_LOSS;
    EXPECT(dc.features == cheaper && pc.fits, "the cheaper tiling: got %d, want %d", dc.features, cheaper);
    NEAR(dc.tiling_s, tiling_s(n, cheaper), "tiling time");
    NEAR(dc.mem_total_gib, device_bytes(n, cheaper) / GIB, "tiled memory");
    NEAR(pc.gemm_phase_s, dc.gemm_s + dc.mem_bound_s + dc.tiling_s, "tiling is in the token-parallel phase");
    NEAR(pc.step_time_s - pnone.step_time_s, dc.tiling_s, "and in the step");
    /* the host too small for the checkpoints: no offloading, tiling instead */
    one_device(n, mem, 95.0 * n / GIB, 0, HEXISEQ_MEMORY_FEATURES_ALL, &dc, &pc);
    EXPECT(dc.features == cheaper && pc.fits, "host too small: got %d", dc.features);
    /* only all three fit */
    mem = (device_bytes(n, HEXISEQ_MEMORY_FEATURES_ALL) + 1000.0) / GIB;
    one_device(n, mem, 0, 0, HEXISEQ_MEMORY_FEATURES_ALL, &dc, &pc);
    EXPECT(dc.features == HEXISEQ_MEMORY_FEATURES_ALL && pc.fits, "all three: %d", dc.features);
    NEAR(dc.mem_total_gib, device_bytes(n, HEXISEQ_MEMORY_FEATURES_ALL) / GIB, "memory with all three");
    NEAR(dc.tiling_s, tiling_s(n, tiles), "both tilings' time");
    /* nothing fits: the least short, all three, and the plan says it does not fit */
    one_device(n, mem - 2000.0 / GIB, 0, 0, HEXISEQ_MEMORY_FEATURES_ALL, &dc, &pc);
    EXPECT(dc.features == HEXISEQ_MEMORY_FEATURES_ALL && !pc.fits, "least short: %d fits %d", dc.features, pc.fits);
    NEAR(pc.short_gib, 1000.0 / GIB, "short by 1000 bytes");
    /* no checkpointing: no offloading (the checkpoints are what it moves) */
    hexiseq_node_desc nd = {"A100-80G", 1, 100.0, (device_bytes(n, 0) - 30.0 * n) / GIB, PEAK, EFF, EFF, 0.0};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(1, &nd, 10.0, NULL, &c));
    hexiseq_training t = {1, 0, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, HEXISEQ_OFFLOAD};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(1, 1, &l));
    l.group_size[0] = 1, l.group_seq[0] = (int64_t)n, l.device[0] = 0, l.tokens[0] = (int64_t)n, l.head_count[0] = 4;
    EXPECT_OK(hexiseq_evaluate(c, &M6, &t, (int64_t)n, 1, &l, &dc, &pc));
    EXPECT(dc.features == 0 && !pc.fits, "no offload without checkpointing: %d", dc.features);
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

/* A host link so slow that the copies show: per layer, one copy out during the forward and one back during the
 * backward with recompute, each exposed beyond the compute it overlaps. */
static void test_exposed_copies(void) {
    const double n = 100000, gbps = 1e-3;
    hexiseq_device_cost dc;
    hexiseq_plan_cost pc;
    double mem = (device_bytes(n, 0) - 30.0 * n) / GIB;
    one_device(n, mem, 0, gbps, HEXISEQ_OFFLOAD, &dc, &pc);
    EXPECT(dc.features == HEXISEQ_OFFLOAD, "offload: %d", dc.features);
    double copy = n * H * b / (gbps * 1e9);
    /* the layer's compute, from the terms of one layer the device reports: matmuls and memory-bound work (forward
     * = a third of forward + backward), attention (4.5 forwards a layer with recompute) */
    double gemm_fwd = dc.layer_gemm_s / 3.0, mem_fwd = dc.layer_mem_bound_s / 3.0, attn_fwd = dc.attn_s / (L * 4.5);
    double fwd = gemm_fwd + attn_fwd + mem_fwd, bwd = 3.0 * gemm_fwd + 3.5 * attn_fwd + 3.0 * mem_fwd;
    NEAR(dc.offload_s, L * ((copy - fwd) + (copy - bwd)), "exposed copies");
    EXPECT(copy > bwd, "the copy is the longer (%g > %g)", copy, bwd);
    NEAR(pc.gemm_phase_s, dc.gemm_s + dc.mem_bound_s + dc.offload_s, "offload is in the token-parallel phase");
}

/* Two equally fast devices, one short of memory for an even share without features. Without them the planner gives
 * it less; a feature lets it take about its even share, which is predicted faster, and the larger device uses
 * nothing. */
static void test_scheduler(void) {
    const int64_t S = 200000;
    double big = device_bytes((double)S, 0) / GIB, small = (device_bytes(S / 2.0, 0) - 60.0 * S / 2.0) / GIB;
    hexiseq_node_desc nd[2] = {{"A100-80G", 1, 100.0, big, PEAK, EFF, EFF, 0.0},
                               {"A100-80G", 1, 100.0, small, PEAK, EFF, EFF, 0.0}};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(2, nd, 10.0, NULL, &c));
    hexiseq_training off = {1, 1, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    hexiseq_training on = off;
    on.memory_features = HEXISEQ_MEMORY_FEATURES_ALL;
    hexiseq_layout lo, ln;
    hexiseq_plan_cost co, cn;
    EXPECT_OK(hexiseq_plan_strategy(c, &M6, &off, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &lo, &co));
    EXPECT_OK(hexiseq_plan_strategy(c, &M6, &on, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &ln, &cn));
    EXPECT(co.fits && cn.fits, "both fit");
    EXPECT(cn.step_time_s < co.step_time_s, "features make it faster: %g vs %g", cn.step_time_s, co.step_time_s);
    hexiseq_device_cost per[2];
    hexiseq_plan_cost again;
    EXPECT_OK(hexiseq_evaluate(c, &M6, &on, S, 1, &ln, per, &again));
    for (int r = 0; r < 2; ++r) /* (a ring of the two: its K, V buffers leave the small one short of more than
                                   offloading saves; the tiled loss is the cheapest that fits) */
        EXPECT((per[r].features != 0) == (ln.device[r] == 1) && per[r].mem_total_gib <= per[r].mem_cap_gib,
               "device %d uses %d", ln.device[r], per[r].features);
    hexiseq_layout_free(&lo);
    hexiseq_layout_free(&ln);
    /* memory for nothing beyond the states and a few tokens each without features: only they fit */
    nd[0].memory_gib = nd[1].memory_gib = (device_bytes(S / 2.0, HEXISEQ_MEMORY_FEATURES_ALL) + 1e6) / GIB;
    hexiseq_cluster_destroy(c);
    EXPECT_OK(hexiseq_cluster_create(2, nd, 10.0, NULL, &c));
    EXPECT(hexiseq_plan_strategy(c, &M6, &off, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &lo, &co) == HEXISEQ_ERR_MEMORY,
           "nothing fits without features");
    hexiseq_layout_free(&lo);
    EXPECT_OK(hexiseq_plan_strategy(c, &M6, &on, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &ln, &cn));
    EXPECT(cn.fits, "with them it fits");
    hexiseq_layout_free(&ln);
    hexiseq_cluster_destroy(c);
}

/* Longest S with plan_strategy fitting (1 fits; bisection, so exact only where fitting is monotone in S). */
static int64_t longest_planned(const hexiseq_cluster *c, const hexiseq_training *t, int64_t hi) {
    int64_t lo = 1;
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        hexiseq_layout l;
        hexiseq_plan_cost pc;
        hexiseq_status st = hexiseq_plan_strategy(c, &M6, t, mid, 1, HEXISEQ_STRATEGY_HEXISEQ, &l, &pc);
        hexiseq_layout_free(&l); /* also set when the status says it does not fit (the closest plan) */
        if (st == HEXISEQ_OK && pc.fits)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The memory bound on the longest sequence, by hand from the bytes per token above: without features each token
 * takes 560 of activations and 128 of attention; with all three 112 + 128 = 240 while the host holds its 96 bytes of
 * checkpoints, and 176 + 128 = 304 without offloading. */
static void test_tokens_bound(void) {
    hexiseq_training off = {1, 1, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 0};
    hexiseq_training on = off;
    on.memory_features = HEXISEQ_MEMORY_FEATURES_ALL;
    /* one device with room for 100,000 tokens and half a token more: exact, the scheduler's longest */
    hexiseq_node_desc nd = {"A100-80G", 1, 100.0, (states_bytes() + 688.0 * 100000 + 344.0) / GIB, PEAK, EFF, EFF,
                            96.0 * 50000 / GIB};
    hexiseq_cluster *c = NULL;
    EXPECT_OK(hexiseq_cluster_create(1, &nd, 10.0, NULL, &c));
    EXPECT(hexiseq_memory_tokens_bound(c, &M6, &off) == 100000, "one device, no features: %lld",
           (long long)hexiseq_memory_tokens_bound(c, &M6, &off));
    EXPECT(longest_planned(c, &off, 200000) == 100000, "the scheduler's longest is the bound on one device");
    /* with the features: 50,000 tokens' checkpoints on the host (240 bytes each), the rest at 304 */
    double room = 688.0 * 100000 + 344.0;
    int64_t want = 50000 + (int64_t)floor((room - 240.0 * 50000) / 304.0);
    EXPECT(hexiseq_memory_tokens_bound(c, &M6, &on) == want, "one device, features: %lld, want %lld",
           (long long)hexiseq_memory_tokens_bound(c, &M6, &on), (long long)want);
    int64_t got = longest_planned(c, &on, 2 * want);
    EXPECT(got <= want && got > 100000, "the scheduler's longest with features, %lld, within (100000, %lld]",
           (long long)got, (long long)want);
    hexiseq_cluster_destroy(c);
    /* two devices of unequal memory (each holding half the sharded states): the sum of their rooms, never below
     * what the scheduler fits */
    hexiseq_node_desc two[2] = {nd, nd};
    two[1].memory_gib = (states_bytes() + 688.0 * 30000) / GIB;
    EXPECT_OK(hexiseq_cluster_create(2, two, 10.0, NULL, &c));
    int64_t bound = hexiseq_memory_tokens_bound(c, &M6, &off);
    double rooms = two[0].memory_gib * GIB + two[1].memory_gib * GIB - 2.0 * states_bytes_of_two();
    EXPECT(bound == (int64_t)floor(rooms / 688.0), "two devices, no features: %lld, want %lld", (long long)bound,
           (long long)floor(rooms / 688.0));
    got = longest_planned(c, &off, 2 * bound);
    EXPECT(got <= bound && got >= 0.95 * bound, "the scheduler's longest on two, %lld, within 5%% under %lld",
           (long long)got, (long long)bound);
    /* a device without room for its states adds nothing */
    two[1].memory_gib = 0.5 * states_bytes() / GIB;
    hexiseq_cluster_destroy(c);
    EXPECT_OK(hexiseq_cluster_create(2, two, 10.0, NULL, &c));
    rooms = two[0].memory_gib * GIB - states_bytes_of_two();
    EXPECT(hexiseq_memory_tokens_bound(c, &M6, &off) == (int64_t)floor(rooms / 688.0),
           "a device short of its states adds nothing: %lld", (long long)hexiseq_memory_tokens_bound(c, &M6, &off));
    hexiseq_cluster_destroy(c);
}

static void test_garbage(void) {
    hexiseq_node_desc nd = {"A100-80G", 1, 100.0, 0, 0, 0, 0, NAN};
    hexiseq_cluster *c = NULL;
    EXPECT(hexiseq_cluster_create(1, &nd, 10.0, NULL, &c) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "host_memory_gib"),
           "a NaN host memory is refused by name: %s", hexiseq_last_error());
    nd.host_memory_gib = 0;
    hexiseq_device_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.host_gbps = INFINITY;
    hexiseq_cluster_options opt = {&dd, NULL};
    EXPECT(hexiseq_cluster_create_ex(1, &nd, 10.0, NULL, &opt, &c) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "host_gbps"),
           "an infinite host link is refused by name: %s", hexiseq_last_error());
    EXPECT_OK(hexiseq_cluster_create(1, &nd, 10.0, NULL, &c));
    hexiseq_training t = {1, 1, HEXISEQ_SHARD_FULL, 0.0, HEXISEQ_STATES_EVEN, NULL, 8};
    hexiseq_layout l;
    EXPECT_OK(hexiseq_layout_alloc(1, 1, &l));
    l.group_size[0] = 1, l.group_seq[0] = 64, l.tokens[0] = 64, l.head_count[0] = 4;
    hexiseq_device_cost dc;
    hexiseq_plan_cost pc;
    EXPECT(hexiseq_evaluate(c, &M6, &t, 64, 1, &l, &dc, &pc) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "training.memory_features"),
           "a mask out of range is refused by name: %s", hexiseq_last_error());
    int64_t lo = -1, hi = -1;
    EXPECT_OK(hexiseq_int_range("training.memory_features", &lo, &hi));
    EXPECT(lo == 0 && hi == HEXISEQ_MEMORY_FEATURES_ALL, "range [%lld, %lld]", (long long)lo, (long long)hi);
    hexiseq_gpu_spec spec;
    EXPECT_OK(hexiseq_gpu_find("H100", &spec));
    EXPECT(spec.host_gbps == 64.0, "H100's PCIe 5.0 x16: %g", spec.host_gbps);
    for (int i = 0; i < hexiseq_gpu_catalog_size(); ++i) {
        EXPECT_OK(hexiseq_gpu_catalog_get(i, &spec));
        /* PCIe 3.0 to 5.0 x16, or a Grace superchip's NVLink-C2C share (GB200: 225 GB/s per GPU and direction) */
        double most = strncmp(spec.name, "GB", 2) == 0 ? 450.0 : 64.0;
        EXPECT(spec.host_gbps >= 16.0 && spec.host_gbps <= most, "%s host link %g", spec.name, spec.host_gbps);
    }
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

int main(void) {
    test_choice();
    test_exposed_copies();
    test_scheduler();
    test_tokens_bound();
    test_garbage();
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
