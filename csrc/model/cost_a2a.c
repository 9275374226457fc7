/* Cost term: the all-to-all inside each group (Q/K/V in, O out, and their gradients), peer by peer, or once
 * per kind of peer behind the inter-node link in large groups. */
#include <math.h>
#include <stdlib.h>

#include "cost_terms.h"

/* What one member of an all-to-all pair holds, which sizes its part of each exchange. */
typedef struct {
    double h, s;      /* query heads held during attention, tokens held outside it */
    int32_t kv, first; /* kv heads those query heads read, and those of them the member first-holds */
} a2a_side;

/* One peer's part of slot r's all-to-all, added to the eight times (seconds; sent and received per exchange:
 * Q/K/V, O, dO, dQ/dK/dV) and four byte counts (forward sent, received; backward sent, received), `count`
 * times. The forward sends each member its tokens of the member's Q, K, V and gets back the attention output;
 * the backward sends dO the way the output came, and returns dQ with dK, dV of the first-held kv heads only
 * (a co-holder's share is reduced into the first holder before, hexiseq/runtime/ring.py). */
static void a2a_peer(const cost_ctx *x, double count, a2a_side me, a2a_side peer, double out_bw, double in_bw,
                     double out_lat, double in_lat, double *t, double *bytes) {
    double elem = (double)x->m->head_dim * x->m->dtype_bytes;
    double qkv_out = me.s * (peer.h + 2.0 * peer.kv), qkv_in = peer.s * (me.h + 2.0 * me.kv);
    double o_out = peer.s * me.h, o_in = me.s * peer.h;
    double g_out = peer.s * (me.h + 2.0 * me.first), g_in = me.s * (peer.h + 2.0 * peer.first);
    const double sent[4] = {qkv_out, o_out, o_in, g_out}, received[4] = {qkv_in, o_in, o_out, g_in};
    for (int i = 0; i < 4; ++i) { /* bytes over bandwidth, plus one message latency per non-empty message */
        t[2 * i] += count * (sent[i] * elem / out_bw + (sent[i] > 0 ? out_lat : 0.0));
        t[2 * i + 1] += count * (received[i] * elem / in_bw + (received[i] > 0 ? in_lat : 0.0));
    }
    bytes[0] += count * (qkv_out + o_out) * elem;
    bytes[1] += count * (qkv_in + o_in) * elem;
    bytes[2] += count * (o_in + g_out) * elem;
    bytes[3] += count * (o_out + g_in) * elem;
}

typedef struct {
    int64_t key0;
    int32_t key1, key2, key3, slot;
} slot_key;

static int cmp_slot_key(const void *a, const void *b) {
    const slot_key *p = a, *q = b;
    if (p->key0 != q->key0)
        return p->key0 < q->key0 ? -1 : 1;
    if (p->key1 != q->key1)
        return p->key1 < q->key1 ? -1 : 1;
    if (p->key2 != q->key2)
        return p->key2 < q->key2 ? -1 : 1;
    if (p->key3 != q->key3)
        return p->key3 < q->key3 ? -1 : 1;
    return (p->slot > q->slot) - (p->slot < q->slot);
}

/* Kinds of member of group g for the grouped all-to-all (see cost_ctx); x->a2a_kinds = 0 when the group is
 * small, links are given per pair, or kinds are nearly as many as members. Returns 0 when out of memory. */
int hexiseq_a2a_kinds_build(cost_ctx *x, int32_t g) {
    int32_t lo = x->offset[g], k = x->l->group_size[g], n = x->l->n_devices;
    x->a2a_group = g;
    x->a2a_kinds = 0;
    if (k <= hexiseq_grouped_above || x->c->bw || x->c->lat)
        return 1;
    if (!x->kind_of) { /* sized for the largest group once */
        x->kind_of = malloc((size_t)n * sizeof *x->kind_of);
        x->kind_tokens = malloc((size_t)n * sizeof *x->kind_tokens);
        x->kind_heads = malloc((size_t)n * sizeof *x->kind_heads);
        x->kind_kv = malloc((size_t)n * sizeof *x->kind_kv);
        x->kind_first = malloc((size_t)n * sizeof *x->kind_first);
        x->kind_count = malloc((size_t)n * sizeof *x->kind_count);
        x->by_node = malloc((size_t)n * sizeof *x->by_node);
        x->node_lo = malloc((size_t)n * sizeof *x->node_lo);
        x->node_hi = malloc((size_t)n * sizeof *x->node_hi);
        x->node_kind = malloc((size_t)n * sizeof *x->node_kind);
        if (!x->kind_of || !x->kind_tokens || !x->kind_heads || !x->kind_kv || !x->kind_first || !x->kind_count ||
            !x->by_node || !x->node_lo || !x->node_hi || !x->node_kind)
            return 0;
    }
    slot_key *keys = malloc((size_t)k * sizeof *keys);
    if (!keys)
        return 0;
    for (int32_t i = 0; i < k; ++i) {
        int32_t r = lo + i;
        keys[i] = (slot_key){x->l->tokens[r], x->l->head_count[r], x->kv_n[r], x->first_n[r], r};
    }
    qsort(keys, (size_t)k, sizeof *keys, cmp_slot_key);
    int32_t T = -1;
    for (int32_t i = 0; i < k; ++i) {
        if (i == 0 || keys[i].key0 != keys[i - 1].key0 || keys[i].key1 != keys[i - 1].key1 ||
            keys[i].key2 != keys[i - 1].key2 || keys[i].key3 != keys[i - 1].key3) {
            ++T;
            x->kind_tokens[T] = keys[i].key0;
            x->kind_heads[T] = keys[i].key1;
            x->kind_kv[T] = keys[i].key2;
            x->kind_first[T] = keys[i].key3;
            x->kind_count[T] = 0;
            x->node_kind[T] = 0;
        }
        x->kind_of[keys[i].slot] = T;
        x->kind_count[T]++;
    }
    ++T;
    if (T > k / 4) {
        free(keys);
        return 1;
    }
    for (int32_t i = 0; i < k; ++i)
        keys[i] = (slot_key){x->c->node_of[x->l->device[lo + i]], 0, 0, 0, lo + i};
    qsort(keys, (size_t)k, sizeof *keys, cmp_slot_key);
    for (int32_t i = 0, start = 0; i < k; ++i) {
        x->by_node[i] = keys[i].slot;
        if (i + 1 == k || keys[i + 1].key0 != keys[i].key0) {
            for (int32_t j = start; j <= i; ++j) {
                x->node_lo[keys[j].slot] = start;
                x->node_hi[keys[j].slot] = i + 1;
            }
            start = i + 1;
        }
    }
    free(keys);
    x->a2a_kinds = T;
    return 1;
}

void hexiseq_a2a_kinds_free(cost_ctx *x) {
    free(x->kind_of);
    free(x->kind_tokens);
    free(x->kind_heads);
    free(x->kind_kv);
    free(x->kind_first);
    free(x->kind_count);
    free(x->by_node);
    free(x->node_lo);
    free(x->node_hi);
    free(x->node_kind);
}

/* All-to-all of slot r over the whole step, seconds; each of the layer's exchanges is timed as
 * max(send, receive) with peers serialised, each peer message paying its link's latency: forward Q/K/V in and
 * O out, backward dO in and dQ/dK/dV out, and the forward pair again when checkpointing recomputes.
 * bytes[4]: one layer's forward sent and received, backward sent and received, one sequence. */
double hexiseq_a2a_time_s(const cost_ctx *x, int32_t r, double *bytes) {
    int32_t g = x->group_of[r];
    bytes[0] = bytes[1] = bytes[2] = bytes[3] = 0.0;
    if (x->l->group_size[g] == 1)
        return 0.0;
    int32_t me = x->l->device[r];
    a2a_side mine = {x->l->head_count[r], (double)x->l->tokens[r], x->kv_n[r], x->first_n[r]};
    double t[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* seconds, sent and received: Q/K/V, O, dO, dQ/dK/dV */
    int grouped = x->a2a_group == g && x->a2a_kinds > 0;
    /* peers one by one: every other member, or with grouping those of my node */
    int32_t lo = grouped ? x->node_lo[r] : x->offset[g], hi = grouped ? x->node_hi[r] : x->offset[g + 1];
    for (int32_t i = lo; i < hi; ++i) {
        int32_t j = grouped ? x->by_node[i] : i;
        if (grouped)
            x->node_kind[x->kind_of[j]]++;
        if (j == r)
            continue;
        int32_t dj = x->l->device[j];
        a2a_side peer = {x->l->head_count[j], (double)x->l->tokens[j], x->kv_n[j], x->first_n[j]};
        a2a_peer(x, 1.0, mine, peer, hexiseq_bw_bytes(x->c, me, dj), hexiseq_bw_bytes(x->c, dj, me),
                 hexiseq_lat_s(x->c, me, dj), hexiseq_lat_s(x->c, dj, me), t, bytes);
    }
    if (grouped) {
        /* other nodes, by kind: all behind the inter-node link (the values hexiseq_bw_bytes and
         * hexiseq_lat_s give for devices of different nodes) */
        double bw = x->c->inter_gbps * 1e9, lat = HEXISEQ_LATENCY_INTER_US * 1e-6;
        for (int32_t kind = 0; kind < x->a2a_kinds; ++kind) {
            int32_t count = x->kind_count[kind] - x->node_kind[kind];
            a2a_side peer = {x->kind_heads[kind], (double)x->kind_tokens[kind], x->kind_kv[kind],
                             x->kind_first[kind]};
            if (count > 0)
                a2a_peer(x, (double)count, mine, peer, bw, bw, lat, lat, t, bytes);
        }
        for (int32_t i = lo; i < hi; ++i)
            x->node_kind[x->kind_of[x->by_node[i]]] = 0;
    }
    double qkv = fmax(t[0], t[1]), o = fmax(t[2], t[3]), dO = fmax(t[4], t[5]), grads = fmax(t[6], t[7]);
    double per_layer = (qkv + o) * (1.0 + (x->t->checkpointing ? 1.0 : 0.0)) + (dO + grads);
    return per_layer * x->m->layers * x->t->sequences;
}
