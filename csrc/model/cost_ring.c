/* Cost term: attention over the ring steps, the ring transfers it does not hide, and the runtime's work around
 * the kernels; priced step by step, or once per kind of step for rings of many groups. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cost_terms.h"

/* Visible (query, key) pairs between the positions of groups gq (queries) and gk (keys); under `docs` (not
 * NULL only when causal) inside one document; with window > 0 (causal only) inside a window of that many keys. Under
 * both, the smaller of the documents' pairs and the window's (an upper bound of the pairs in both: a document
 * longer than the window loses what lies outside it, one shorter is inside it whole; exact when either mask leaves
 * the other nothing to cut). */
double hexiseq_group_pairs(const hexiseq_group_span *sq, const hexiseq_group_span *sk, int32_t causal,
                           const hexiseq_documents *docs, int64_t window) {
    int64_t qs[2][2] = {{sq->front_start, sq->front_start + sq->front_len}, {sq->back_start, sq->back_start + sq->back_len}};
    int64_t ks[2][2] = {{sk->front_start, sk->front_start + sk->front_len}, {sk->back_start, sk->back_start + sk->back_len}};
    double total = 0.0;
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
            if (!causal) {
                total += (double)(qs[i][1] - qs[i][0]) * (double)(ks[j][1] - ks[j][0]);
                continue;
            }
            double n = (double)hexiseq_visible_pairs(docs, qs[i][0], qs[i][1], ks[j][0], ks[j][1]);
            if (window > 0)
                n = fmin(n, (double)hexiseq_window_pairs(qs[i][0], qs[i][1], ks[j][0], ks[j][1], window));
            total += n;
        }
    return total;
}

/* Achieved attention rate (FLOP/s) for a block whose shorter side is n tokens. */
static double attn_rate_flops(const hexiseq_device_info *d, double n) {
    if (d->attn_curve.n > 0)
        return hexiseq_curve_tflops(&d->attn_curve, n) * 1e12;
    return d->peak_tflops * 1e12 * d->attn_eff * n / (n + ATTN_HALF_TOKENS);
}

/* Rate on a causal diagonal block of n tokens (n (n + 1) / 2 pairs): the causal curve, else the full-block
 * curve at n. Only called when the device has one of the two. */
static double attn_diag_rate_flops(const hexiseq_device_info *d, double n) {
    const hexiseq_rate_curve *cv = d->attn_causal_curve.n > 0 ? &d->attn_causal_curve : &d->attn_curve;
    return hexiseq_curve_tflops(cv, n) * 1e12;
}

/* The runtime's work around the kernels on slot r over the whole step (0 without measured runtime curves), in
 * nanoseconds (hexiseq_runtime_curve_ns) from three curves of ns per element: the group's side, the group's tokens
 * for the slot's heads and kv heads (S_g * (h + 2 kv) * d elements: the ring's tensors, accumulators, bookkeeping;
 * `runtime`, timed on one-device layers, where it is tokens * (heads + 2 kv_heads) * d), and in a group of more than
 * one the all-to-all's side, the slot's own tokens for every head (s_r * (heads + 2 kv_heads) * d: packing,
 * unpacking and the collective's copies; `runtime_a2a`, timed on the calibrated ranks in all-to-all groups), and in
 * a ring of several groups the ring's side, the K, V blocks of the other groups for the slot's kv heads
 * ((S - S_g) * 2 kv * d: assembling the received blocks, their gradients' accumulators; `runtime_ring`, timed on the
 * calibrated ranks in a ring). Forward + backward per layer, plus the recomputed forward's share as for attention. */
double hexiseq_runtime_time_s(const cost_ctx *x, const hexiseq_device_info *d, int32_t r) {
    const hexiseq_layout *l = x->l;
    const hexiseq_model *m = x->m;
    int32_t g = x->group_of[r];
    double ns = 0.0;
    double group = (double)l->group_seq[g] * (l->head_count[r] + 2.0 * x->kv_n[r]) * m->head_dim;
    if (d->runtime_curve.n > 0 && group > 0)
        ns += hexiseq_runtime_curve_ns(&d->runtime_curve, group);
    double own = (double)l->tokens[r] * (m->heads + 2.0 * m->kv_heads) * m->head_dim;
    if (d->runtime_a2a_curve.n > 0 && l->group_size[g] > 1 && own > 0)
        ns += hexiseq_runtime_curve_ns(&d->runtime_a2a_curve, own);
    double ring = (double)(x->seq_len - l->group_seq[g]) * 2.0 * x->kv_n[r] * m->head_dim;
    if (d->runtime_ring_curve.n > 0 && l->n_groups > 1 && ring > 0)
        ns += hexiseq_runtime_curve_ns(&d->runtime_ring_curve, ring);
    return x->t->sequences * m->layers * ns * 1e-9 * attn_passes(x->t) / (1.0 + ATTN_BWD_FACTOR);
}

void hexiseq_ring_link_of(const cost_ctx *x, int32_t r, ring_link *out) {
    memset(out, 0, sizeof *out);
    int32_t G = x->l->n_groups, g = x->group_of[r];
    if (G == 1)
        return;
    double bytes_per_head_token = 2.0 * x->m->head_dim * x->m->dtype_bytes; /* K and V */
    int32_t prev = (g + G - 1) % G, next = (g + 1) % G;
    int32_t me = x->l->device[r];
    int32_t lo = x->kv_lo[r], n = x->kv_n[r];
    /* holders of consecutive kv heads are in rank order, so each source is one run of heads */
    for (int32_t h = lo, last = -1; h < lo + n; ++h) {
        int32_t src = x->l->device[kv_holder(x, prev, h)];
        out->recv_pt += bytes_per_head_token / hexiseq_bw_bytes(x->c, src, me);
        out->recv_bytes += bytes_per_head_token;
        if (src != last) {
            double lat = hexiseq_lat_s(x->c, src, me);
            out->recv_lat += lat;
            out->sync = fmax(out->sync, lat);
            last = src;
        }
    }
    for (int32_t i = x->hold_off[next]; i < x->hold_off[next + 1] && n > 0; ++i) { /* no kv heads: sends none */
        int32_t s = x->hold[i], slo = x->kv_lo[s], sn = x->kv_n[s], any = 0;
        for (int32_t h = slo; h < slo + sn; ++h)
            if (kv_holder(x, g, h) == r) {
                out->send_pt += bytes_per_head_token / hexiseq_bw_bytes(x->c, me, x->l->device[s]);
                out->send_bytes += bytes_per_head_token;
                any = 1;
            }
        if (any)
            out->send_lat += hexiseq_lat_s(x->c, me, x->l->device[s]);
    }
}

/* Transfer time of one ring step moving `tokens` tokens' worth of blocks in `msgs` messages per peer. */
static double ring_transfer_s(const ring_link *k, double tokens, double msgs) {
    return fmax(k->recv_pt * tokens + k->recv_lat * msgs, k->send_pt * tokens + k->send_lat * msgs);
}

/* One ring step of a device of group g with h heads: the block of a source group of sk tokens whose
 * positions meet g's queries in `pairs` visible pairs, while (when `more`) the next block of next_tokens
 * tokens arrives. `diag`: the step of the group's own block (k = 0). Out: the step's forward attention
 * (fwd), its compute (forward passes + backward) and its exposed communication, one layer, one sequence. */
static void ring_step(const cost_ctx *x, const hexiseq_device_info *d, int32_t h, const ring_link *link, int32_t g,
                      int diag, double pairs, double sk, int more, double next_tokens, double window, double *fwd_out,
                      double *compute_out, double *exposed_out) {
    /* window > 0: a windowed layer's step; its kernel rows are at most `window` keys long, and its own block is
     * a band, not the two causal triangles the split below prices */
    int split_diag = x->causal && window <= 0 && (d->attn_causal_curve.n > 0 || d->attn_curve.n > 0);
    double fwd_passes = 1.0 + (x->t->checkpointing ? 1.0 : 0.0);
    double sq = (double)x->l->group_seq[g];
    /* a group whose chunks the runtime joins (span_joined) runs its own block as one causal block of sq tokens,
     * one kernel call, not the two half-chunk triangles and the rectangle between them */
    const hexiseq_group_span *sp = &x->span[g];
    int joined = diag && span_joined(sp);
    /* otherwise causal blocks run as zigzag half-chunks: the kernel sees blocks half as long; under documents it
     * runs at most at the rate of the documents' length (short documents: short diagonal blocks, per-row and
     * partly masked tile work that the pairs alone do not count) */
    double block = (sq < sk ? sq : sk) * (x->causal && x->l->chunking == HEXISEQ_CHUNK_ZIGZAG && !joined ? 0.5 : 1.0);
    double doc = x->docs ? x->doc_len[g] : INFINITY;
    /* documents shorter than the block, on a device whose packed-document rate was measured: every pair of the
     * step at that rate for the documents' length (it holds the per-row and straddling-tile work the pairs miss) */
    int packed = x->docs && d->attn_document_curve.n > 0 && doc < block;
    block = fmin(block, doc);
    if (window > 0)
        block = fmin(block, window);
    double fwd = 0.0;
    if (pairs > 0 && packed) {
        fwd = attn_fwd_flops(x->m, pairs, h) / (hexiseq_curve_tflops(&d->attn_document_curve, doc) * 1e12);
    } else if (pairs > 0 && split_diag && joined) {
        fwd = attn_fwd_flops(x->m, pairs, h) / attn_diag_rate_flops(d, block);
    } else if (pairs > 0 && split_diag && diag) { /* (x->docs: the diagonal blocks' pairs are the documents' own) */
        /* own positions: front x front and back x back are causal diagonal blocks, back x front full */
        double fl = (double)sp->front_len, bl = (double)sp->back_len;
        int64_t f0 = sp->front_start, f1 = f0 + sp->front_len, b0 = sp->back_start, b1 = b0 + sp->back_len;
        double diag_f = (double)hexiseq_visible_pairs(x->docs, f0, f1, f0, f1);
        double diag_b = (double)hexiseq_visible_pairs(x->docs, b0, b1, b0, b1), rest = pairs - diag_f - diag_b;
        double pair_time = 0.0; /* sum over blocks of pairs / rate; times FLOPs per pair = seconds */
        if (fl > 0)
            pair_time += diag_f / attn_diag_rate_flops(d, fmin(fl, doc));
        if (bl > 0)
            pair_time += diag_b / attn_diag_rate_flops(d, fmin(bl, doc));
        if (rest > 0)
            pair_time += rest / attn_rate_flops(d, block);
        fwd = attn_fwd_flops(x->m, 1.0, h) * pair_time;
    } else if (pairs > 0) {
        fwd = attn_fwd_flops(x->m, pairs, h) / attn_rate_flops(d, block);
    }
    double fwd_comm = more ? ring_transfer_s(link, next_tokens, 1.0) : 0.0;
    double bwd = fwd * ATTN_BWD_FACTOR;
    /* dK, dV of this step's block move on, accumulated and sent in fp32 */
    double bwd_comm = ring_transfer_s(link, next_tokens + sk * (4.0 / x->m->dtype_bytes), more ? 2.0 : 1.0);
    double fwd_sync = more ? link->sync : 0.0, bwd_sync = link->sync;
    *fwd_out = fwd;
    *compute_out = fwd * fwd_passes + bwd;
    *exposed_out = fwd_passes * (fmax(0.0, fwd_comm - fwd) + fwd_sync) + fmax(0.0, bwd_comm - bwd) + bwd_sync;
}

/* Visible pairs of group g's queries with the keys of a source group of sk tokens lying before g in the
 * ring (before = 1) or after it. Zigzag spans: every front chunk precedes every back chunk, fronts in ring
 * order, backs mirrored; so a source before g has its front before g's front and its back after g's
 * back, and the reverse after g. Pairs of disjoint position ranges depend only on lengths and order, so a
 * stand-in span of the same lengths and order gives exactly the pairs of every such source. */
static double side_pairs(const cost_ctx *x, int32_t g, int64_t sk, int before) {
    const hexiseq_group_span *q = &x->span[g];
    hexiseq_group_span k;
    k.back_len = sk / 2;
    k.front_len = sk - k.back_len;
    if (before) {
        k.front_start = q->front_start - k.front_len;
        k.back_start = q->back_start + q->back_len;
    } else {
        k.front_start = q->front_start + q->front_len;
        k.back_start = q->back_start - k.back_len;
    }
    return hexiseq_group_pairs(q, &k, x->causal, NULL, 0); /* grouped pricing runs without documents or windows */
}

/* Attention and exposed ring time of slot r over the whole step. Ring step k attends the group's queries
 * to the block of the group k places back in the ring while the next block arrives; a step costs
 * max(compute, transfer) plus a synchronisation that compute cannot hide (the largest latency among the
 * messages received in the step). Backward moves K, V forward and dK, dV along with them (accumulated in
 * fp32, so 4/dtype_bytes times the bytes of K, V, in messages of their own), and the last dK, dV back to
 * their owner. Causal blocks run as zigzag half-chunks, so the kernel efficiency is taken at half the
 * shorter block; with measured curves, the two diagonal chunk blocks of step 0 run at the causal curve (one
 * causal block of the group's tokens where its chunks touch and the runtime joins them: see ring_step).
 * `fwd_layer_s` gets one forward pass of one layer and one sequence (no communication). */
void hexiseq_ring_time_s(const cost_ctx *x, int32_t r, const ring_link *link, double *attn_s, double *exposed_s,
                         double *fwd_layer_s) {
    const hexiseq_device_info *d = &x->c->dev[x->l->device[r]];
    int32_t G = x->l->n_groups, g = x->group_of[r], h = x->l->head_count[r];
    *attn_s = 0.0;
    *exposed_s = 0.0;
    *fwd_layer_s = 0.0;
    if (h == 0)
        return;
    double compute = 0.0, exposed = 0.0, fwd_sum = 0.0, f, cm, ex;
    /* windowed layers (direct pricing only: grouped pricing prices them as full ones): the steps they take, the
     * pairs of each; the sums below are per layer, so they are weighted by the layers of each kind */
    double wl = x->n_types == 0 && x->m->window > 0 ? (double)x->m->window_layers : 0.0;
    double full_l = (double)x->m->layers - wl;
    if (x->n_types == 0) { /* step by step, in ring order */
        for (int32_t k = 0; k < G; ++k) {
            int32_t src = (g - k + G) % G, nxt = (g - k - 1 + 2 * G) % G;
            int more = k < G - 1; /* the next block arrives during this step */
            ring_step(x, d, h, link, g, k == 0, x->step_pairs[k], (double)x->l->group_seq[src], more,
                      more ? (double)x->l->group_seq[nxt] : 0.0, 0.0, &f, &cm, &ex);
            compute += cm * full_l;
            fwd_sum += f * full_l;
            exposed += ex * full_l;
            if (wl > 0 && k < x->window_steps) { /* the ring stops after window_steps: the last sends dK, dV home */
                int wmore = k < x->window_steps - 1;
                ring_step(x, d, h, link, g, k == 0, x->step_pairs_w[k], (double)x->l->group_seq[src], wmore,
                          wmore ? (double)x->l->group_seq[nxt] : 0.0, (double)x->m->window, &f, &cm, &ex);
                compute += cm * wl;
                fwd_sum += f * wl;
                exposed += ex * wl;
            }
        }
    } else { /* grouped: own block, the last step (source g + 1, nothing arrives), then each type and side */
        ring_step(x, d, h, link, g, 1, x->step_pairs[0], (double)x->l->group_seq[g], G > 1,
                  G > 1 ? (double)x->l->group_seq[(g - 1 + G) % G] : 0.0, 0.0, &f, &cm, &ex);
        compute += cm;
        fwd_sum += f;
        exposed += ex;
        int32_t last = (g + 1) % G, last_type = x->type_of[last], own_type = x->type_of[g];
        int last_before = last < g;
        if (G > 1) {
            int64_t sk = x->l->group_seq[last];
            ring_step(x, d, h, link, g, 0, side_pairs(x, g, sk, last_before), (double)sk, 0, 0.0, 0.0, &f, &cm, &ex);
            compute += cm;
            fwd_sum += f;
            exposed += ex;
        }
        for (int32_t t = 0; t < x->n_types; ++t)
            for (int before = 0; before < 2; ++before) {
                int64_t count = before ? x->type_before[t] : x->type_total[t] - x->type_before[t] - (own_type == t);
                if (G > 1 && last_type == t && last_before == before)
                    count--;
                if (count <= 0)
                    continue;
                int64_t sk = x->type_sk[t];
                ring_step(x, d, h, link, g, 0, side_pairs(x, g, sk, before), (double)sk, 1, (double)x->type_snext[t],
                          0.0, &f, &cm, &ex);
                compute += (double)count * cm;
                fwd_sum += (double)count * f;
                exposed += (double)count * ex;
            }
    }
    /* direct pricing summed over the layers already (each kind by its count); grouped pricing is per layer */
    double layers = (double)x->m->layers, reps = (x->n_types == 0 ? 1.0 : layers) * x->t->sequences;
    *attn_s = compute * reps;
    *exposed_s = exposed * reps;
    *fwd_layer_s = x->n_types == 0 ? fwd_sum / layers : fwd_sum; /* the mean layer's */
}

/* Ring step types of a layout (see cost_ctx): kept only when they are few (more than
 * hexiseq_grouped_above groups and at most G / 4 types), else x->n_types = 0 and steps are priced one by
 * one. Returns 0 on allocation failure. */
typedef struct {
    int64_t sk, snext;
    int32_t src;
} ring_pair;

static int cmp_ring_pair(const void *a, const void *b) {
    const ring_pair *p = a, *q = b;
    if (p->sk != q->sk)
        return p->sk < q->sk ? -1 : 1;
    if (p->snext != q->snext)
        return p->snext < q->snext ? -1 : 1;
    return (p->src > q->src) - (p->src < q->src);
}

int hexiseq_ring_types_build(cost_ctx *x) {
    int32_t G = x->l->n_groups;
    x->n_types = 0;
    /* documents and contiguous chunks break the stand-in spans of side_pairs: price step by step */
    if (G <= hexiseq_grouped_above || x->docs || x->l->chunking != HEXISEQ_CHUNK_ZIGZAG)
        return 1;
    ring_pair *pairs = malloc((size_t)G * sizeof *pairs);
    x->type_of = malloc((size_t)G * sizeof *x->type_of);
    if (!pairs || !x->type_of) {
        free(pairs);
        return 0;
    }
    for (int32_t g = 0; g < G; ++g) {
        pairs[g].sk = x->l->group_seq[g];
        pairs[g].snext = x->l->group_seq[(g - 1 + G) % G];
        pairs[g].src = g;
    }
    qsort(pairs, (size_t)G, sizeof *pairs, cmp_ring_pair);
    int32_t T = 0;
    for (int32_t i = 0; i < G; ++i) {
        if (i == 0 || pairs[i].sk != pairs[i - 1].sk || pairs[i].snext != pairs[i - 1].snext)
            ++T;
        x->type_of[pairs[i].src] = T - 1;
    }
    if (T > G / 4) {
        free(pairs);
        return 1; /* as many types as steps, nearly: no gain */
    }
    x->type_sk = malloc((size_t)T * sizeof *x->type_sk);
    x->type_snext = malloc((size_t)T * sizeof *x->type_snext);
    x->type_total = calloc((size_t)T, sizeof *x->type_total);
    x->type_before = calloc((size_t)T, sizeof *x->type_before);
    if (!x->type_sk || !x->type_snext || !x->type_total || !x->type_before) {
        free(pairs);
        return 0;
    }
    for (int32_t i = 0; i < G; ++i) {
        int32_t t = x->type_of[pairs[i].src];
        x->type_sk[t] = pairs[i].sk;
        x->type_snext[t] = pairs[i].snext;
        x->type_total[t]++;
    }
    x->n_types = T;
    free(pairs);
    return 1;
}

void hexiseq_ring_types_free(cost_ctx *x) {
    free(x->type_of);
    free(x->type_sk);
    free(x->type_snext);
    free(x->type_total);
    free(x->type_before);
}
