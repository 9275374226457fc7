/* Grouped pricing against step-by-step pricing: layouts of many groups whose sequence lengths take a few
 * values are priced by the cost model once per kind of ring step, large groups price their all-to-all
 * once per kind of peer on other nodes, and the scheduler's LP merges alike groups. Both must agree with the plain computation (hexiseq_grouped_above raised past the group count)
 * up to summation order: relative 1e-12 for cost terms; plans within 1e-9 of each other. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#include "check.h"

#define CHECK EXPECT

static int close_rel(double a, double b, double tol) { return fabs(a - b) <= tol * fmax(fabs(a), fabs(b)) + 1e-300; }

/* n_nodes nodes of `per` devices alternating H100-SXM (NVLink) and L40S (PCIe), 25 GB/s between nodes. */
static hexiseq_cluster *mixed_cluster(int32_t n_nodes, int32_t per) {
    hexiseq_node_desc *nodes = calloc((size_t)n_nodes, sizeof *nodes);
    for (int32_t i = 0; i < n_nodes; ++i) {
        nodes[i].gpu = i % 2 ? "L40S" : "H100-SXM";
        nodes[i].count = per;
        nodes[i].intra_gbps = i % 2 ? 32.0 : 450.0;
    }
    hexiseq_cluster *c = NULL;
    hexiseq_status st = hexiseq_cluster_create(n_nodes, nodes, 25.0, NULL, &c);
    free(nodes);
    return st == HEXISEQ_OK ? c : NULL;
}

static const hexiseq_model MODEL = {4, 1024, 16, 4, 64, 4096, 32000, 2, 1, 0, 0, 0, 0};

/* Groups of `k` consecutive devices; S_g cycles through three lengths; heads split unevenly in two
 * patterns; tokens split unevenly. */
static void make_layout(const hexiseq_cluster *c, int32_t k, hexiseq_layout *l, int64_t *seq_len) {
    int32_t n = hexiseq_cluster_num_devices(c), G = n / k;
    static const int64_t lens[3] = {1024, 3072, 2048};
    hexiseq_layout_alloc(G, n, l);
    *seq_len = 0;
    for (int32_t g = 0; g < G; ++g) {
        l->group_size[g] = k;
        l->group_seq[g] = lens[(g / 2) % 3];
        *seq_len += l->group_seq[g];
        int64_t left = l->group_seq[g];
        int32_t head = 0;
        for (int32_t i = 0; i < k; ++i) {
            int32_t r = g * k + i;
            l->device[r] = r;
            int64_t even = l->group_seq[g] / k; /* uneven: the first takes half a share from the second */
            l->tokens[r] = i == k - 1 ? left : even + (i == 0 ? even / 2 : i == 1 ? -(even / 2) : 0);
            left -= l->tokens[r];
            l->head_count[r] = i == k - 1 ? MODEL.heads - head : (g % 2 ? MODEL.heads / k + (i == 0 ? 1 : 0) : MODEL.heads / k);
            if (i == k - 1 && l->head_count[r] < 0)
                l->head_count[r] = 0;
            l->head_lo[r] = head;
            head += l->head_count[r];
        }
    }
}

static void test_ring_pricing(int32_t k, int32_t causal) {
    hexiseq_cluster *c = mixed_cluster(64, 4);
    CHECK(c != NULL, "cluster");
    if (!c)
        return;
    hexiseq_layout l;
    int64_t S;
    make_layout(c, k, &l, &S);
    hexiseq_training t;
    hexiseq_training_default(&t);
    t.checkpointing = 1;
    int32_t n = l.n_devices;
    hexiseq_device_cost *a = calloc((size_t)n, sizeof *a), *b = calloc((size_t)n, sizeof *b);
    hexiseq_plan_cost ca, cb;
    int32_t keep = hexiseq_grouped_above;
    hexiseq_grouped_above = 32; /* grouped: G = 256 / k > 32 groups, or k > 32 members */
    hexiseq_status s1 = hexiseq_evaluate(c, &MODEL, &t, S, causal, &l, a, &ca);
    hexiseq_grouped_above = 1 << 30; /* step by step */
    hexiseq_status s2 = hexiseq_evaluate(c, &MODEL, &t, S, causal, &l, b, &cb);
    hexiseq_grouped_above = keep;
    CHECK(s1 == HEXISEQ_OK && s2 == HEXISEQ_OK, "evaluate k=%d causal=%d: %s", k, causal, hexiseq_last_error());
    int bad = 0;
    for (int32_t r = 0; r < n && s1 == HEXISEQ_OK && s2 == HEXISEQ_OK; ++r) {
        bad += !close_rel(a[r].attn_s, b[r].attn_s, 1e-12);
        bad += !close_rel(a[r].ring_exposed_s, b[r].ring_exposed_s, 1e-12);
        bad += !close_rel(a[r].busy_s, b[r].busy_s, 1e-12);
        bad += !close_rel(a[r].a2a_s, b[r].a2a_s, 1e-12);
        bad += !close_rel(a[r].mem_total_gib, b[r].mem_total_gib, 1e-12);
    }
    CHECK(bad == 0, "k=%d causal=%d: %d per-device terms differ beyond 1e-12", k, causal, bad);
    CHECK(close_rel(ca.step_time_s, cb.step_time_s, 1e-12) && close_rel(ca.ring_phase_s, cb.ring_phase_s, 1e-12) &&
              close_rel(ca.grad_exposed_s, cb.grad_exposed_s, 1e-12),
          "k=%d causal=%d: step %.17g vs %.17g", k, causal, ca.step_time_s, cb.step_time_s);
    CHECK(cb.ring_phase_s > 0 && cb.step_time_s > cb.ring_phase_s, "k=%d: the ring is priced at all", k);
    free(a);
    free(b);
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

/* The scheduler with its LP merged by kind of group against the plain LP, on a 256-device cluster (64
 * groups when nodes stay whole, 128 and 256 when split). */
static void test_lp_merge(void) {
    hexiseq_cluster *c = mixed_cluster(64, 4);
    CHECK(c != NULL, "cluster");
    if (!c)
        return;
    hexiseq_training t;
    hexiseq_training_default(&t);
    t.checkpointing = 1;
    hexiseq_layout la, lb;
    hexiseq_plan_cost ca, cb;
    int32_t keep = hexiseq_grouped_above;
    hexiseq_status s1 = hexiseq_plan_strategy(c, &MODEL, &t, 1 << 20, 1, HEXISEQ_STRATEGY_HEXISEQ, &la, &ca);
    hexiseq_grouped_above = 1 << 30;
    hexiseq_status s2 = hexiseq_plan_strategy(c, &MODEL, &t, 1 << 20, 1, HEXISEQ_STRATEGY_HEXISEQ, &lb, &cb);
    hexiseq_grouped_above = keep;
    CHECK(s1 == HEXISEQ_OK && s2 == HEXISEQ_OK, "plan: %s", hexiseq_last_error());
    CHECK(close_rel(ca.step_time_s, cb.step_time_s, 1e-9), "grouped plan %.17g s vs plain %.17g s", ca.step_time_s,
          cb.step_time_s);
    printf("plan of 256 devices: grouped %.9f s, plain %.9f s (%d and %d groups)\n", ca.step_time_s, cb.step_time_s,
           la.n_groups, lb.n_groups);
    hexiseq_layout_free(&la);
    hexiseq_layout_free(&lb);
    hexiseq_cluster_destroy(c);
}

int main(void) {
    for (int32_t causal = 0; causal < 2; ++causal) {
        test_ring_pricing(1, causal);
        test_ring_pricing(2, causal);
        test_ring_pricing(4, causal);
        test_ring_pricing(64, causal);  /* 4 groups of 64: the all-to-all by kind of peer */
        test_ring_pricing(128, causal); /* and one ring step type per group pair */
    }
    test_lp_merge();
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
