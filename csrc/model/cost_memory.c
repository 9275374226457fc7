/* Cost term: memory per device (model states under each sharding, activations, attention tensors, ring
 * buffers), and the coefficients the scheduler's water-filling reads. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cost_terms.h"

#define GIB 1073741824.0

void hexiseq_states(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t, int32_t device,
                    hexiseq_states_t *out) {
    double P = hexiseq_total_params(m);
    double b = m->dtype_bytes;
    double opt = 8.0 + (b < 4 ? 4.0 : 0.0); /* Adam m, v in fp32, plus an fp32 master copy below fp32 */
    /* the largest tensor gathered at once: a layer's, or the embedding's or head's matrix where the model holds one */
    double vocab_matrix = (m->no_embedding && m->no_head) ? 0.0 : (double)m->vocab * m->hidden;
    double gathered = fmax(hexiseq_layer_params(m), vocab_matrix) * b;
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

int32_t hexiseq_memory_features_allowed(const hexiseq_training *t, const hexiseq_device_info *d) {
    int32_t f = t->memory_features & HEXISEQ_MEMORY_FEATURES_ALL;
    if (!t->checkpointing || !(d->host_gbps > 0) || !(d->host_memory_gib > 0))
        f &= ~HEXISEQ_OFFLOAD;
    return f;
}

void hexiseq_memory_coeffs(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                           int32_t device, int32_t heads, int32_t kv_n, double ring_block, int32_t features,
                           hexiseq_memory_coeffs_t *out) {
    hexiseq_states_t st;
    hexiseq_states(c, m, t, device, &st);
    double b = m->dtype_bytes;
    double H = m->hidden;
    /* saved per token and layer: 2 norm inputs, 2 norm outputs, attention output, MLP intermediates */
    double act_layer = b * (4.0 * H + (double)m->heads * m->head_dim + (m->gated_mlp ? 3.0 : 2.0) * m->ffn);
    double mlp = b * (m->gated_mlp ? 3.0 : 2.0) * m->ffn, logits = head_vocab(m) * loss_memory_per_logit(m);
    double act = t->checkpointing ? m->layers * H * b + act_layer : m->layers * act_layer;
    double host = 0.0, tile = 0.0;
    if ((features & HEXISEQ_OFFLOAD) && t->checkpointing) { /* the checkpoints go to the host; the one being
                                                               copied and the next stay */
        host = m->layers * H * b;
        act = fmin(m->layers, 2.0) * H * b + act_layer;
    }
    if (features & HEXISEQ_TILE_MLP) { /* the MLP keeps its input (a norm output, counted): one tile's intermediates */
        act -= (t->checkpointing ? 1.0 : m->layers) * mlp;
        tile += mlp;
    }
    if (features & HEXISEQ_TILE_LOSS)
        tile += logits; /* one tile's logits, their fp32 softmax and its gradient */
    else
        act += logits; /* the logits, their fp32 softmax and its gradient */
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
    out->tile_per_token_gib = tile / GIB;
    out->host_per_token_gib = host / GIB;
    out->host_cap_gib = c->dev[device].host_memory_gib;
}

int64_t hexiseq_memory_tokens_bound(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t) {
    /* Every term of a device's memory is >= 0, so for any layout that fits, summing each device's budget over the
     * devices gives  sum_r (per_token_r tokens_r + attention_r) <= R = sum_r max(0, cap_r - states_r - reserved).
     * In a group the devices' head ranges cover every head once, so their attention tensors add up to at least A
     * per token (those of all heads and kv heads), and the groups' tokens add up to S. Each token lies on one
     * device and costs it at least the least per-token figure of any device: `cheap` with every memory feature
     * the training allows there (each only lowers it; the tile they add is >= 0), `dear` without offloading,
     * which holds no more tokens than the device's host memory takes (and its room at the cheap figure). So at
     * most `most_cheap` tokens cost `cheap` and the rest at least `dear`: S is at most what R buys, the cheap ones
     * first. Ring buffers, tiles and the one feature set per device only add constraints. */
    double room = 0.0, cheap = INFINITY, dear = INFINITY, attention = 0.0, most_cheap = 0.0;
    for (int32_t r = 0; r < c->n_devices; ++r) {
        int32_t allowed = hexiseq_memory_features_allowed(t, &c->dev[r]);
        hexiseq_memory_coeffs_t mc, no_offload;
        hexiseq_memory_coeffs(c, m, t, r, m->heads, m->kv_heads, 0.0, allowed, &mc);
        hexiseq_memory_coeffs(c, m, t, r, m->heads, m->kv_heads, 0.0, allowed & ~HEXISEQ_OFFLOAD, &no_offload);
        double free_gib = fmax(0.0, mc.cap_gib - mc.states_gib - mc.reserved_gib);
        room += free_gib;
        attention = mc.per_group_token_gib; /* the same on every device */
        dear = fmin(dear, no_offload.per_token_gib);
        if (mc.host_per_token_gib > 0.0) {
            cheap = fmin(cheap, mc.per_token_gib);
            double held = mc.per_token_gib > 0.0 ? free_gib / mc.per_token_gib : INFINITY;
            most_cheap += fmin(mc.host_cap_gib / mc.host_per_token_gib, held);
        }
    }
    cheap = fmin(cheap, dear);
    if (!(cheap + attention > 0.0))
        return INT64_MAX;
    double n_cheap = fmin(most_cheap, room / (cheap + attention));
    double tokens = n_cheap + (room - n_cheap * (cheap + attention)) / (dear + attention);
    /* rounded up by a part in 1e9: a device's memory an exact number of tokens' worth gives that number here and
     * in the evaluation's sums, each rounded its own way, and the bound must not come out one token short */
    tokens = tokens * (1.0 + 1e-9) + 1e-6;
    if (!(tokens < 9.0e18))
        return INT64_MAX;
    return (int64_t)floor(tokens);
}

/* Memory of slot r with `features`, filled into the GiB fields of `out`. */
static void memory_terms(const cost_ctx *x, int32_t r, int32_t kv_n, int32_t features, hexiseq_device_cost *out) {
    hexiseq_memory_coeffs_t mc;
    hexiseq_memory_coeffs(x->c, x->m, x->t, x->l->device[r], x->l->head_count[r], kv_n, x->max_block, features, &mc);
    double tokens = (double)x->l->tokens[r];
    out->features = features;
    out->mem_states_gib = mc.states_gib;
    out->state_share = mc.state_share;
    out->mem_act_gib = mc.per_token_gib * tokens;
    if (mc.tile_per_token_gib > 0)
        out->mem_act_gib += mc.tile_per_token_gib * fmin(tokens, HEXISEQ_TILE_TOKENS);
    out->mem_attn_gib = mc.per_group_token_gib * (double)x->l->group_seq[x->group_of[r]];
    out->mem_ring_gib = mc.ring_gib;
    out->mem_total_gib = out->mem_states_gib + out->mem_act_gib + out->mem_attn_gib + out->mem_ring_gib + mc.reserved_gib;
    out->mem_cap_gib = mc.cap_gib;
    out->mem_host_gib = mc.host_per_token_gib * tokens;
    out->host_cap_gib = mc.host_cap_gib;
}

void hexiseq_memory_terms(const cost_ctx *x, int32_t r, int32_t kv_n, hexiseq_device_cost *out) {
    memory_terms(x, r, kv_n, 0, out);
}

void hexiseq_memory_choose(const cost_ctx *x, int32_t r, int32_t kv_n, const hexiseq_device_info *d, double fwd_s,
                           double bwd_s, hexiseq_device_cost *out) {
    int32_t allowed = hexiseq_memory_features_allowed(x->t, d);
    int64_t tokens = x->l->tokens[r];
    if (!allowed || tokens == 0 || out->mem_total_gib <= out->mem_cap_gib)
        return; /* nothing to save, or nothing the features save (they only shrink what grows with tokens) */
    hexiseq_device_cost best = *out, trial;
    double best_extra = INFINITY;
    int best_fits = 0;
    /* one feature, then two, then three: ties keep the fewer */
    static const int32_t order[] = {HEXISEQ_OFFLOAD, HEXISEQ_TILE_MLP, HEXISEQ_TILE_LOSS,
                                    HEXISEQ_OFFLOAD | HEXISEQ_TILE_MLP, HEXISEQ_OFFLOAD | HEXISEQ_TILE_LOSS,
                                    HEXISEQ_TILE_MLP | HEXISEQ_TILE_LOSS, HEXISEQ_MEMORY_FEATURES_ALL};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; ++i) {
        int32_t f = order[i];
        if (f & ~allowed)
            continue;
        trial = *out;
        memory_terms(x, r, kv_n, f, &trial);
        if ((f & HEXISEQ_OFFLOAD) && trial.mem_host_gib > trial.host_cap_gib)
            continue; /* more than the host can hold */
        trial.tiling_s = hexiseq_tiling_time_s(x, d, tokens, f);
        trial.offload_s = (f & HEXISEQ_OFFLOAD) ? hexiseq_offload_time_s(x, d, tokens, fwd_s, bwd_s) : 0.0;
        double extra = trial.tiling_s + trial.offload_s;
        int fits = trial.mem_total_gib <= trial.mem_cap_gib;
        if (fits ? !best_fits || extra < best_extra : !best_fits && trial.mem_total_gib < best.mem_total_gib) {
            best = trial;
            best_extra = extra;
            best_fits = fits;
        }
    }
    *out = best;
}
