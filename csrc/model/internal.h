/* The model's internal interface (not part of the public API): what the scheduler and the planner's binding use of
 * the cluster, the rates and the cost model beyond hexiseq.h. */
#ifndef HEXISEQ_INTERNAL_H
#define HEXISEQ_INTERNAL_H

#include <stddef.h>

#include "hexiseq.h"

struct hexiseq_cluster {
    int32_t n_nodes;
    int32_t n_devices;
    hexiseq_device_info *dev; /* [n_devices] */
    double *intra_gbps;       /* [n_nodes] */
    double inter_gbps;
    double *bw;               /* [n_devices * n_devices] or NULL: explicit matrix, GB/s */
    double *lat;              /* [n_devices * n_devices] or NULL: explicit latencies, microseconds */
    char **node_gpu;          /* [n_nodes] copies of the names of models outside the catalog (else NULL) */
    /* Derived once at creation; the cost model reads them at every evaluation: */
    int32_t *node_of;         /* [n_devices] dev[i].node, packed (link lookups stay in cache) */
    int32_t *dev_class;       /* [n_devices] a device alike (model, memory, peak, efficiencies, curves):
                                 equal classes mean alike devices (different classes may still be alike) */
    double ring_bw_min;       /* slowest link of the ring 0 -> 1 -> ... -> N-1 -> 0, bytes/s (N > 1) */
    double ring_lat_max_s;    /* its largest message latency, seconds */
    double gemm_rate_sum;     /* sum over devices of hexiseq_gemm_plateau, FLOP/s */
    double attn_rate_sum[2];  /* sum over devices of hexiseq_attn_plateau, non-causal and causal, FLOP/s */
    double *mem_sorted;       /* [n_devices] memory_gib of every device, ascending */
    double *mem_above;        /* [n_devices + 1] mem_above[i] = sum of mem_sorted[i ..]: memory beyond any level
                                 in O(log N) (hexiseq_memory_beyond) */
};

/* Latencies assumed when none are given, microseconds per message (see docs/cost_model.md). */
#define HEXISEQ_LATENCY_INTRA_US 10.0
#define HEXISEQ_LATENCY_INTER_US 20.0

/* Limits that keep every integer product in the cost model inside int64 and doubles exact enough. */
#define HEXISEQ_MAX_DEVICES 65536
#define HEXISEQ_MAX_SEQ_LEN (INT64_C(1) << 30)

int hexiseq_gpu_index(const char *name);

/* Same model, name, memory, peak, efficiencies and measured curves: devices the cost model cannot tell apart
 * (the cluster's rate classes and the scheduler's node classes both use it). */
int hexiseq_same_device(const hexiseq_device_info *a, const hexiseq_device_info *b);
/* The memory-bound work beside the matmuls (norms, residual adds, rotary, the MLP's activation, the loss, the
 * optimizer step) moves its bytes, unless measured (hexiseq_device_desc.mem_bound_gbps), at this fraction of the device's memory bandwidth: PyTorch's elementwise and
 * norm kernels stream large tensors at 70-90% of HBM bandwidth; the low end, since a norm's backward makes several
 * passes. Not yet fitted to a measurement: on one H100 a gpt-3b layer at 32K tokens spent 6.7 ms beyond its
 * calibrated matmul and attention times (benchmarks/results/gpu/calibrate_measure_h100.md), which this term prices
 * at 4.4 ms; the rest of that gap is the runtime's copies around the attention kernels (6.8 ms measured in the
 * attention layer alone), which calibrated runtime curves price and catalog defaults do not. */
#define MEM_BOUND_EFF 0.75

double hexiseq_layer_params(const hexiseq_model *m);
/* Every parameter of the model (or pipeline stage): the layers, the embedding, the output head and final norm. */
double hexiseq_total_params(const hexiseq_model *m);
/* The embedding's parameters (0 for a stage without it), and the output head's with the final norm (0 without). */
double hexiseq_embedding_params(const hexiseq_model *m);
double hexiseq_head_params(const hexiseq_model *m);

/* Bandwidth a -> b in bytes/s, no validation (a != b). */
static inline double hexiseq_bw_bytes(const hexiseq_cluster *c, int32_t a, int32_t b) {
    if (c->bw)
        return c->bw[(int64_t)a * c->n_devices + b] * 1e9;
    if (c->node_of[a] == c->node_of[b])
        return c->intra_gbps[c->node_of[a]] * 1e9;
    return c->inter_gbps * 1e9;
}

/* Fixed cost of one message a -> b in microseconds, and in seconds; no validation (a != b). */
static inline double hexiseq_lat_us(const hexiseq_cluster *c, int32_t a, int32_t b) {
    if (c->lat)
        return c->lat[(int64_t)a * c->n_devices + b];
    return c->node_of[a] == c->node_of[b] ? HEXISEQ_LATENCY_INTRA_US : HEXISEQ_LATENCY_INTER_US;
}
static inline double hexiseq_lat_s(const hexiseq_cluster *c, int32_t a, int32_t b) {
    return hexiseq_lat_us(c, a, b) * 1e-6;
}

/* A measured curve read at `size` (TFLOP/s): linear in log(size) between points, clamped at the ends.
 * The curve must have n >= 1. */
double hexiseq_curve_tflops(const hexiseq_rate_curve *curve, double size);
/* Nanoseconds of the runtime's work at x elements from a curve of (elements, ns per element): between two measured
 * sizes the time is linear in the elements (a cost per call plus one per element is what that work is; read as a
 * per-element figure linear in log(size), like the rates, it overstated the time between points far apart: 1.79 ms
 * where 1.06 ms was measured at 8K tokens between points at 4K and 32K on an H100); outside them, the nearest
 * point's ns per element. */
double hexiseq_runtime_curve_ns(const hexiseq_rate_curve *curve, double x);
/* Plateau rates (FLOP/s) of a device: the largest its matmuls / attention reach under the cost model
 * (with a curve, the curve's largest rate; else peak * eff). For causal attention a causal curve counts. */
double hexiseq_gemm_plateau(const hexiseq_device_info *d);
double hexiseq_attn_plateau(const hexiseq_device_info *d, int32_t causal);
/* The catalog's names as "H100-SXM, H100-PCIe, ..." into buf (always terminated). */
void hexiseq_gpu_known_list(char *buf, size_t cap);

/* Number of (query, key) pairs with key <= query for queries in [q0, q1) and keys in [k0, k1). */
int64_t hexiseq_causal_pairs(int64_t q0, int64_t q1, int64_t k0, int64_t k1);
/* Causal pairs of [q0, q1) x [k0, k1) inside a window of `window` keys: key k visible to query q iff
 * q - window < k <= q (a Hugging Face sliding_window). */
int64_t hexiseq_window_pairs(int64_t q0, int64_t q1, int64_t k0, int64_t k1, int64_t window);

/* Split `total` into `parts` near-equal integers, the larger ones first. */
static inline int64_t hexiseq_even_share(int64_t total, int64_t parts, int64_t i) {
    return total / parts + (i < total % parts ? 1 : 0);
}

/* Validates cluster, model, training and seq_len (not the layout). */
/* Documents of the training (if any) against the sequence: causal, lengths adding up to seq_len. */
hexiseq_status hexiseq_check_documents(const hexiseq_training *t, int64_t seq_len, int32_t causal);
hexiseq_status hexiseq_check_inputs(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                                    int64_t seq_len);

/* sum over devices of max(0, memory_gib - level): what the cluster holds beyond `level` GiB per device. */
double hexiseq_memory_beyond(const hexiseq_cluster *c, double level);

/* The model states of one device, `gib`: `fixed_gib` (the unsharded part: replicated parameters or gradients,
 * gathered layers) plus `share` of `sharded_gib` (what the sharding spreads over the devices). */
typedef struct {
    double fixed_gib, sharded_gib, share, gib;
} hexiseq_states_t;
/* The states of `device` (-1: the largest share of any device, what the padded collectives of uneven shares
 * move per device). */
void hexiseq_states(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t, int32_t device,
                    hexiseq_states_t *out);

/* Memory of one device as states + ring + reserved + tile + per_token * s_r + per_group_token * S_g (GiB), with the
 * memory features in `features` (hexiseq_memory_feature): tile is what one tile of the tiled MLP and loss holds
 * (HEXISEQ_TILE_TOKENS tokens; a device with fewer tokens holds fewer), and offloading moves host_per_token * s_r
 * to the host, where host_cap_gib is the device's part of its node's memory. */
typedef struct {
    double states_gib, ring_gib, reserved_gib, per_token_gib, per_group_token_gib, cap_gib, state_share;
    double tile_per_token_gib, host_per_token_gib, host_cap_gib;
} hexiseq_memory_coeffs_t;

void hexiseq_memory_coeffs(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t,
                           int32_t device, int32_t heads, int32_t kv_n, double ring_block, int32_t features,
                           hexiseq_memory_coeffs_t *out);
/* The memory features a training lets a device use: training.memory_features, without offloading when there is
 * no checkpointing (the runtime offloads the layers' checkpoints) or the device has no host link rate. */
int32_t hexiseq_memory_features_allowed(const hexiseq_training *t, const hexiseq_device_info *d);

/* The longest sequence that any layout over the whole cluster could fit in memory: a necessary condition (a longer
 * one fits no layout), not a sufficient one. Lets a search for the longest sequence that fits skip the scheduler's
 * full search on lengths past it. INT64_MAX when nothing grows with the tokens. */
int64_t hexiseq_memory_tokens_bound(const hexiseq_cluster *c, const hexiseq_model *m, const hexiseq_training *t);

/* kv heads needed by query heads [lo, lo + count): first and how many (0 when count is 0). */
void hexiseq_kv_range(const hexiseq_model *m, int32_t lo, int32_t count, int32_t *kv_lo, int32_t *kv_count);

/* Layouts of more than this many groups price alike groups once: the cost model's ring steps by kind of
 * source block, the scheduler's LP by kind of group (same results up to summation order). Default 32;
 * tests move it to compare both ways. */
extern int32_t hexiseq_grouped_above;

/* Copy a layout into already-allocated storage of the same sizes. */
void hexiseq_layout_copy(hexiseq_layout *dst, const hexiseq_layout *src);

#endif /* HEXISEQ_INTERNAL_H */
