/* The cost model: validates a layout and predicts its step time, per-device terms and memory.
 *
 * Every formula lives here once; docs/cost_model.md explains them in words. Units: FLOPs, bytes,
 * seconds, bytes/s internally; GiB and GB/s only at the API. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define GIB 1073741824.0

int32_t hexiseq_grouped_above = 32;

/* Kernel efficiency falls for short dimensions: rate = peak * eff * n / (n + half). The half-points
 * fit FlashAttention-2's forward curve on H100 (about 57% of its plateau at 512 tokens) and the usual
 * cuBLAS behaviour for matmuls with a few hundred rows. */
#define ATTN_HALF_TOKENS 384.0
#define GEMM_HALF_TOKENS 128.0

/* Backward costs this many forwards (attention: two extra matmul pairs plus recomputing P). */
#define ATTN_BWD_FACTOR 2.5
#define GEMM_BWD_FACTOR 2.0

/* ------------------------------------------------------------------ layout storage */

hexiseq_status hexiseq_layout_alloc(int32_t n_groups, int32_t n_devices, hexiseq_layout *out) {
    hexiseq_clear_error();
    if (!out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "out must not be NULL");
    memset(out, 0, sizeof *out);
    if (n_groups < 1 || n_devices < 1 || n_groups > n_devices || n_devices > HEXISEQ_MAX_DEVICES)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "layout sizes must satisfy 1 <= n_groups <= n_devices <= %d, got %d groups, %d devices",
                            HEXISEQ_MAX_DEVICES, n_groups, n_devices);
    out->n_groups = n_groups;
    out->n_devices = n_devices;
    out->group_size = calloc((size_t)n_groups, sizeof *out->group_size);
    out->group_seq = calloc((size_t)n_groups, sizeof *out->group_seq);
    out->device = calloc((size_t)n_devices, sizeof *out->device);
    out->tokens = calloc((size_t)n_devices, sizeof *out->tokens);
    out->head_lo = calloc((size_t)n_devices, sizeof *out->head_lo);
    out->head_count = calloc((size_t)n_devices, sizeof *out->head_count);
    if (!out->group_size || !out->group_seq || !out->device || !out->tokens || !out->head_lo || !out->head_count) {
        hexiseq_layout_free(out);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate a layout of %d devices", n_devices);
    }
    return HEXISEQ_OK;
}

void hexiseq_layout_free(hexiseq_layout *l) {
    if (!l)
        return;
    free(l->group_size);
    free(l->group_seq);
    free(l->device);
    free(l->tokens);
    free(l->head_lo);
    free(l->head_count);
    memset(l, 0, sizeof *l);
}

void hexiseq_layout_copy(hexiseq_layout *dst, const hexiseq_layout *src) {
    memcpy(dst->group_size, src->group_size, (size_t)src->n_groups * sizeof *src->group_size);
    memcpy(dst->group_seq, src->group_seq, (size_t)src->n_groups * sizeof *src->group_seq);
    memcpy(dst->device, src->device, (size_t)src->n_devices * sizeof *src->device);
    memcpy(dst->tokens, src->tokens, (size_t)src->n_devices * sizeof *src->tokens);
    memcpy(dst->head_lo, src->head_lo, (size_t)src->n_devices * sizeof *src->head_lo);
    memcpy(dst->head_count, src->head_count, (size_t)src->n_devices * sizeof *src->head_count);
    dst->chunking = src->chunking;
}

hexiseq_status hexiseq_layout_spans(const hexiseq_layout *l, hexiseq_group_span *spans) {
    hexiseq_clear_error();
    if (!l || !spans || !l->group_seq)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "layout and spans must not be NULL");
    if (l->chunking != HEXISEQ_CHUNK_ZIGZAG && l->chunking != HEXISEQ_CHUNK_CONTIGUOUS)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "chunking must be 0 (zigzag) or 1 (contiguous), got %d", l->chunking);
    int64_t total = 0;
    for (int32_t g = 0; g < l->n_groups; ++g) {
        if (l->group_seq[g] < 0 || l->group_seq[g] > HEXISEQ_MAX_SEQ_LEN - total)
            return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "group_seq[%d] must be >= 0 with a total <= %lld, got %lld", g,
                                (long long)HEXISEQ_MAX_SEQ_LEN, (long long)l->group_seq[g]);
        total += l->group_seq[g];
    }
    int64_t front = 0, back_end = total;
    for (int32_t g = 0; g < l->n_groups; ++g) {
        int64_t b = l->chunking == HEXISEQ_CHUNK_CONTIGUOUS ? 0 : l->group_seq[g] / 2, a = l->group_seq[g] - b;
        spans[g].front_start = front;
        spans[g].front_len = a;
        spans[g].back_start = l->chunking == HEXISEQ_CHUNK_CONTIGUOUS ? front + a : back_end - b;
        spans[g].back_len = b;
        front += a;
        back_end -= b;
    }
    return HEXISEQ_OK;
}

/* Visible (query, key) pairs between the positions of groups gq (queries) and gk (keys); under `docs` (not
 * NULL only when causal) inside one document. */
static double group_pairs(const hexiseq_group_span *sq, const hexiseq_group_span *sk, int32_t causal,
                          const hexiseq_documents *docs) {
    int64_t qs[2][2] = {{sq->front_start, sq->front_start + sq->front_len}, {sq->back_start, sq->back_start + sq->back_len}};
    int64_t ks[2][2] = {{sk->front_start, sk->front_start + sk->front_len}, {sk->back_start, sk->back_start + sk->back_len}};
    double total = 0.0;
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
            if (causal)
                total += (double)hexiseq_visible_pairs(docs, qs[i][0], qs[i][1], ks[j][0], ks[j][1]);
            else
                total += (double)(qs[i][1] - qs[i][0]) * (double)(ks[j][1] - ks[j][0]);
        }
    return total;
}

/* ------------------------------------------------------------------ validation */

static hexiseq_status validate_layout(const hexiseq_cluster *c, const hexiseq_model *m, int64_t seq_len,
                                      const hexiseq_layout *l) {
    if (!l->group_size || !l->group_seq || !l->device || !l->tokens || !l->head_lo || !l->head_count)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "layout arrays must not be NULL");
    if (l->n_devices != c->n_devices)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "layout must place every one of the cluster's %d devices, it lists %d",
                            c->n_devices, l->n_devices);
    if (l->n_groups < 1 || l->n_groups > l->n_devices)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "layout needs between 1 and %d groups, got %d", l->n_devices, l->n_groups);
    int64_t members = 0, seq_sum = 0;
    for (int32_t g = 0; g < l->n_groups; ++g) {
        if (l->group_size[g] < 1)
            return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "groups[%d] must have at least one device, got %d", g, l->group_size[g]);
        if (l->group_seq[g] < 1 || l->group_seq[g] > HEXISEQ_MAX_SEQ_LEN)
            return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "groups[%d].seq must be in [1, %lld], got %lld", g,
                                (long long)HEXISEQ_MAX_SEQ_LEN, (long long)l->group_seq[g]);
        members += l->group_size[g];
        seq_sum += l->group_seq[g];
        if (members > l->n_devices)
            break;
    }
    if (members != l->n_devices)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "group sizes must add up to %d devices, they add up to %lld",
                            l->n_devices, (long long)members);
    if (seq_sum != seq_len)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "group sequence lengths must add up to seq_len=%lld, they add up to %lld",
                            (long long)seq_len, (long long)seq_sum);
    if (l->chunking != HEXISEQ_CHUNK_ZIGZAG && l->chunking != HEXISEQ_CHUNK_CONTIGUOUS)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "chunking must be 0 (zigzag) or 1 (contiguous), got %d", l->chunking);
    unsigned char *seen = calloc((size_t)c->n_devices, 1);
    if (!seen)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate %d bytes", c->n_devices);
    hexiseq_status st = HEXISEQ_OK;
    int32_t r = 0;
    for (int32_t g = 0; g < l->n_groups && st == HEXISEQ_OK; ++g) {
        int64_t tok = 0;
        int32_t next_head = 0;
        for (int32_t i = 0; i < l->group_size[g]; ++i, ++r) {
            int32_t dv = l->device[r];
            if (dv < 0 || dv >= c->n_devices) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "groups[%d] lists device %d, not in [0, %d)", g, dv, c->n_devices);
                break;
            }
            if (seen[dv]) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "device %d appears twice in the layout", dv);
                break;
            }
            seen[dv] = 1;
            if (l->tokens[r] < 0) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "tokens of device %d must be >= 0, got %lld", dv, (long long)l->tokens[r]);
                break;
            }
            if (l->tokens[r] > l->group_seq[g] - tok) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "token shares of groups[%d] exceed its seq=%lld at device %d (tokens %lld)",
                                  g, (long long)l->group_seq[g], dv, (long long)l->tokens[r]);
                break;
            }
            if (l->head_count[r] < 0) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "head_count of device %d must be >= 0, got %d", dv, l->head_count[r]);
                break;
            }
            if (l->head_count[r] > m->heads - next_head) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "head ranges in groups[%d] exceed the model's %d heads at device %d",
                                  g, m->heads, dv);
                break;
            }
            if (l->head_lo[r] != next_head) {
                st = hexiseq_fail(HEXISEQ_ERR_LAYOUT,
                                  "head ranges in groups[%d] must tile [0, %d) in rank order: device %d starts at head %d, expected %d",
                                  g, m->heads, dv, l->head_lo[r], next_head);
                break;
            }
            tok += l->tokens[r];
            next_head += l->head_count[r];
        }
        if (st != HEXISEQ_OK)
            break;
        if (tok != l->group_seq[g])
            st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "token shares of groups[%d] must add up to its seq=%lld, they add up to %lld",
                              g, (long long)l->group_seq[g], (long long)tok);
        else if (next_head != m->heads)
            st = hexiseq_fail(HEXISEQ_ERR_LAYOUT, "head counts of groups[%d] must add up to %d heads, they add up to %d", g,
                              m->heads, next_head);
    }
    free(seen);
    return st;
}

/* ------------------------------------------------------------------ cost terms */

typedef struct {
    const hexiseq_cluster *c;
    const hexiseq_model *m;
    const hexiseq_training *t;
    const hexiseq_layout *l;
    int64_t seq_len;
    int32_t causal;
    const hexiseq_documents *docs; /* the training's documents, or NULL */
    double *doc_len;          /* [n_groups] under documents: the pair-weighted mean length of the document pieces
                                 in the group's positions, the block length its kernels effectively run at */
    int32_t *group_of;        /* [n_devices] group of layout slot r */
    int32_t *offset;          /* [n_groups + 1] first slot of each group */
    hexiseq_group_span *span; /* [n_groups] */
    double *step_pairs;       /* [n_groups] visible pairs at each ring step, for the group being scored
                                 (direct pricing only) */
    double max_block;         /* longest ring block (the largest S_g; 0 with one group), tokens */
    int32_t *kv_lo, *kv_n;    /* [n_devices] kv heads each slot needs (hexiseq_kv_range of its heads) */
    int32_t *first_n;         /* [n_devices] kv heads each slot first-holds (see first_holder) */
    int32_t *hold;            /* [n_devices] slots holding at least one head, group by group in rank order */
    int32_t *hold_off;        /* [n_groups + 1] first entry of each group in hold */
    int32_t *first_holder;    /* [n_groups * kv_heads] slot of each group that sends kv head h around the ring:
                                 the first member (in rank order) whose heads need it */
    /* Grouped ring pricing (n_types > 0): ring step k of group g depends on the step's source group src
     * only through (S_src, S_next) and on which side of g src lies, so the steps of a group are priced once
     * per distinct (S_src, S_next, side) and weighted by how often it occurs. */
    int32_t n_types;          /* distinct (S_src, S_src-1) pairs over the ring; 0: price step by step */
    int32_t *type_of;         /* [n_groups] type of source group src */
    int64_t *type_sk;         /* [n_types] S_src */
    int64_t *type_snext;      /* [n_types] S of the group before src in the ring (the block arriving next) */
    int32_t *type_total;      /* [n_types] source groups of each type */
    int32_t *type_before;     /* [n_types] of which before the group being scored (index < g) */
    /* Grouped all-to-all (a2a_kinds > 0): in a group of more than hexiseq_grouped_above members with
     * node-derived links, a member's peers on other nodes all sit behind the same inter-node link, so they
     * are priced once per kind (tokens, heads, kv heads) and weighted by how many there are; peers on its
     * own node are priced one by one. Filled per group by a2a_kinds_build. */
    int32_t a2a_group;        /* the group described, -1: none */
    int32_t a2a_kinds;        /* kinds of member in it; 0: price peers one by one */
    int32_t *kind_of;         /* [n_devices] kind of each slot of the group */
    int64_t *kind_tokens;     /* [kinds] */
    int32_t *kind_heads, *kind_kv, *kind_first, *kind_count;
    int32_t *by_node;         /* [group size] the group's slots sorted by node, then slot */
    int32_t *node_lo, *node_hi; /* [n_devices] range in by_node of the slot's node */
    int32_t *node_kind;       /* [kinds] scratch: kinds on the member's node */
} cost_ctx;

/* Forward FLOPs of the token-parallel part of one layer, per token: q, k, v, o projections and MLP. */
static double layer_gemm_flops_per_token(const hexiseq_model *m) {
    double H = m->hidden, q = (double)m->heads * m->head_dim, kv = (double)m->kv_heads * m->head_dim;
    return 2.0 * (H * q + 2.0 * H * kv + q * H + (m->gated_mlp ? 3.0 : 2.0) * H * m->ffn);
}

/* Forward FLOPs of the output head per token. */
static double head_gemm_flops_per_token(const hexiseq_model *m) { return 2.0 * (double)m->hidden * m->vocab; }

/* Forward passes per step for the layers: 1 forward + backward (+1 recompute with checkpointing). */
static double gemm_passes(const hexiseq_training *t) { return 1.0 + GEMM_BWD_FACTOR + (t->checkpointing ? 1.0 : 0.0); }
static double attn_passes(const hexiseq_training *t) { return 1.0 + ATTN_BWD_FACTOR + (t->checkpointing ? 1.0 : 0.0); }

/* Achieved matmul rate (FLOP/s) of a device running an m-row problem: the measured curve when there is
 * one, else the catalog's size curve. */
static double gemm_rate_flops(const hexiseq_device_info *d, double rows) {
    if (d->gemm_curve.n > 0)
        return hexiseq_curve_tflops(&d->gemm_curve, rows) * 1e12;
    return d->peak_tflops * 1e12 * d->gemm_eff * rows / (rows + GEMM_HALF_TOKENS);
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
 * nanoseconds per element from three curves: the group's side, the group's tokens for the slot's heads and kv heads
 * (S_g * (h + 2 kv) * d elements: the ring's tensors, accumulators, bookkeeping; `runtime`, timed on one-device
 * layers, where it is tokens * (heads + 2 kv_heads) * d), and in a group of more than one the all-to-all's side,
 * the slot's own tokens for every head (s_r * (heads + 2 kv_heads) * d: packing, unpacking and the collective's
 * copies; `runtime_a2a`, timed on the calibrated ranks in all-to-all groups), and in a ring of several groups the
 * ring's side, the K, V blocks of the other groups for the slot's kv heads ((S - S_g) * 2 kv * d: assembling the
 * received blocks, their gradients' accumulators; `runtime_ring`, timed on the calibrated ranks in a ring).
 * Forward + backward per layer, plus the recomputed forward's share as for attention. */
static double runtime_time_s(const cost_ctx *x, const hexiseq_device_info *d, int32_t r) {
    const hexiseq_layout *l = x->l;
    const hexiseq_model *m = x->m;
    int32_t g = x->group_of[r];
    double ns = 0.0;
    double group = (double)l->group_seq[g] * (l->head_count[r] + 2.0 * x->kv_n[r]) * m->head_dim;
    if (d->runtime_curve.n > 0 && group > 0)
        ns += group * hexiseq_curve_tflops(&d->runtime_curve, group);
    double own = (double)l->tokens[r] * (m->heads + 2.0 * m->kv_heads) * m->head_dim;
    if (d->runtime_a2a_curve.n > 0 && l->group_size[g] > 1 && own > 0)
        ns += own * hexiseq_curve_tflops(&d->runtime_a2a_curve, own);
    double ring = (double)(x->seq_len - l->group_seq[g]) * 2.0 * x->kv_n[r] * m->head_dim;
    if (d->runtime_ring_curve.n > 0 && l->n_groups > 1 && ring > 0)
        ns += ring * hexiseq_curve_tflops(&d->runtime_ring_curve, ring);
    return x->t->sequences * m->layers * ns * 1e-9 * attn_passes(x->t) / (1.0 + ATTN_BWD_FACTOR);
}

/* Token-parallel compute of a device over the whole step, seconds. */
static double gemm_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens) {
    if (tokens == 0)
        return 0.0;
    double flops_per_token = x->m->layers * layer_gemm_flops_per_token(x->m) * gemm_passes(x->t) +
                             head_gemm_flops_per_token(x->m) * (1.0 + GEMM_BWD_FACTOR);
    return x->t->sequences * (double)tokens * flops_per_token / gemm_rate_flops(d, (double)tokens);
}

/* Token-parallel compute of one layer's forward for one sequence, seconds. */
static double layer_gemm_fwd_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens) {
    if (tokens == 0)
        return 0.0;
    return (double)tokens * layer_gemm_flops_per_token(x->m) / gemm_rate_flops(d, (double)tokens);
}

/* Forward attention FLOPs for `pairs` visible pairs and h query heads (QK^T and PV: 2 + 2 per dim). */
static double attn_fwd_flops(const hexiseq_model *m, double pairs, int32_t h) { return 4.0 * pairs * m->head_dim * h; }

/* kv heads a device needs for query heads [lo, lo + count). */
void hexiseq_kv_range(const hexiseq_model *m, int32_t lo, int32_t count, int32_t *kv_lo, int32_t *kv_count) {
    if (count == 0) {
        *kv_lo = 0;
        *kv_count = 0;
        return;
    }
    int32_t per = m->heads / m->kv_heads;
    *kv_lo = lo / per;
    *kv_count = (lo + count - 1) / per - *kv_lo + 1;
}

/* Layout slot in group g that sends kv head h around the ring: the first member holding it. */
static int32_t kv_holder(const cost_ctx *x, int32_t g, int32_t h) {
    return x->first_holder[(int64_t)g * x->m->kv_heads + h];
}

/* Fills x->first_holder: members in rank order, each claiming the kv heads of its range not claimed yet
 * (a validated layout covers every head in every group, so every entry is set), and x->first_n. */
static void first_holders(cost_ctx *x) {
    int32_t G = x->l->n_groups, A_kv = x->m->kv_heads;
    for (int64_t i = 0; i < (int64_t)G * A_kv; ++i)
        x->first_holder[i] = -1;
    for (int32_t r = 0; r < x->l->n_devices; ++r)
        x->first_n[r] = 0;
    for (int32_t g = 0; g < G; ++g)
        for (int32_t i = x->hold_off[g]; i < x->hold_off[g + 1]; ++i) {
            int32_t r = x->hold[i], lo = x->kv_lo[r], n = x->kv_n[r];
            for (int32_t h = lo; h < lo + n; ++h)
                if (x->first_holder[(int64_t)g * A_kv + h] < 0) {
                    x->first_holder[(int64_t)g * A_kv + h] = r;
                    x->first_n[r]++;
                }
        }
}

/* Devices alike (rates and memory): every term of one equals the other's for the same work. */
static int same_device(const hexiseq_cluster *c, int32_t a, int32_t b) {
    return c->dev_class[a] == c->dev_class[b];
}

/* Ring transfers of device slot r: it receives its kv heads from the previous group in the ring (from the
 * first holder of each) and sends what the next group takes from it. Receive and send overlap (full
 * duplex); transfers to or from several peers are serialised, and each peer's transfer is one message
 * that pays the link's fixed latency. */
typedef struct {
    double recv_pt, send_pt;   /* seconds per token of a block, bytes / bandwidth summed over peers */
    double recv_bytes, send_bytes; /* bytes per token of a block, summed over peers */
    double recv_lat, send_lat; /* seconds of message latency per block: one message per peer */
    double sync;               /* the largest latency among the messages received: a step's fixed cost */
} ring_link;

static void ring_link_of(const cost_ctx *x, int32_t r, ring_link *out) {
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

/* Attention and exposed ring time of slot r over the whole step. Ring step k attends the group's queries
 * to the block of the group k places back in the ring while the next block arrives; a step costs
 * max(compute, transfer) plus a synchronisation that compute cannot hide (the largest latency among the
 * messages received in the step). Backward moves K, V forward and dK, dV along with them (accumulated in
 * fp32, so 4/dtype_bytes times the bytes of K, V, in messages of their own), and the last dK, dV back to
 * their owner. Causal blocks run as zigzag half-chunks, so the kernel efficiency is taken at half the
 * shorter block; with measured curves, the two diagonal chunk blocks of step 0 run at the causal curve.
 * `fwd_layer_s` gets one forward pass of one layer and one sequence (no communication). */
/* One ring step of a device of group g with h heads: the block of a source group of sk tokens whose
 * positions meet g's queries in `pairs` visible pairs, while (when `more`) the next block of next_tokens
 * tokens arrives. `diag`: the step of the group's own block (k = 0). Out: the step's forward attention
 * (fwd), its compute (forward passes + backward) and its exposed communication, one layer, one sequence. */
static void ring_step(const cost_ctx *x, const hexiseq_device_info *d, int32_t h, const ring_link *link, int32_t g,
                      int diag, double pairs, double sk, int more, double next_tokens, double *fwd_out,
                      double *compute_out, double *exposed_out) {
    int split_diag = x->causal && (d->attn_causal_curve.n > 0 || d->attn_curve.n > 0);
    double fwd_passes = 1.0 + (x->t->checkpointing ? 1.0 : 0.0);
    double sq = (double)x->l->group_seq[g];
    /* causal blocks run as zigzag half-chunks: the kernel sees blocks half as long; under documents it runs
     * at most at the rate of the documents' length (short documents: short diagonal blocks, per-row and
     * partly masked tile work that the pairs alone do not count) */
    double block = (sq < sk ? sq : sk) * (x->causal && x->l->chunking == HEXISEQ_CHUNK_ZIGZAG ? 0.5 : 1.0);
    double doc = x->docs ? x->doc_len[g] : INFINITY;
    /* documents shorter than the block, on a device whose packed-document rate was measured: every pair of the
     * step at that rate for the documents' length (it holds the per-row and straddling-tile work the pairs miss) */
    int packed = x->docs && d->attn_document_curve.n > 0 && doc < block;
    block = fmin(block, doc);
    double fwd = 0.0;
    if (pairs > 0 && packed) {
        fwd = attn_fwd_flops(x->m, pairs, h) / (hexiseq_curve_tflops(&d->attn_document_curve, doc) * 1e12);
    } else if (pairs > 0 && split_diag && diag) { /* (x->docs: the diagonal blocks' pairs are the documents' own) */
        /* own positions: front x front and back x back are causal diagonal blocks, back x front full */
        const hexiseq_group_span *sp = &x->span[g];
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
    return group_pairs(q, &k, x->causal, NULL); /* grouped pricing runs without documents */
}

/* Attention and exposed ring time of slot r over the whole step. Ring step k attends the group's queries
 * to the block of the group k places back in the ring while the next block arrives; a step costs
 * max(compute, transfer) plus a synchronisation that compute cannot hide (the largest latency among the
 * messages received in the step). Backward moves K, V forward and dK, dV along with them (accumulated in
 * fp32, so 4/dtype_bytes times the bytes of K, V, in messages of their own), and the last dK, dV back to
 * their owner. Causal blocks run as zigzag half-chunks, so the kernel efficiency is taken at half the
 * shorter block; with measured curves, the two diagonal chunk blocks of step 0 run at the causal curve.
 * `fwd_layer_s` gets one forward pass of one layer and one sequence (no communication). */
static void ring_time_s(const cost_ctx *x, int32_t r, const ring_link *link, double *attn_s, double *exposed_s,
                        double *fwd_layer_s) {
    const hexiseq_device_info *d = &x->c->dev[x->l->device[r]];
    int32_t G = x->l->n_groups, g = x->group_of[r], h = x->l->head_count[r];
    *attn_s = 0.0;
    *exposed_s = 0.0;
    *fwd_layer_s = 0.0;
    if (h == 0)
        return;
    double compute = 0.0, exposed = 0.0, fwd_sum = 0.0, f, cm, ex;
    if (x->n_types == 0) { /* step by step, in ring order */
        for (int32_t k = 0; k < G; ++k) {
            int32_t src = (g - k + G) % G, nxt = (g - k - 1 + 2 * G) % G;
            int more = k < G - 1; /* the next block arrives during this step */
            ring_step(x, d, h, link, g, k == 0, x->step_pairs[k], (double)x->l->group_seq[src], more,
                      more ? (double)x->l->group_seq[nxt] : 0.0, &f, &cm, &ex);
            compute += cm;
            fwd_sum += f;
            exposed += ex;
        }
    } else { /* grouped: own block, the last step (source g + 1, nothing arrives), then each type and side */
        ring_step(x, d, h, link, g, 1, x->step_pairs[0], (double)x->l->group_seq[g], G > 1,
                  G > 1 ? (double)x->l->group_seq[(g - 1 + G) % G] : 0.0, &f, &cm, &ex);
        compute += cm;
        fwd_sum += f;
        exposed += ex;
        int32_t last = (g + 1) % G, last_type = x->type_of[last], own_type = x->type_of[g];
        int last_before = last < g;
        if (G > 1) {
            int64_t sk = x->l->group_seq[last];
            ring_step(x, d, h, link, g, 0, side_pairs(x, g, sk, last_before), (double)sk, 0, 0.0, &f, &cm, &ex);
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
                          &f, &cm, &ex);
                compute += (double)count * cm;
                fwd_sum += (double)count * f;
                exposed += (double)count * ex;
            }
    }
    double reps = (double)x->m->layers * x->t->sequences;
    *attn_s = compute * reps;
    *exposed_s = exposed * reps;
    *fwd_layer_s = fwd_sum;
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

static int ring_types_build(cost_ctx *x) {
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

static void ring_types_free(cost_ctx *x) {
    free(x->type_of);
    free(x->type_sk);
    free(x->type_snext);
    free(x->type_total);
    free(x->type_before);
}

/* What one member of an all-to-all pair holds, which sizes its part of each exchange. */
typedef struct {
    double h, s;      /* query heads held during attention, tokens held outside it */
    int32_t kv, first; /* kv heads those query heads read, and those of them the member first-holds */
} a2a_side;

/* One peer's part of slot r's all-to-all, added to the eight times (seconds; sent and received per exchange:
 * Q/K/V, O, dO, dQ/dK/dV) and four byte counts (forward sent, received; backward sent, received), `count`
 * times. The forward sends each member its tokens of the member's Q, K, V and gets back the attention output;
 * the backward sends dO the way the output came, and returns dQ with dK, dV of the first-held kv heads only
 * (a co-holder's share is reduced into the first holder before, hexiseq/ring.py). */
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
static int a2a_kinds_build(cost_ctx *x, int32_t g) {
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

static void a2a_kinds_free(cost_ctx *x) {
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
static double a2a_time_s(const cost_ctx *x, int32_t r, double *bytes) {
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

void hexiseq_states(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t, int32_t device,
                    hexiseq_states_t *out) {
    double P = m->layers * hexiseq_layer_params(m) + 2.0 * (double)m->vocab * m->hidden + m->hidden;
    double b = m->dtype_bytes;
    double opt = 8.0 + (b < 4 ? 4.0 : 0.0); /* Adam m, v in fp32, plus an fp32 master copy below fp32 */
    double gathered = fmax(hexiseq_layer_params(m), (double)m->vocab * m->hidden) * b;
    double fixed, sharded;
    switch (t->sharding) {
    case HEXISEQ_SHARD_FULL: fixed = 3.0 * gathered, sharded = (2.0 * b + opt) * P; break; /* layer, prefetch, grads */
    case HEXISEQ_SHARD_GRAD_OPT: fixed = b * P + gathered, sharded = (b + opt) * P; break;
    case HEXISEQ_SHARD_OPT: fixed = 2.0 * b * P, sharded = opt * P; break;
    default: fixed = (2.0 * b + opt) * P, sharded = 0.0; break;
    }
    out->fixed_gib = fixed / GIB;
    out->sharded_gib = sharded / GIB;
    out->share = 1.0 / c->n_devices;
    double part = sharded / c->n_devices; /* this device's part of the sharded states */
    if (t->state_shares == HEXISEQ_STATES_BY_MEMORY && sharded > 0.0) {
        /* Every device keeps the same fraction of the memory it has beside the unsharded part and the reserve:
         * share_r = (cap_r - level)+ / sum_d (cap_d - level)+. A device with nothing beyond the level holds no
         * share (and, short of even the unsharded part, does not fit). When no device has room, even shares
         * stand (nothing fits either way). */
        double level = out->fixed_gib + t->reserved_gib, room = hexiseq_memory_beyond(c, level);
        double cap = device < 0 ? c->mem_sorted[c->n_devices - 1] : c->dev[device].memory_gib; /* -1: largest */
        if (room > 0.0) {
            out->share = fmax(0.0, cap - level) / room;
            part = out->share * sharded;
        }
    }
    /* summed in the order the even formulas always had, so that even shares give the same bits */
    switch (t->sharding) {
    case HEXISEQ_SHARD_FULL: out->gib = (part + 3.0 * gathered) / GIB; break;
    case HEXISEQ_SHARD_GRAD_OPT: out->gib = (b * P + part + gathered) / GIB; break;
    case HEXISEQ_SHARD_OPT: out->gib = (2.0 * b * P + part) / GIB; break;
    default: out->gib = fixed / GIB; break;
    }
}

void hexiseq_memory_coeffs(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                           int32_t device, int32_t heads, int32_t kv_n, double ring_block, hexiseq_memory_coeffs_t *out) {
    hexiseq_states_t st;
    hexiseq_states(c, m, t, device, &st);
    double b = m->dtype_bytes;
    double H = m->hidden;
    /* saved per token and layer: 2 norm inputs, 2 norm outputs, attention output, MLP intermediates */
    double act_layer = b * (4.0 * H + (double)m->heads * m->head_dim + (m->gated_mlp ? 3.0 : 2.0) * m->ffn);
    double act = t->checkpointing ? m->layers * H * b + act_layer : m->layers * act_layer;
    act += m->vocab * (b + 4.0); /* logits and their fp32 softmax */
    /* Q, K, V, O of the group's tokens for the device's heads, and the fp32 LSE; saved for every layer
     * (one with checkpointing) plus the gradients of one layer */
    double qkvo = (2.0 * heads + 2.0 * kv_n) * m->head_dim * b + heads * 4.0;
    double attn = qkvo * ((t->checkpointing ? 1.0 : m->layers) + 1.0);
    /* K,V and fp32 dK,dV of a ring block, double-buffered */
    double ring = kv_n > 0 ? 2.0 * ring_block * 2.0 * kv_n * m->head_dim * (b + 4.0) : 0.0;
    out->states_gib = st.gib;
    out->state_share = st.share;
    out->ring_gib = ring / GIB;
    out->per_token_gib = act / GIB;
    out->per_group_token_gib = attn / GIB;
    out->reserved_gib = t->reserved_gib;
    out->cap_gib = c->dev[device].memory_gib;
}

/* Memory of slot r, filled into the GiB fields of `out`. */
static void memory_terms(const cost_ctx *x, int32_t r, int32_t kv_n, hexiseq_device_cost *out) {
    hexiseq_memory_coeffs_t mc;
    hexiseq_memory_coeffs(x->c, x->m, x->t, x->l->device[r], x->l->head_count[r], kv_n, x->max_block, &mc);
    out->mem_states_gib = mc.states_gib;
    out->state_share = mc.state_share;
    out->mem_act_gib = mc.per_token_gib * (double)x->l->tokens[r];
    out->mem_attn_gib = mc.per_group_token_gib * (double)x->l->group_seq[x->group_of[r]];
    out->mem_ring_gib = mc.ring_gib;
    out->mem_total_gib = out->mem_states_gib + out->mem_act_gib + out->mem_attn_gib + out->mem_ring_gib + mc.reserved_gib;
    out->mem_cap_gib = mc.cap_gib;
}

/* Total work over total rate, phase by phase: no layout of these devices can be faster. */
static double lower_bound_s(const cost_ctx *x) {
    double gemm_rate = x->c->gemm_rate_sum, attn_rate = x->c->attn_rate_sum[x->causal ? 1 : 0];
    double S = (double)x->seq_len, seqs = x->t->sequences;
    double gemm_flops = seqs * S *
                        (x->m->layers * layer_gemm_flops_per_token(x->m) * gemm_passes(x->t) +
                         head_gemm_flops_per_token(x->m) * (1.0 + GEMM_BWD_FACTOR));
    double pairs = x->docs ? (double)x->docs->tri[x->docs->n] : x->causal ? S * (S + 1.0) / 2.0 : S * S;
    double attn_flops = seqs * x->m->layers * attn_fwd_flops(x->m, pairs, x->m->heads) * attn_passes(x->t);
    return gemm_flops / gemm_rate + attn_flops / attn_rate;
}

/* Exposed time of L per-layer collectives of c seconds each that overlap L per-layer compute phases of b
 * seconds each: collective l can start when compute l has finished and the previous collective is done.
 * If the collective chain never waits for compute after the first layer, the last one ends at
 * b + L c; if it always waits, at L b + c; in general at max_i (i b + (L - i + 1) c), which is attained at
 * one of the ends, i = 1 or i = L. Compute ends at L b, so the exposed time is
 * max(L b + c, b + L c) - L b = max(c, L c - (L - 1) b). */
static double pipelined_exposed_s(double c, double b, double L) { return fmax(c, L * c - (L - 1.0) * b); }

/* Gradient and parameter collectives of one step over all N devices, as rings in device order 0 .. N-1
 * (bandwidth: the slowest link of that ring, latency: its largest). Every collective runs layer by layer:
 * a reduce-scatter or all-gather of all P parameters moves (N - 1) / N * P * b bytes per device and pays
 * (N - 1) latencies per layer. `b_fwd`, `b_bwd`: one layer's forward and backward (with recompute)
 * compute of the slowest device, one sequence. Gradients are reduced once per step, in the backward of
 * the last sequence; ZeRO-3 gathers parameters for every sequence. */
static void grad_sync_s(const cost_ctx *x, double b_fwd, double b_bwd, double *sync_s, double *exposed_s) {
    *sync_s = 0.0;
    *exposed_s = 0.0;
    int32_t N = x->c->n_devices;
    if (N == 1)
        return;
    double bw = x->c->ring_bw_min, lat = x->c->ring_lat_max_s; /* the ring 0 -> 1 -> ... -> N-1 -> 0 */
    double L = x->m->layers, seqs = x->t->sequences, ck = x->t->checkpointing ? 1.0 : 0.0;
    double P = L * hexiseq_layer_params(x->m) + 2.0 * (double)x->m->vocab * x->m->hidden + x->m->hidden;
    /* one reduce-scatter or all-gather of every parameter (A), and its per-layer part (a). Under uneven state
     * shares every rank's piece is padded to the largest share (or, as a ring, every step waits for the
     * largest piece): N - 1 steps of the largest share instead of (N - 1) / N of the whole. */
    double moved = (N - 1.0) / N;
    if (x->t->state_shares == HEXISEQ_STATES_BY_MEMORY && x->t->sharding != HEXISEQ_SHARD_NONE) {
        hexiseq_states_t largest;
        hexiseq_states(x->c, x->m, x->t, -1, &largest);
        moved = (N - 1.0) * largest.share;
    }
    double A = moved * P * x->m->dtype_bytes / bw + L * (N - 1.0) * lat;
    double a = A / L;
    switch (x->t->sharding) {
    case HEXISEQ_SHARD_FULL:
        /* per sequence: gather in the forward (hidden by forward compute), gather in the backward and again
         * for the recompute; the last sequence's backward also reduce-scatters the gradients */
        *sync_s = seqs * (2.0 + ck) * A + A;
        *exposed_s = seqs * pipelined_exposed_s(a, b_fwd, L) +
                     (seqs - 1.0) * pipelined_exposed_s((1.0 + ck) * a, b_bwd, L) +
                     pipelined_exposed_s((2.0 + ck) * a, b_bwd, L);
        break;
    case HEXISEQ_SHARD_GRAD_OPT:
        /* reduce-scatter of gradients behind the last backward, then an exposed gather of the parameters */
        *sync_s = 2.0 * A;
        *exposed_s = pipelined_exposed_s(a, b_bwd, L) + A;
        break;
    default:
        /* all-reduce (reduce-scatter + all-gather) of gradients behind the last backward */
        *sync_s = 2.0 * A;
        *exposed_s = pipelined_exposed_s(2.0 * a, b_bwd, L);
        break;
    }
}

static hexiseq_status validate_training(const hexiseq_training *t) {
    if (t->sequences < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "training.sequences must be >= 1, got %d", t->sequences);
    if (t->checkpointing != 0 && t->checkpointing != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "training.checkpointing must be 0 or 1, got %d", t->checkpointing);
    if (t->sharding < HEXISEQ_SHARD_FULL || t->sharding > HEXISEQ_SHARD_NONE)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "training.sharding must be in [0, 3], got %d", t->sharding);
    if (t->state_shares != HEXISEQ_STATES_EVEN && t->state_shares != HEXISEQ_STATES_BY_MEMORY)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "training.state_shares must be 0 (even) or 1 (by memory), got %d",
                            t->state_shares);
    if (!isfinite(t->reserved_gib) || t->reserved_gib < 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "training.reserved_gib must be a finite number >= 0, got %g",
                            t->reserved_gib);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_check_documents(const hexiseq_training *t, int64_t seq_len, int32_t causal) {
    const hexiseq_documents *d = t->documents;
    if (!d)
        return HEXISEQ_OK;
    if (d->n < 1 || !d->end || !d->tri || !d->tri_len)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "training.documents must come from hexiseq_documents_init");
    if (!causal)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "documents need causal attention (the document mask is causal)");
    if (d->end[d->n - 1] != seq_len)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "documents must add up to seq_len=%lld, they add up to %lld",
                            (long long)seq_len, (long long)d->end[d->n - 1]);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_check_inputs(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                    int64_t seq_len) {
    if (!c || !m || !t)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "cluster, model and training must not be NULL");
    HEXISEQ_CHECK(hexiseq_model_validate(m));
    HEXISEQ_CHECK(validate_training(t));
    if (seq_len < 1 || seq_len > HEXISEQ_MAX_SEQ_LEN)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "seq_len must be in [1, %lld], got %lld", (long long)HEXISEQ_MAX_SEQ_LEN,
                            (long long)seq_len);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_evaluate(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                int64_t seq_len, int32_t causal, const hexiseq_layout *l,
                                hexiseq_device_cost *per_device, hexiseq_plan_cost *out) {
    hexiseq_clear_error();
    if (!l || !per_device || !out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "layout, per_device and out must not be NULL");
    HEXISEQ_CHECK(hexiseq_check_inputs(c, m, t, seq_len));
    if (causal != 0 && causal != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "causal must be 0 or 1, got %d", causal);
    HEXISEQ_CHECK(hexiseq_check_documents(t, seq_len, causal));
    HEXISEQ_CHECK(validate_layout(c, m, seq_len, l));

    cost_ctx x;
    memset(&x, 0, sizeof x);
    x.c = c;
    x.m = m;
    x.t = t;
    x.l = l;
    x.seq_len = seq_len;
    x.causal = causal;
    x.docs = t->documents;
    x.a2a_group = -1;
    x.group_of = malloc((size_t)l->n_devices * sizeof *x.group_of);
    x.offset = malloc(((size_t)l->n_groups + 1) * sizeof *x.offset);
    x.span = malloc((size_t)l->n_groups * sizeof *x.span);
    double *group_a2a = calloc((size_t)l->n_groups, sizeof *group_a2a);
    x.step_pairs = malloc((size_t)l->n_groups * sizeof *x.step_pairs);
    x.doc_len = malloc((size_t)l->n_groups * sizeof *x.doc_len);
    x.hold = malloc((size_t)l->n_devices * sizeof *x.hold);
    x.hold_off = malloc(((size_t)l->n_groups + 1) * sizeof *x.hold_off);
    x.first_holder = malloc((size_t)l->n_groups * (size_t)m->kv_heads * sizeof *x.first_holder);
    x.kv_lo = malloc((size_t)l->n_devices * sizeof *x.kv_lo);
    x.kv_n = malloc((size_t)l->n_devices * sizeof *x.kv_n);
    x.first_n = malloc((size_t)l->n_devices * sizeof *x.first_n);
    if (!x.group_of || !x.offset || !x.span || !group_a2a || !x.step_pairs || !x.doc_len || !x.hold || !x.hold_off ||
        !x.first_holder || !x.kv_lo || !x.kv_n || !x.first_n || !ring_types_build(&x)) {
        free(x.kv_lo);
        free(x.kv_n);
        free(x.first_n);
        free(x.first_holder);
        free(x.hold);
        free(x.hold_off);
        ring_types_free(&x);
        free(x.step_pairs);
        free(x.doc_len);
        free(x.group_of);
        free(x.offset);
        free(x.span);
        free(group_a2a);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate cost model scratch for %d devices", l->n_devices);
    }
    x.offset[0] = 0;
    x.hold_off[0] = 0;
    for (int32_t g = 0, held = 0; g < l->n_groups; ++g) {
        x.offset[g + 1] = x.offset[g] + l->group_size[g];
        for (int32_t r = x.offset[g]; r < x.offset[g + 1]; ++r) {
            x.group_of[r] = g;
            hexiseq_kv_range(m, l->head_lo[r], l->head_count[r], &x.kv_lo[r], &x.kv_n[r]);
            if (l->head_count[r] > 0)
                x.hold[held++] = r;
        }
        x.hold_off[g + 1] = held;
    }
    first_holders(&x);
    hexiseq_layout_spans(l, x.span);
    if (x.docs)
        for (int32_t g = 0; g < l->n_groups; ++g) {
            double w = 0.0, wl = 0.0;
            const hexiseq_group_span *sp = &x.span[g];
            hexiseq_document_pieces(x.docs, sp->front_start, sp->front_start + sp->front_len, &w, &wl);
            hexiseq_document_pieces(x.docs, sp->back_start, sp->back_start + sp->back_len, &w, &wl);
            x.doc_len[g] = w > 0 ? wl / w : 1.0;
        }
    if (l->n_groups > 1)
        for (int32_t g = 0; g < l->n_groups; ++g)
            x.max_block = fmax(x.max_block, (double)l->group_seq[g]);
    /* Adjacent members of a group alike in everything a term reads get that term copied, bit for bit:
     * compute and memory (same device class, tokens, heads, kv heads), the ring term (same class, heads and
     * ring link), and the all-to-all (same node, tokens, heads and kv heads, node-derived links: the two
     * see the same peer terms in the same order). */
    int links_by_node = !c->bw && !c->lat;
    ring_link prev_link;
    double prev_attn_fwd = 0.0, prev_gemm_fwd = 0.0;

    memset(out, 0, sizeof *out);
    out->short_device = -1;
    out->fits = 1;
    double b_fwd = 0.0, b_bwd = 0.0, ckpt = t->checkpointing ? 1.0 : 0.0;
    hexiseq_status st = HEXISEQ_OK;
    for (int32_t r = 0; r < l->n_devices; ++r) {
        hexiseq_device_cost *dc = &per_device[r];
        memset(dc, 0, sizeof *dc);
        int32_t g = x.group_of[r], G = l->n_groups;
        int first = r == x.offset[g];
        if (first) { /* the group's pairs per ring step (grouped pricing needs only its own block's) */
            for (int32_t k = 0; k < (x.n_types ? 1 : G); ++k)
                x.step_pairs[k] = group_pairs(&x.span[g], &x.span[(g - k + G) % G], causal, x.docs);
            if (x.n_types && g > 0)
                x.type_before[x.type_of[g - 1]]++;
            if (!a2a_kinds_build(&x, g)) {
                st = hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate cost model scratch for %d devices", l->n_devices);
                break;
            }
        }
        const hexiseq_device_info *d = &c->dev[l->device[r]];
        dc->kv_lo = x.kv_lo[r];
        dc->kv_count = x.kv_n[r];
        dc->first_count = x.first_n[r]; /* first-held heads are contiguous: the count and the lowest one */
        for (int32_t h = x.kv_lo[r]; dc->first_count && h < x.kv_lo[r] + x.kv_n[r]; ++h)
            if (kv_holder(&x, g, h) == r) {
                dc->first_lo = h;
                break;
            }
        const hexiseq_device_cost *pc = first ? NULL : &per_device[r - 1];
        /* alike the previous member of its group: same device class, tokens, heads, kv heads */
        int alike = pc && same_device(c, l->device[r], l->device[r - 1]) && l->tokens[r] == l->tokens[r - 1] &&
                    l->head_count[r] == l->head_count[r - 1] && dc->kv_count == pc->kv_count;
        double gemm_fwd, attn_fwd;
        if (alike) {
            dc->gemm_s = pc->gemm_s;
            dc->layer_gemm_s = pc->layer_gemm_s;
            gemm_fwd = prev_gemm_fwd;
        } else {
            dc->gemm_s = gemm_time_s(&x, d, l->tokens[r]);
            gemm_fwd = layer_gemm_fwd_s(&x, d, l->tokens[r]);
            dc->layer_gemm_s = gemm_fwd * (1.0 + GEMM_BWD_FACTOR);
        }
        if (pc && links_by_node && c->node_of[l->device[r]] == c->node_of[l->device[r - 1]] &&
            l->tokens[r] == l->tokens[r - 1] && l->head_count[r] == l->head_count[r - 1] &&
            dc->kv_count == pc->kv_count && dc->first_count == pc->first_count) {
            dc->a2a_s = pc->a2a_s;
            dc->a2a_send_bytes = pc->a2a_send_bytes;
            dc->a2a_recv_bytes = pc->a2a_recv_bytes;
            dc->a2a_grad_send_bytes = pc->a2a_grad_send_bytes;
            dc->a2a_grad_recv_bytes = pc->a2a_grad_recv_bytes;
        } else {
            double bytes[4];
            dc->a2a_s = a2a_time_s(&x, r, bytes);
            dc->a2a_send_bytes = bytes[0];
            dc->a2a_recv_bytes = bytes[1];
            dc->a2a_grad_send_bytes = bytes[2];
            dc->a2a_grad_recv_bytes = bytes[3];
        }
        ring_link link;
        ring_link_of(&x, r, &link);
        dc->ring_send_bytes = link.send_bytes;
        dc->ring_recv_bytes = link.recv_bytes;
        if (pc && l->head_count[r] == l->head_count[r - 1] && memcmp(&link, &prev_link, sizeof link) == 0 &&
            same_device(c, l->device[r], l->device[r - 1])) {
            dc->attn_s = pc->attn_s;
            dc->ring_exposed_s = pc->ring_exposed_s;
            attn_fwd = prev_attn_fwd;
        } else {
            ring_time_s(&x, r, &link, &dc->attn_s, &dc->ring_exposed_s, &attn_fwd);
        }
        dc->runtime_s = runtime_time_s(&x, d, r);
        prev_link = link;
        prev_attn_fwd = attn_fwd;
        prev_gemm_fwd = gemm_fwd;
        /* one layer's compute of this device, forward and backward (with recompute), one sequence */
        b_fwd = fmax(b_fwd, gemm_fwd + attn_fwd);
        b_bwd = fmax(b_bwd, gemm_fwd * (GEMM_BWD_FACTOR + ckpt) + attn_fwd * (ATTN_BWD_FACTOR + ckpt));
        if (alike) { /* memory: same states, ring buffers, cap; same tokens and group */
            dc->mem_states_gib = pc->mem_states_gib;
            dc->mem_act_gib = pc->mem_act_gib;
            dc->mem_attn_gib = pc->mem_attn_gib;
            dc->mem_ring_gib = pc->mem_ring_gib;
            dc->mem_total_gib = pc->mem_total_gib;
            dc->mem_cap_gib = pc->mem_cap_gib;
            dc->state_share = pc->state_share;
        } else {
            memory_terms(&x, r, dc->kv_count, dc);
        }
        group_a2a[x.group_of[r]] = fmax(group_a2a[x.group_of[r]], dc->a2a_s);
        double ring_s = dc->attn_s + dc->ring_exposed_s + dc->runtime_s;
        if (dc->gemm_s > out->gemm_phase_s || r == 0) {
            out->gemm_phase_s = dc->gemm_s;
            out->gemm_bottleneck = l->device[r];
        }
        if (ring_s > out->ring_phase_s || r == 0) {
            out->ring_phase_s = ring_s;
            out->ring_bottleneck = l->device[r];
        }
        double shortfall = dc->mem_total_gib - dc->mem_cap_gib;
        if (shortfall > 0 && shortfall > out->short_gib) {
            out->fits = 0;
            out->short_gib = shortfall;
            out->short_device = l->device[r];
        }
    }
    out->a2a_bottleneck = l->device[0];
    for (int32_t r = 0; r < l->n_devices && st == HEXISEQ_OK; ++r) {
        hexiseq_device_cost *dc = &per_device[r];
        double ga = group_a2a[x.group_of[r]];
        dc->busy_s = dc->gemm_s + ga + dc->attn_s + dc->ring_exposed_s + dc->runtime_s;
        if (ga > out->a2a_phase_s) {
            out->a2a_phase_s = ga;
            out->a2a_bottleneck = l->device[r];
        }
    }
    /* Phases are separated by synchronisations (the all-to-all waits for the whole group, the ring for
     * its neighbours), so the step costs the slowest device of each phase, summed; then what the
     * gradient collectives add beyond the compute that hides them. */
    if (st == HEXISEQ_OK)
        grad_sync_s(&x, b_fwd, b_bwd, &out->grad_sync_s, &out->grad_exposed_s);
    out->step_time_s = out->gemm_phase_s + out->a2a_phase_s + out->ring_phase_s + out->grad_exposed_s;
    out->lower_bound_s = lower_bound_s(&x);
    out->tokens_per_s = (double)t->sequences * (double)seq_len / out->step_time_s;
    free(x.group_of);
    free(x.offset);
    free(x.span);
    free(x.step_pairs);
    free(x.doc_len);
    free(group_a2a);
    free(x.hold);
    free(x.hold_off);
    free(x.first_holder);
    free(x.kv_lo);
    free(x.kv_n);
    free(x.first_n);
    ring_types_free(&x);
    a2a_kinds_free(&x);
    return st;
}
