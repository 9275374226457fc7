/* Planning limits through the C API: a time limit returns a valid plan marked stopped early, a progress
 * callback that asks to stop ends the call with HEXISEQ_ERR_CANCELLED and nothing allocated, a callback
 * that never asks changes nothing, and bad limits are refused. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hexiseq.h"

#include "check.h"

#define CHECK EXPECT

/* Nodes of 8 cycling H100-SXM, A100-80G, A800, L40S (benchmarks/planner_scaling.py). */
static hexiseq_cluster *cluster_of(int32_t n) {
    static const char *gpu[4] = {"H100-SXM", "A100-80G", "A800", "L40S"};
    static const double nvlink[4] = {450, 300, 200, 32};
    int32_t nodes_n = n / 8;
    hexiseq_node_desc *nodes = calloc((size_t)nodes_n, sizeof *nodes);
    for (int32_t i = 0; i < nodes_n; ++i) {
        nodes[i].gpu = gpu[i % 4];
        nodes[i].count = 8;
        nodes[i].intra_gbps = nvlink[i % 4];
    }
    hexiseq_cluster *c = NULL;
    if (hexiseq_cluster_create(nodes_n, nodes, 25.0, NULL, &c) != HEXISEQ_OK)
        c = NULL;
    free(nodes);
    return c;
}

static const hexiseq_model LLAMA70 = {80, 8192, 64, 8, 128, 28672, 128256, 2, 1, 0, 0, 0, 0};

static int calls;
static int stop_at_first(void *user) {
    (void)user;
    ++calls;
    return 1;
}
static int never_stop(void *user) {
    ++*(int *)user;
    return 0;
}

/* The plan is a complete layout the cost model accepts, and it fits. */
static void check_valid(const hexiseq_cluster *c, const hexiseq_training *t, int64_t S, const hexiseq_layout *l,
                        const char *what) {
    int32_t n = hexiseq_cluster_num_devices(c);
    hexiseq_device_cost *per = calloc((size_t)n, sizeof *per);
    hexiseq_plan_cost pc;
    hexiseq_status st = hexiseq_evaluate(c, &LLAMA70, t, S, 1, l, per, &pc);
    CHECK(st == HEXISEQ_OK && pc.fits, "%s: the plan does not evaluate or fit: %s", what, hexiseq_last_error());
    free(per);
}

int main(void) {
    hexiseq_training t;
    hexiseq_training_default(&t);
    t.checkpointing = 1;

    /* a tiny time limit on a large cluster */
    hexiseq_cluster *big = cluster_of(4096);
    CHECK(big != NULL, "cluster");
    int64_t S = (int64_t)8192 * 4096;
    hexiseq_plan_options opt = {0.001, NULL, NULL};
    hexiseq_layout l;
    hexiseq_plan_cost pc;
    hexiseq_plan_info info;
    hexiseq_status st = hexiseq_plan_strategy_ex(big, &LLAMA70, &t, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &opt, &l, &pc, &info);
    CHECK(st == HEXISEQ_OK, "time limit: %s", hexiseq_last_error());
    CHECK(info.stopped_early == 1 && info.evaluations >= 1, "stopped_early %d after %lld", info.stopped_early,
          (long long)info.evaluations);
    CHECK(info.elapsed_s < 5.0, "a 1 ms limit took %.3f s", info.elapsed_s);
    if (st == HEXISEQ_OK) {
        check_valid(big, &t, S, &l, "time limit");
        hexiseq_layout_free(&l);
    }
    /* the baselines stop too */
    st = hexiseq_plan_strategy_ex(big, &LLAMA70, &t, S, 1, HEXISEQ_STRATEGY_USP, &opt, &l, &pc, &info);
    CHECK(st == HEXISEQ_OK && info.stopped_early == 1, "usp with a time limit: %d %s", st, hexiseq_last_error());
    if (st == HEXISEQ_OK)
        hexiseq_layout_free(&l);

    /* a callback that asks to stop: cancelled, nothing left allocated */
    calls = 0;
    opt = (hexiseq_plan_options){0.0, stop_at_first, NULL};
    st = hexiseq_plan_strategy_ex(big, &LLAMA70, &t, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &opt, &l, &pc, &info);
    CHECK(st == HEXISEQ_ERR_CANCELLED && calls == 1, "cancel: status %d after %d calls", st, calls);
    CHECK(l.group_size == NULL && l.device == NULL, "a cancelled call leaves no layout");
    CHECK(strstr(hexiseq_last_error(), "cancelled") != NULL, "message: %s", hexiseq_last_error());
    CHECK(strcmp(hexiseq_status_string(HEXISEQ_ERR_CANCELLED), "cancelled") == 0, "status string");
    hexiseq_cluster_destroy(big);

    /* a callback that never stops and a generous limit change nothing */
    hexiseq_cluster *small = cluster_of(64);
    int64_t S2 = (int64_t)8192 * 64;
    hexiseq_layout a, b;
    hexiseq_plan_cost ca, cb;
    int count = 0;
    opt = (hexiseq_plan_options){600.0, never_stop, &count};
    hexiseq_status s1 = hexiseq_plan_strategy(small, &LLAMA70, &t, S2, 1, HEXISEQ_STRATEGY_HEXISEQ, &a, &ca);
    hexiseq_status s2 = hexiseq_plan_strategy_ex(small, &LLAMA70, &t, S2, 1, HEXISEQ_STRATEGY_HEXISEQ, &opt, &b, &cb, &info);
    CHECK(s1 == HEXISEQ_OK && s2 == HEXISEQ_OK && info.stopped_early == 0, "plain %d, with options %d", s1, s2);
    CHECK(ca.step_time_s == cb.step_time_s && a.n_groups == b.n_groups, "same plan: %.17g vs %.17g", ca.step_time_s,
          cb.step_time_s);
    CHECK(info.elapsed_s < 0.06 || count >= 1, "the callback ran %d times in %.3f s", count, info.elapsed_s);
    if (s1 == HEXISEQ_OK)
        hexiseq_layout_free(&a);
    if (s2 == HEXISEQ_OK)
        hexiseq_layout_free(&b);

    /* bad limits */
    opt = (hexiseq_plan_options){NAN, NULL, NULL};
    st = hexiseq_plan_strategy_ex(small, &LLAMA70, &t, S2, 1, HEXISEQ_STRATEGY_HEXISEQ, &opt, &l, &pc, NULL);
    CHECK(st == HEXISEQ_ERR_INVALID && strstr(hexiseq_last_error(), "time_limit_s"), "NaN limit: %d %s", st,
          hexiseq_last_error());
    opt = (hexiseq_plan_options){INFINITY, NULL, NULL};
    st = hexiseq_plan_strategy_ex(small, &LLAMA70, &t, S2, 1, HEXISEQ_STRATEGY_HEXISEQ, &opt, &l, &pc, NULL);
    CHECK(st == HEXISEQ_ERR_INVALID, "infinite limit: %d", st);
    hexiseq_cluster_destroy(small);

    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
