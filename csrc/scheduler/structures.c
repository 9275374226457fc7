/* Stage 1 of the scheduler (scheduler.c): group structures from the topology (node splits per class of identical nodes,
 * groups of consecutive devices, every partition of a small cluster), each optimised by the lower levels. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "levels.h"

/* ------------------------------------------------------------------ structures */

/* Node classes: nodes with the same GPU model, size and overrides take the same split. */
typedef struct {
    int32_t n_nodes;
    int32_t *node_first; /* [n_nodes] first device of each node */
    int32_t *node_count; /* [n_nodes] */
    int32_t *node_class; /* [n_nodes] */
    int32_t n_classes;
    int32_t *class_options;  /* [n_classes] number of split options */
    int32_t *choice;         /* [n_classes] current option: node split into 2^choice parts (capped) */
} topo;

/* Devices a .. a + count and b .. b + count alike one by one (measured curves may differ per device). */
static int same_devices(const hexiseq_cluster *c, int32_t a, int32_t b, int32_t count) {
    for (int32_t i = 0; i < count; ++i)
        if (!hexiseq_same_device(&c->dev[a + i], &c->dev[b + i]))
            return 0;
    return 1;
}

/* Clusters whose node classes' split options multiply to at most this many structures try them all; larger ones
 * descend coordinate-wise from the best uniform split. */
#define TOPOLOGY_PRODUCT 64

/* Parts of a node of `count` devices under option o: min(2^o, count). */
static int32_t parts_of(int32_t count, int32_t o) {
    int64_t p = (int64_t)1 << (o < 30 ? o : 30);
    return p < count ? (int32_t)p : count;
}

static int32_t options_of(int32_t count) {
    int32_t o = 0;
    while (((int64_t)1 << o) < count)
        ++o;
    return o + 1;
}

/* Build groups in node order from the current choices: node k split into parts near-equal pieces. */
static hexiseq_status build_structure(const sched *s, const topo *tp, hexiseq_layout *l) {
    int32_t G = 0;
    for (int32_t k = 0; k < tp->n_nodes; ++k)
        G += parts_of(tp->node_count[k], tp->choice[tp->node_class[k]]);
    HEXISEQ_CHECK(hexiseq_layout_alloc(G, s->n, l));
    int32_t g = 0;
    for (int32_t k = 0; k < tp->n_nodes; ++k) {
        int32_t p = parts_of(tp->node_count[k], tp->choice[tp->node_class[k]]);
        for (int32_t i = 0; i < p; ++i)
            l->group_size[g++] = (int32_t)hexiseq_even_share(tp->node_count[k], p, i);
    }
    for (int32_t r = 0; r < s->n; ++r)
        l->device[r] = r;
    return HEXISEQ_OK;
}

/* Optimise one structure (head units 1 and, with GQA, whole kv heads) and try its ring orders.
 * `score` gets the best predicted step time found for it (INFINITY if it fits nowhere). */
hexiseq_status hexiseq_sched_run_structure(sched *s, hexiseq_layout *l, double *score) {
    shares_ws w;
    hexiseq_status st = hexiseq_sched_ws_alloc(&w, l->n_groups, s->n);
    *score = INFINITY;
    int32_t per_kv = s->m->heads / s->m->kv_heads;
    for (int unit_pass = 0; unit_pass < (per_kv > 1 ? 2 : 1) && st == HEXISEQ_OK; ++unit_pass) {
        hexiseq_plan_cost cost;
        cost.fits = 0;
        st = hexiseq_sched_optimise_shares(s, l, &w, unit_pass ? per_kv : 1, &cost);
        if (st == HEXISEQ_OK && cost.fits && cost.step_time_s < *score)
            *score = cost.step_time_s;
        /* small clusters: polish every structure that comes close, not only the winner, so a structure
         * whose LP shares were slightly off is not lost */
        if (st == HEXISEQ_OK && s->n <= EXACT_PARTITION_DEVICES && cost.fits && s->have_best &&
            cost.step_time_s <= s->best_cost.step_time_s * 1.05)
            st = hexiseq_sched_local_search(s, l, &cost, LOCAL_SEARCH_EVALS_STRUCT);
        if (st == HEXISEQ_OK)
            st = hexiseq_sched_try_orders(s, l);
    }
    hexiseq_sched_ws_free(&w);
    return st;
}

/* Groups of `hp` consecutive devices (they may span nodes). */
hexiseq_status hexiseq_sched_run_consecutive(sched *s, int32_t hp) {
    hexiseq_layout l;
    HEXISEQ_CHECK(hexiseq_layout_alloc(s->n / hp, s->n, &l));
    for (int32_t g = 0; g < l.n_groups; ++g)
        l.group_size[g] = hp;
    for (int32_t r = 0; r < s->n; ++r)
        l.device[r] = r;
    double score;
    hexiseq_status st = hexiseq_sched_run_structure(s, &l, &score);
    hexiseq_layout_free(&l);
    return st;
}

/* Every partition of the active devices of a small cluster into groups (restricted growth strings:
 * device i joins one of the groups opened before it or opens the next); members ascending, groups in
 * order of their first device; parked devices (zero rate in s->fgemm) join the first group. */
hexiseq_status hexiseq_sched_run_all_partitions(sched *s) {
    int32_t n = s->n, active[EXACT_PARTITION_DEVICES], parked[EXACT_PARTITION_DEVICES], k = 0, p = 0;
    for (int32_t d = 0; d < n; ++d) {
        if (s->fgemm[d] > 0)
            active[k++] = d;
        else
            parked[p++] = d;
    }
    if (k == 0)
        return HEXISEQ_OK;
    int32_t a[EXACT_PARTITION_DEVICES] = {0}, maxv[EXACT_PARTITION_DEVICES] = {0};
    hexiseq_status st = HEXISEQ_OK;
    for (;;) {
        int32_t G = maxv[k - 1] + 1;
        hexiseq_layout l;
        st = hexiseq_layout_alloc(G, n, &l);
        if (st != HEXISEQ_OK)
            return st;
        int32_t r = 0;
        for (int32_t g = 0; g < G; ++g) {
            for (int32_t i = 0; i < k; ++i)
                if (a[i] == g) {
                    l.group_size[g]++;
                    l.device[r++] = active[i];
                }
            if (g == 0)
                for (int32_t i = 0; i < p; ++i) {
                    l.group_size[0]++;
                    l.device[r++] = parked[i];
                }
        }
        double score;
        st = hexiseq_sched_run_structure(s, &l, &score);
        hexiseq_layout_free(&l);
        if (st != HEXISEQ_OK)
            return st;
        /* next restricted growth string */
        int32_t i = k - 1;
        while (i > 0 && a[i] == maxv[i - 1] + 1)
            --i;
        if (i == 0)
            break;
        a[i]++;
        maxv[i] = a[i] > maxv[i - 1] ? a[i] : maxv[i - 1];
        for (int32_t j = i + 1; j < k; ++j) {
            a[j] = 0;
            maxv[j] = maxv[i];
        }
    }
    return st;
}

/* The score of the structure the current class choices make: built, run through the structure level, freed. */
static hexiseq_status score_choice(sched *s, const topo *tp, double *score) {
    hexiseq_layout l;
    hexiseq_status st = build_structure(s, tp, &l);
    if (st != HEXISEQ_OK)
        return st;
    st = hexiseq_sched_run_structure(s, &l, score);
    hexiseq_layout_free(&l);
    return st;
}

hexiseq_status hexiseq_sched_run_topology(sched *s) {
    const hexiseq_cluster *c = s->c;
    topo tp;
    memset(&tp, 0, sizeof tp);
    tp.n_nodes = c->n_nodes;
    tp.node_first = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.node_count = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.node_class = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.class_options = calloc((size_t)c->n_nodes, sizeof(int32_t));
    tp.choice = calloc((size_t)c->n_nodes, sizeof(int32_t));
    hexiseq_status st = HEXISEQ_OK;
    if (!tp.node_first || !tp.node_count || !tp.node_class || !tp.class_options || !tp.choice) {
        st = hexiseq_fail(HEXISEQ_ERR_NOMEM, "scheduler scratch");
        goto out;
    }
    for (int32_t r = 0; r < s->n; ++r) {
        int32_t k = c->dev[r].node;
        if (tp.node_count[k]++ == 0)
            tp.node_first[k] = r;
    }
    for (int32_t k = 0; k < tp.n_nodes; ++k) {
        int32_t cls = -1;
        for (int32_t j = 0; j < k && cls < 0; ++j)
            if (tp.node_count[j] == tp.node_count[k] && c->intra_gbps[j] == c->intra_gbps[k] &&
                same_devices(c, tp.node_first[j], tp.node_first[k], tp.node_count[k]))
                cls = tp.node_class[j];
        if (cls < 0) {
            cls = tp.n_classes++;
            tp.class_options[cls] = options_of(tp.node_count[k]);
        }
        tp.node_class[k] = cls;
    }
    int32_t max_options = 0;
    int64_t product = 1;
    for (int32_t cl = 0; cl < tp.n_classes; ++cl) {
        if (tp.class_options[cl] > max_options)
            max_options = tp.class_options[cl];
        product = product > TOPOLOGY_PRODUCT ? product : product * tp.class_options[cl];
    }
    if (product <= TOPOLOGY_PRODUCT) {
        /* few classes and options: every combination of the classes' splits (a descent from one start can stop
         * where one class's move alone does not fit memory but a move of two would) */
        memset(tp.choice, 0, (size_t)tp.n_classes * sizeof *tp.choice);
        for (;;) {
            double score;
            st = score_choice(s, &tp, &score);
            int32_t cl = 0;
            while (st == HEXISEQ_OK && cl < tp.n_classes && ++tp.choice[cl] == tp.class_options[cl])
                tp.choice[cl++] = 0;
            if (st != HEXISEQ_OK || cl == tp.n_classes)
                goto out;
        }
    }
    /* uniform starts: every class split the same way; keep the best as the descent's start */
    double best_score = INFINITY;
    int32_t best_uniform = 0;
    for (int32_t o = 0; o < max_options && st == HEXISEQ_OK; ++o) {
        for (int32_t cl = 0; cl < tp.n_classes; ++cl)
            tp.choice[cl] = o < tp.class_options[cl] ? o : tp.class_options[cl] - 1;
        double score;
        st = score_choice(s, &tp, &score);
        if (st != HEXISEQ_OK)
            break;
        if (score < best_score) {
            best_score = score;
            best_uniform = o;
        }
    }
    for (int32_t cl = 0; cl < tp.n_classes; ++cl)
        tp.choice[cl] = best_uniform < tp.class_options[cl] ? best_uniform : tp.class_options[cl] - 1;
    /* coordinate descent over the classes' splits */
    for (int round = 0; round < 3 && tp.n_classes > 1 && st == HEXISEQ_OK; ++round) {
        int moved = 0;
        for (int32_t cl = 0; cl < tp.n_classes && st == HEXISEQ_OK; ++cl) {
            int32_t keep = tp.choice[cl];
            for (int32_t o = 0; o < tp.class_options[cl] && st == HEXISEQ_OK; ++o) {
                if (o == keep)
                    continue;
                tp.choice[cl] = o;
                double score;
                st = score_choice(s, &tp, &score);
                if (st != HEXISEQ_OK)
                    break;
                if (score < best_score * (1.0 - 1e-9)) {
                    best_score = score;
                    keep = o;
                    moved = 1;
                }
            }
            tp.choice[cl] = keep;
        }
        if (!moved)
            break;
    }
out:
    free(tp.node_first);
    free(tp.node_count);
    free(tp.node_class);
    free(tp.class_options);
    free(tp.choice);
    return st;
}
