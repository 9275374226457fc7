/* Private to the cost model's files (cost.c and cost_*.c): the evaluation context, the factors and FLOP counts
 * several terms share, and the terms the driver (cost.c) sums. */
#ifndef HEXISEQ_COST_TERMS_H
#define HEXISEQ_COST_TERMS_H

#include "internal.h"

/* Kernel efficiency falls for short dimensions: rate = peak * eff * n / (n + half). The half-points
 * fit FlashAttention-2's forward curve on H100 (about 57% of its plateau at 512 tokens) and the usual
 * cuBLAS behaviour for matmuls with a few hundred rows. */
#define ATTN_HALF_TOKENS 384.0
#define GEMM_HALF_TOKENS 128.0

/* Its backward moves about twice the forward's bytes (it reads the saved inputs and the incoming gradient and
 * writes the input gradient, where the forward read one and wrote one). */
#define MEM_BOUND_BWD_FACTOR 2.0

/* Backward costs this many forwards (attention: two extra matmul pairs plus recomputing P). */
#define ATTN_BWD_FACTOR 2.5
#define GEMM_BWD_FACTOR 2.0

/* One evaluation: what it reads and the scratch its terms share, built by hexiseq_evaluate (cost.c). */
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
    double *step_pairs_w;     /* [n_groups] the same under the model's window (when it has one) */
    int32_t window_steps;     /* ring steps a windowed layer takes (topology's ring_steps: one more than the
                                 farthest step at which some group meets a key in some query's window); n_groups
                                 without a window, and under grouped pricing (which prices windowed layers as
                                 full ones) */
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
     * own node are priced one by one. Filled per group by hexiseq_a2a_kinds_build. */
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
static inline double layer_gemm_flops_per_token(const hexiseq_model *m) {
    double H = m->hidden, q = (double)m->heads * m->head_dim, kv = (double)m->kv_heads * m->head_dim;
    return 2.0 * (H * q + 2.0 * H * kv + q * H + (m->gated_mlp ? 3.0 : 2.0) * H * m->ffn);
}

/* Elements one layer's memory-bound forward reads and writes per token: two norms (read H, write H each), two
 * residual adds (read 2H, write H each), rotary embedding of q and k (read and write both), and the MLP's
 * activation (gated: read gate and up, write their product; else read and write the intermediate). */
static inline double layer_mem_elems_per_token(const hexiseq_model *m) {
    double H = m->hidden, q = (double)m->heads * m->head_dim, kv = (double)m->kv_heads * m->head_dim;
    return 4.0 * H + 6.0 * H + 2.0 * (q + kv) + (m->gated_mlp ? 3.0 : 2.0) * m->ffn;
}

/* Bytes the loss moves per token and vocabulary entry, forward and backward: the logits read and their gradient
 * written in the training dtype, and the fp32 softmax written and read once (a fused cross-entropy). */
static inline double loss_bytes_per_logit(const hexiseq_model *m) { return 2.0 * m->dtype_bytes + 8.0; }

/* Bytes the untiled loss holds per token and vocabulary entry at its peak, in the backward: the logits in the
 * training dtype, their fp32 log-softmax (kept for the backward) and its fp32 gradient beside it. Tiling the loss
 * on an H100 saved 9.27 GiB at 32K tokens and a 32000 vocabulary (benchmarks/gpu_memory_features.py), 9.5 bytes per
 * logit beyond one tile's: the b + 4 counted before (no gradient) was 1.8x low. */
static inline double loss_memory_per_logit(const hexiseq_model *m) { return m->dtype_bytes + 8.0; }

/* Bytes the optimizer step moves per parameter it updates (Adam): the fp32 master weight, first and second
 * moments read and written (24), the gradient read (in fp32, 4), and below fp32 the working copy written. */
static inline double optimizer_bytes_per_param(const hexiseq_model *m) {
    return 28.0 + (m->dtype_bytes < 4 ? m->dtype_bytes : 0.0);
}

/* Forward passes per step of the memory-bound layer work: forward, backward (+1 recompute). */
static inline double mem_bound_passes(const hexiseq_training *t) {
    return 1.0 + MEM_BOUND_BWD_FACTOR + (t->checkpointing ? 1.0 : 0.0);
}

/* The vocabulary the output head and the loss run over: the model's, or 0 in a pipeline stage without the head. */
static inline double head_vocab(const hexiseq_model *m) { return m->no_head ? 0.0 : (double)m->vocab; }

/* Forward FLOPs of the output head per token. */
static inline double head_gemm_flops_per_token(const hexiseq_model *m) { return 2.0 * (double)m->hidden * head_vocab(m); }

/* Forward passes per step for the layers: 1 forward + backward (+1 recompute with checkpointing). */
static inline double gemm_passes(const hexiseq_training *t) {
    return 1.0 + GEMM_BWD_FACTOR + (t->checkpointing ? 1.0 : 0.0);
}
static inline double attn_passes(const hexiseq_training *t) {
    return 1.0 + ATTN_BWD_FACTOR + (t->checkpointing ? 1.0 : 0.0);
}

/* Forward attention FLOPs for `pairs` visible pairs and h query heads (QK^T and PV: 2 + 2 per dim). */
static inline double attn_fwd_flops(const hexiseq_model *m, double pairs, int32_t h) {
    return 4.0 * pairs * m->head_dim * h;
}

/* Layout slot in group g that sends kv head h around the ring: the first member holding it. */
static inline int32_t kv_holder(const cost_ctx *x, int32_t g, int32_t h) {
    return x->first_holder[(int64_t)g * x->m->kv_heads + h];
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

/* ------------------------------------------------------------------ the terms, by file */

/* cost_gemm.c: token-parallel compute of a device over the whole step, and of one layer's forward for one
 * sequence, seconds. */
double hexiseq_gemm_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens);
double hexiseq_layer_gemm_fwd_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens);
/* cost_gemm.c: the memory-bound work of a device over the whole step (layers, loss, and the optimizer step over
 * `opt_params` parameters), and of one layer's forward + backward for one sequence, seconds (0 where the device's
 * memory bandwidth is unknown). */
double hexiseq_mem_bound_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens, double opt_params);
double hexiseq_layer_mem_bound_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens);
/* cost_gemm.c: what tiling the MLP and / or the loss (features) adds to a device's step: one more forward of each
 * tiled part, and every pass of it at the rate of a tile's rows instead of the device's tokens, seconds. */
double hexiseq_tiling_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens, int32_t features);
/* cost_gemm.c: the copies of offloaded checkpoints not hidden behind compute: per layer and sequence, one copy of
 * the layer's checkpoint to the host during its forward (fwd_s) and one back during the next layer's backward with
 * recompute (bwd_s), over the device's host link, seconds. */
double hexiseq_offload_time_s(const cost_ctx *x, const hexiseq_device_info *d, int64_t tokens, double fwd_s,
                              double bwd_s);

/* A group's front and back chunks touch (the only group of a ring, the middle group of an odd one): the runtime
 * joins them into one chunk (hexiseq.runtime.topology), so the kernels see one block of the group's tokens. */
static inline int span_joined(const hexiseq_group_span *sp) {
    return sp->back_len > 0 && sp->front_start + sp->front_len == sp->back_start;
}

/* cost_ring.c: visible pairs between two groups' positions; the ring links of slot r; its attention and
 * exposed ring time over the whole step (and one layer's forward attention); the runtime's work around the
 * kernels; the ring step types of grouped pricing (0 when out of memory). */
double hexiseq_group_pairs(const hexiseq_group_span *sq, const hexiseq_group_span *sk, int32_t causal,
                           const hexiseq_documents *docs, int64_t window);
void hexiseq_ring_link_of(const cost_ctx *x, int32_t r, ring_link *out);
void hexiseq_ring_time_s(const cost_ctx *x, int32_t r, const ring_link *link, double *attn_s, double *exposed_s,
                         double *fwd_layer_s);
double hexiseq_runtime_time_s(const cost_ctx *x, const hexiseq_device_info *d, int32_t r);
int hexiseq_ring_types_build(cost_ctx *x);
void hexiseq_ring_types_free(cost_ctx *x);

/* cost_a2a.c: the all-to-all of slot r over the whole step, seconds (bytes[4]: one layer's forward sent and
 * received, backward sent and received, one sequence); the kinds of member of group g for grouped pricing
 * (0 when out of memory). */
double hexiseq_a2a_time_s(const cost_ctx *x, int32_t r, double *bytes);
int hexiseq_a2a_kinds_build(cost_ctx *x, int32_t g);
void hexiseq_a2a_kinds_free(cost_ctx *x);

/* cost_memory.c: memory of slot r without memory features, filled into the GiB fields of `out`. */
void hexiseq_memory_terms(const cost_ctx *x, int32_t r, int32_t kv_n, hexiseq_device_cost *out);
/* cost_memory.c: when slot r (device d) does not fit as hexiseq_memory_terms left `out`, the memory features the
 * training allows that make it fit with the least added time (else those that leave it least short), their memory
 * and times in `out` (fwd_s, bwd_s: the device's one layer forward, and backward with recompute, one sequence:
 * what the offloaded copies hide behind). */
void hexiseq_memory_choose(const cost_ctx *x, int32_t r, int32_t kv_n, const hexiseq_device_info *d, double fwd_s,
                           double bwd_s, hexiseq_device_cost *out);

/* cost_sync.c: gradient and parameter collectives of the step, and what of them compute does not hide,
 * seconds. */
void hexiseq_grad_sync_s(const cost_ctx *x, double b_fwd, double b_bwd, double *sync_s, double *exposed_s);

#endif /* HEXISEQ_COST_TERMS_H */
