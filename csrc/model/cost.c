/* The cost model: validates a layout and predicts its step time, per-device terms and memory.
 *
 * docs/cost_model.md explains every formula in words; each lives once, in this file (validation, the sum of
 * the terms, the lower bound) or in the file of its term: cost_gemm.c (token-parallel compute), cost_a2a.c
 * (all-to-all), cost_ring.c (attention and the ring), cost_sync.c (gradient collectives), cost_memory.c
 * (memory); cost_terms.h holds what several of them share. Units: FLOPs, bytes, seconds, bytes/s
 * internally; GiB and GB/s only at the API. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cost_terms.h"

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

/* Total work over total rate, phase by phase: no layout of these devices can be faster. */
/* Whether windowed layers are priced as such: a causal model with a window, priced step by step. */
static int windowed(const cost_ctx *x) { return x->m->window > 0 && x->causal && x->n_types == 0; }

/* x->window_steps: as the runtime's Topology.ring_steps, one more than the farthest ring step at which some
 * group's queries see some key of the block under the window (G without one). O(G^2) pair counts: rings of more
 * than 4096 groups (grouped pricing takes them anyway) keep G. */
static void window_steps(cost_ctx *x) {
    int32_t G = x->l->n_groups, last = 0;
    x->window_steps = G;
    if (!windowed(x) || G > 4096)
        return;
    for (int32_t g = 0; g < G; ++g)
        for (int32_t k = G - 1; k > last; --k) /* only steps past the farthest found so far can raise it */
            if (hexiseq_group_pairs(&x->span[g], &x->span[(g - k + G) % G], 1, NULL, x->m->window) > 0) {
                last = k;
                break;
            }
    x->window_steps = last + 1;
}

static double lower_bound_s(const cost_ctx *x) {
    double gemm_rate = x->c->gemm_rate_sum, attn_rate = x->c->attn_rate_sum[x->causal ? 1 : 0];
    double S = (double)x->seq_len, seqs = x->t->sequences;
    double gemm_flops = seqs * S *
                        (x->m->layers * layer_gemm_flops_per_token(x->m) * gemm_passes(x->t) +
                         head_gemm_flops_per_token(x->m) * (1.0 + GEMM_BWD_FACTOR));
    double pairs = x->docs ? (double)x->docs->tri[x->docs->n] : x->causal ? S * (S + 1.0) / 2.0 : S * S;
    double layer_pairs = x->m->layers * pairs;
    if (x->m->window > 0 && x->causal) { /* the windowed layers' pairs (under documents: the smaller, as priced) */
        double w = (double)hexiseq_window_pairs(0, x->seq_len, 0, x->seq_len, x->m->window);
        layer_pairs += x->m->window_layers * (fmin(w, pairs) - pairs);
    }
    double attn_flops = seqs * attn_fwd_flops(x->m, layer_pairs, x->m->heads) * attn_passes(x->t);
    /* the memory-bound work spread over every device's bandwidth, the optimizer step at its smallest (every
     * parameter updated once); none where some device's bandwidth is unknown (it is charged nothing there) */
    double mem_rate = 0.0;
    for (int32_t d = 0; d < x->c->n_devices; ++d) {
        if (x->c->dev[d].mem_bound_gbps <= 0.0) {
            mem_rate = 0.0;
            break;
        }
        mem_rate += x->c->dev[d].mem_bound_gbps * 1e9;
    }
    double mem_bytes = seqs * S * (x->m->layers * layer_mem_elems_per_token(x->m) * x->m->dtype_bytes *
                                   mem_bound_passes(x->t) + head_vocab(x->m) * loss_bytes_per_logit(x->m)) +
                       hexiseq_total_params(x->m) * optimizer_bytes_per_param(x->m);
    return gemm_flops / gemm_rate + attn_flops / attn_rate + (mem_rate > 0.0 ? mem_bytes / mem_rate : 0.0);
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
    if (t->memory_features < 0 || t->memory_features > HEXISEQ_MEMORY_FEATURES_ALL)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "training.memory_features must be a mask in [0, %d], got %d",
                            HEXISEQ_MEMORY_FEATURES_ALL, t->memory_features);
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
    x.step_pairs_w = malloc((size_t)l->n_groups * sizeof *x.step_pairs_w);
    x.doc_len = malloc((size_t)l->n_groups * sizeof *x.doc_len);
    x.hold = malloc((size_t)l->n_devices * sizeof *x.hold);
    x.hold_off = malloc(((size_t)l->n_groups + 1) * sizeof *x.hold_off);
    x.first_holder = malloc((size_t)l->n_groups * (size_t)m->kv_heads * sizeof *x.first_holder);
    x.kv_lo = malloc((size_t)l->n_devices * sizeof *x.kv_lo);
    x.kv_n = malloc((size_t)l->n_devices * sizeof *x.kv_n);
    x.first_n = malloc((size_t)l->n_devices * sizeof *x.first_n);
    if (!x.group_of || !x.offset || !x.span || !group_a2a || !x.step_pairs || !x.step_pairs_w || !x.doc_len || !x.hold || !x.hold_off ||
        !x.first_holder || !x.kv_lo || !x.kv_n || !x.first_n || !hexiseq_ring_types_build(&x)) {
        free(x.kv_lo);
        free(x.kv_n);
        free(x.first_n);
        free(x.first_holder);
        free(x.hold);
        free(x.hold_off);
        hexiseq_ring_types_free(&x);
        free(x.step_pairs);
        free(x.step_pairs_w);
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
    window_steps(&x);
    if (x.docs)
        for (int32_t g = 0; g < l->n_groups; ++g) {
            double w = 0.0, wl = 0.0;
            const hexiseq_group_span *sp = &x.span[g];
            if (span_joined(sp)) { /* one chunk to the kernels: a document crossing the seam is one piece */
                hexiseq_document_pieces(x.docs, sp->front_start, sp->back_start + sp->back_len, &w, &wl);
            } else {
                hexiseq_document_pieces(x.docs, sp->front_start, sp->front_start + sp->front_len, &w, &wl);
                hexiseq_document_pieces(x.docs, sp->back_start, sp->back_start + sp->back_len, &w, &wl);
            }
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
            for (int32_t k = 0; k < (x.n_types ? 1 : G); ++k) {
                x.step_pairs[k] = hexiseq_group_pairs(&x.span[g], &x.span[(g - k + G) % G], causal, x.docs, 0);
                if (windowed(&x))
                    x.step_pairs_w[k] = hexiseq_group_pairs(&x.span[g], &x.span[(g - k + G) % G], causal, x.docs,
                                                            m->window);
            }
            if (x.n_types && g > 0)
                x.type_before[x.type_of[g - 1]]++;
            if (!hexiseq_a2a_kinds_build(&x, g)) {
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
            dc->gemm_s = hexiseq_gemm_time_s(&x, d, l->tokens[r]);
            gemm_fwd = hexiseq_layer_gemm_fwd_s(&x, d, l->tokens[r]);
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
            dc->a2a_s = hexiseq_a2a_time_s(&x, r, bytes);
            dc->a2a_send_bytes = bytes[0];
            dc->a2a_recv_bytes = bytes[1];
            dc->a2a_grad_send_bytes = bytes[2];
            dc->a2a_grad_recv_bytes = bytes[3];
        }
        ring_link link;
        hexiseq_ring_link_of(&x, r, &link);
        dc->ring_send_bytes = link.send_bytes;
        dc->ring_recv_bytes = link.recv_bytes;
        if (pc && l->head_count[r] == l->head_count[r - 1] && memcmp(&link, &prev_link, sizeof link) == 0 &&
            same_device(c, l->device[r], l->device[r - 1])) {
            dc->attn_s = pc->attn_s;
            dc->ring_exposed_s = pc->ring_exposed_s;
            attn_fwd = prev_attn_fwd;
        } else {
            hexiseq_ring_time_s(&x, r, &link, &dc->attn_s, &dc->ring_exposed_s, &attn_fwd);
        }
        dc->runtime_s = hexiseq_runtime_time_s(&x, d, r);
        prev_link = link;
        prev_attn_fwd = attn_fwd;
        prev_gemm_fwd = gemm_fwd;
        if (alike) { /* memory: same states, ring buffers, cap; same tokens and group */
            dc->mem_states_gib = pc->mem_states_gib;
            dc->mem_act_gib = pc->mem_act_gib;
            dc->mem_attn_gib = pc->mem_attn_gib;
            dc->mem_ring_gib = pc->mem_ring_gib;
            dc->mem_total_gib = pc->mem_total_gib;
            dc->mem_cap_gib = pc->mem_cap_gib;
            dc->state_share = pc->state_share;
            dc->mem_bound_s = pc->mem_bound_s;
            dc->layer_mem_bound_s = pc->layer_mem_bound_s;
            dc->features = pc->features;
            dc->offload_s = pc->offload_s;
            dc->tiling_s = pc->tiling_s;
            dc->mem_host_gib = pc->mem_host_gib;
            dc->host_cap_gib = pc->host_cap_gib;
        } else {
            hexiseq_memory_terms(&x, r, dc->kv_count, dc);
            /* the optimizer step covers the parameters whose optimizer states the device holds */
            double opt_params = hexiseq_total_params(m) * (t->sharding == HEXISEQ_SHARD_NONE ? 1.0 : dc->state_share);
            dc->mem_bound_s = hexiseq_mem_bound_time_s(&x, d, l->tokens[r], opt_params);
            dc->layer_mem_bound_s = hexiseq_layer_mem_bound_s(&x, d, l->tokens[r]);
        }
        /* one layer's compute of this device, forward and backward (with recompute), one sequence */
        double mem_fwd = dc->layer_mem_bound_s / (1.0 + MEM_BOUND_BWD_FACTOR);
        double layer_fwd = gemm_fwd + attn_fwd + mem_fwd, layer_bwd = gemm_fwd * (GEMM_BWD_FACTOR + ckpt) +
                                                                      attn_fwd * (ATTN_BWD_FACTOR + ckpt) +
                                                                      mem_fwd * (MEM_BOUND_BWD_FACTOR + ckpt);
        if (!alike) /* short of memory: the memory features that make it fit, if the training allows them */
            hexiseq_memory_choose(&x, r, dc->kv_count, d, layer_fwd, layer_bwd, dc);
        b_fwd = fmax(b_fwd, layer_fwd);
        b_bwd = fmax(b_bwd, layer_bwd);
        group_a2a[x.group_of[r]] = fmax(group_a2a[x.group_of[r]], dc->a2a_s);
        double ring_s = dc->attn_s + dc->ring_exposed_s + dc->runtime_s;
        double token_s = dc->gemm_s + dc->mem_bound_s + dc->offload_s + dc->tiling_s;
        if (token_s > out->gemm_phase_s || r == 0) {
            out->gemm_phase_s = token_s;
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
        dc->busy_s = dc->gemm_s + dc->mem_bound_s + dc->offload_s + dc->tiling_s + ga + dc->attn_s +
                     dc->ring_exposed_s + dc->runtime_s;
        if (ga > out->a2a_phase_s) {
            out->a2a_phase_s = ga;
            out->a2a_bottleneck = l->device[r];
        }
    }
    /* Phases are separated by synchronisations (the all-to-all waits for the whole group, the ring for
     * its neighbours), so the step costs the slowest device of each phase, summed; then what the
     * gradient collectives add beyond the compute that hides them. */
    if (st == HEXISEQ_OK)
        hexiseq_grad_sync_s(&x, b_fwd, b_bwd, &out->grad_sync_s, &out->grad_exposed_s);
    out->step_time_s = out->gemm_phase_s + out->a2a_phase_s + out->ring_phase_s + out->grad_exposed_s;
    out->lower_bound_s = lower_bound_s(&x);
    out->tokens_per_s = (double)t->sequences * (double)seq_len / out->step_time_s;
    free(x.group_of);
    free(x.offset);
    free(x.span);
    free(x.step_pairs);
    free(x.step_pairs_w);
    free(x.doc_len);
    free(group_a2a);
    free(x.hold);
    free(x.hold_off);
    free(x.first_holder);
    free(x.kv_lo);
    free(x.kv_n);
    free(x.first_n);
    hexiseq_ring_types_free(&x);
    hexiseq_a2a_kinds_free(&x);
    return st;
}
