/* Public C API of the HexiSeq core: GPU catalog, cluster, model, packed documents, layouts, cost model, plans, the
 * assignment of a batch's sequences to groups, and pipelines (their schedule's timing, layers split over stages). */
#ifndef HEXISEQ_H
#define HEXISEQ_H

#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HEXISEQ_VERSION "0.1.0"

/* ------------------------------------------------------------------ GPU catalog */

/* One GPU model. Rates are datasheet peaks; the *_eff fractions are what tuned kernels typically achieve
 * on large shapes. A measured rate overrides these through the cluster's per-node overrides. */
typedef struct {
    const char *name;        /* canonical name, e.g. "H100-SXM" */
    double peak_tflops;      /* dense bf16 (fp16 where the part has no bf16) tensor-core TFLOP/s */
    double memory_gib;       /* device memory, GiB (2^30 bytes) */
    double hbm_gbps;         /* memory bandwidth, GB/s (1e9 bytes/s) */
    double gemm_eff;         /* achieved fraction of peak on large matmuls */
    double attn_eff;         /* achieved fraction of peak by flash attention, forward+backward */
    const char *source;      /* where the numbers come from */
    const char *attn_kernel; /* the attention kernel a user runs there (what attn_eff stands for), and its source */
    double host_gbps;        /* the host link (PCIe, or the CPU-GPU interconnect), GB/s per direction, datasheet */
} hexiseq_gpu_spec;

HEXISEQ_API int hexiseq_gpu_catalog_size(void);
HEXISEQ_API hexiseq_status hexiseq_gpu_catalog_get(int index, hexiseq_gpu_spec *out);
/* The short names lookup accepts for catalog models ("H100" = "H100-SXM", "A100" = "A100-80G", ...): alias
 * `index` in [0, hexiseq_gpu_alias_count()) and the catalog name it stands for (static strings). */
HEXISEQ_API int hexiseq_gpu_alias_count(void);
HEXISEQ_API hexiseq_status hexiseq_gpu_alias_get(int index, const char **alias, const char **name);
/* Case-insensitive lookup of a catalog name or an alias. */
HEXISEQ_API hexiseq_status hexiseq_gpu_find(const char *name, hexiseq_gpu_spec *out);
/* The catalog name (a static string) of a part as its driver names it (CUDA's device name: "NVIDIA H100 PCIe",
 * "NVIDIA A100-SXM4-40GB"), or NULL when the catalog recognises no model in it (and for NULL): the catalog's pieces
 * of device names, found case-insensitively, the first one found winning. */
HEXISEQ_API const char *hexiseq_gpu_from_device_name(const char *device_name);

/* ------------------------------------------------------------------ cluster */

/* One node: `count` GPUs of one model joined by a switch of `intra_gbps` per device and direction.
 * Overrides: a value <= 0 means "use the catalog". A model that is not in the catalog is accepted when
 * every device of the node is fully described: its memory (memory_gib here or per device) and its rates
 * (peak_tflops with gemm_eff and attn_eff here, or measured gemm and attn curves per device). */
typedef struct {
    const char *gpu;         /* catalog name, or any name for a fully described model */
    int32_t count;           /* GPUs in the node, >= 1 */
    double intra_gbps;       /* device-to-device bandwidth inside the node, GB/s per direction, > 0 */
    double memory_gib;       /* override of the catalog memory, GiB */
    double peak_tflops;      /* override of the catalog peak, TFLOP/s */
    double gemm_eff;         /* override of the matmul efficiency, (0, 1] */
    double attn_eff;         /* override of the attention efficiency, (0, 1] */
    double host_memory_gib;  /* host memory of the node, GiB, that offloaded activations may use; <= 0: twice the
                                node's device memory (HEXISEQ_HOST_MEMORY_FACTOR). Each device may use its node's
                                host memory divided by the node's devices. */
} hexiseq_node_desc;

/* Host memory a node is taken to have, per GiB of its devices' memory, when its description does not say:
 * an 8 x H100 DGX has 2 TiB for 640 GB (3.2x), cloud 8 x A100 and L40S servers 1-2 TiB for 320-640 GB. */
#define HEXISEQ_HOST_MEMORY_FACTOR 2.0
/* Fraction of the host link's datasheet rate that pinned, asynchronous copies achieve (PCIe 4.0 x16: about 25 of
 * 32 GB/s; 5.0 x16: about 50 of 64), unless measured (hexiseq_device_desc.host_gbps). */
#define HEXISEQ_HOST_LINK_EFF 0.8

/* A measured rate as a function of problem size: points (size[i], tflops[i]) with sizes strictly
 * increasing and > 0, rates finite and > 0; n = 0 means "not measured". The cost model reads it by linear
 * interpolation in log(size), clamped to the end points outside the measured range. */
#define HEXISEQ_MAX_CURVE 16
typedef struct {
    int32_t n;
    double size[HEXISEQ_MAX_CURVE];
    double tflops[HEXISEQ_MAX_CURVE];
} hexiseq_rate_curve;

/* What was measured on one device. Rates are forward-equivalent TFLOP/s (1e12) over forward + backward:
 *   gemm        size = rows (tokens) of the token-parallel matmuls;
 *               tflops = forward FLOPs * (1 + 2.0) / (forward + backward seconds)
 *   attn        size = n, the tokens of a square full (unmasked) block;
 *               tflops = 4 * n * n * head_dim * heads * (1 + 2.5) / (forward + backward seconds)
 *   attn_causal the same for a causal square block of n tokens, counting the n (n + 1) / 2 visible pairs.
 *   attn_document  size = n, the length of the documents packed in one long causal block under the document
 *               mask; counting their visible pairs (n (n + 1) / 2 each). Packed short documents run slower per
 *               pair than a lone block of their length (per-row work spread over few keys, tiles that straddle
 *               documents); under documents shorter than a block the cost model prices pairs at this curve.
 *   runtime     size = elements, tokens * (heads + 2 kv_heads) * head_dim of a one-device attention layer;
 *               "tflops" holds NANOSECONDS PER ELEMENT of the runtime's work outside the attention kernels and
 *               the collectives (the group's tensors, accumulators, per-call bookkeeping), forward + backward.
 *               Kernels are not all a layer costs: on short documents this work was a quarter of the step.
 *   runtime_a2a the same per element a member of a larger group hands to and takes from the all-to-all
 *               (its tokens * (heads + 2 kv_heads) * head_dim): packing, unpacking, the collective's copies.
 *   runtime_ring the same per element of the K, V blocks a member of a ring of several groups receives over
 *               one pass ((S - S_g) * 2 kv * head_dim): assembling them, their gradients' accumulators.
 * A curve replaces the catalog formula for that kind of work on that device.
 * mem_bound_gbps: the rate at which the device does the memory-bound work beside the matmuls (norms, residual adds,
 * rotary, activations, the loss, the optimizer step), in GB of the bytes the cost model counts for it per second,
 * as measured; <= 0: the catalog's memory bandwidth times its default efficiency. */
typedef struct {
    double memory_gib;       /* device memory, GiB; <= 0: the node's */
    double mem_bound_gbps;
    hexiseq_rate_curve gemm;
    hexiseq_rate_curve attn;
    hexiseq_rate_curve attn_causal;
    hexiseq_rate_curve attn_document;
    hexiseq_rate_curve runtime;
    hexiseq_rate_curve runtime_a2a;
    hexiseq_rate_curve runtime_ring;
    double host_gbps;        /* measured host link rate, GB/s per direction (pinned copies); <= 0: the catalog's
                                datasheet rate x HEXISEQ_HOST_LINK_EFF */
} hexiseq_device_desc;

/* Optional parts of a cluster description; NULL pointers (or a NULL options pointer) mean "not given". */
typedef struct {
    const hexiseq_device_desc *devices; /* [n_devices], in device order */
    /* n_devices x n_devices row-major microseconds per message from a to b (>= 0, diagonal ignored).
     * Absent: 10 us between devices of one node, 20 us between nodes (assumptions until measured). */
    const double *latency_us;
} hexiseq_cluster_options;

typedef struct hexiseq_cluster hexiseq_cluster; /* opaque */

/* Devices are numbered node by node in the order given. `bandwidth_gbps` is optional (NULL): a full
 * n_devices x n_devices row-major matrix of GB/s per direction that replaces the node-derived links;
 * its diagonal is ignored. `inter_node_gbps` is the per-device bandwidth between nodes. */
HEXISEQ_API hexiseq_status hexiseq_cluster_create(int32_t n_nodes, const hexiseq_node_desc *nodes,
                                                  double inter_node_gbps, const double *bandwidth_gbps,
                                                  hexiseq_cluster **out);
/* The same with measured per-device rates and a latency matrix (`options` may be NULL). */
HEXISEQ_API hexiseq_status hexiseq_cluster_create_ex(int32_t n_nodes, const hexiseq_node_desc *nodes,
                                                     double inter_node_gbps, const double *bandwidth_gbps,
                                                     const hexiseq_cluster_options *options,
                                                     hexiseq_cluster **out);
HEXISEQ_API void hexiseq_cluster_destroy(hexiseq_cluster *cluster);
HEXISEQ_API int32_t hexiseq_cluster_num_devices(const hexiseq_cluster *cluster);
HEXISEQ_API int32_t hexiseq_cluster_num_nodes(const hexiseq_cluster *cluster);

/* What the cost model sees of one device after overrides. */
typedef struct {
    int32_t node;
    int32_t gpu_index;       /* index into the catalog; -1 for a model that is not in it */
    const char *gpu_name;    /* canonical catalog name, or the node's name; valid while the cluster lives */
    double memory_gib;
    double peak_tflops;      /* 0 for a model outside the catalog described by curves only */
    double gemm_eff;
    double attn_eff;
    double hbm_gbps;         /* the catalog's memory bandwidth, GB/s (0: not in the catalog) */
    double mem_bound_gbps;   /* the rate of its memory-bound work (measured, else hbm_gbps x the default
                                efficiency), GB/s; 0: unknown, not charged */
    hexiseq_rate_curve gemm_curve;        /* measured rates (n = 0: none), see hexiseq_device_desc */
    hexiseq_rate_curve attn_curve;
    hexiseq_rate_curve attn_causal_curve;
    hexiseq_rate_curve attn_document_curve;
    hexiseq_rate_curve runtime_curve;
    hexiseq_rate_curve runtime_a2a_curve;
    hexiseq_rate_curve runtime_ring_curve;
    double host_gbps;        /* the host link's achieved rate, GB/s per direction (0: unknown, no offloading) */
    double host_memory_gib;  /* the host memory this device's offloaded activations may use, GiB */
} hexiseq_device_info;

HEXISEQ_API hexiseq_status hexiseq_cluster_device(const hexiseq_cluster *cluster, int32_t device,
                                                  hexiseq_device_info *out);
/* Bandwidth from device a to device b, GB/s per direction (a != b). */
HEXISEQ_API hexiseq_status hexiseq_cluster_bandwidth(const hexiseq_cluster *cluster, int32_t a, int32_t b,
                                                     double *gbps);
/* Fixed cost of one message from device a to device b, microseconds (a != b). */
HEXISEQ_API hexiseq_status hexiseq_cluster_latency(const hexiseq_cluster *cluster, int32_t a, int32_t b,
                                                   double *us);

/* ------------------------------------------------------------------ model and training setting */

typedef struct {
    int32_t layers;
    int32_t hidden;          /* model width H */
    int32_t heads;           /* query heads A */
    int32_t kv_heads;        /* key/value heads A_kv, A % A_kv == 0 */
    int32_t head_dim;        /* d */
    int32_t ffn;             /* MLP inner width F */
    int32_t vocab;           /* V */
    int32_t dtype_bytes;     /* bytes per activation / parameter element (2 for bf16) */
    int32_t gated_mlp;       /* 1: SwiGLU (3 matrices H x F), 0: GELU MLP (2 matrices) */
    /* Sliding-window attention: window_layers of the layers see only the `window` latest keys (a query at q sees
     * keys q - window + 1 .. q: a Hugging Face sliding_window), the others every earlier key; 0 and 0 (a zeroed
     * struct): full causal attention everywhere. A windowed layer is priced with the pairs and the ring steps it
     * needs (the runtime skips the rest). */
    int32_t window;
    int32_t window_layers;
    /* A pipeline stage's part of the model (0 and 0, a zeroed struct: the whole model): no_embedding = 1 leaves out
     * the token embedding (its parameters), no_head = 1 the output head, the final norm and the loss (their
     * parameters, compute and activations); `layers` is then the stage's. */
    int32_t no_embedding;
    int32_t no_head;
} hexiseq_model;

HEXISEQ_API hexiseq_status hexiseq_model_validate(const hexiseq_model *model);
/* The range the core accepts for an integer input, by name: "model.<field>" (layers, hidden, heads, kv_heads,
 * head_dim, ffn, vocab, dtype_bytes, gated_mlp, window, window_layers), "nodes.count", "devices" (a cluster's total), "seq_len",
 * "training.sequences", "training.checkpointing", "training.sharding". Bindings use it to name the range of a
 * value too large for the field's C type, without a second copy of the limits. */
HEXISEQ_API hexiseq_status hexiseq_int_range(const char *field, int64_t *lo, int64_t *hi);
/* Parameter count of the model (embeddings and an untied output head included, unless it is a stage without them). */
HEXISEQ_API hexiseq_status hexiseq_model_params(const hexiseq_model *model, double *params);

typedef enum {
    HEXISEQ_SHARD_FULL = 0,  /* parameters, gradients, optimizer states sharded over all devices (ZeRO-3/FSDP) */
    HEXISEQ_SHARD_GRAD_OPT = 1, /* gradients and optimizer states sharded (ZeRO-2) */
    HEXISEQ_SHARD_OPT = 2,   /* optimizer states sharded (ZeRO-1) */
    HEXISEQ_SHARD_NONE = 3   /* everything replicated (plain DDP) */
} hexiseq_sharding;

/* How the sharded part of the model states is divided among the devices. */
typedef enum {
    HEXISEQ_STATES_EVEN = 0,      /* 1/N each, as FSDP and ZeRO do */
    HEXISEQ_STATES_BY_MEMORY = 1  /* in proportion to the memory each device has left beside the unsharded part:
                                     a small device holds less (run it with hexiseq.shard_states) */
} hexiseq_state_shares;

/* The documents packed into each sequence, for the document-causal mask (a query sees the keys of its own
 * document up to itself). Built once per batch by hexiseq_documents_init from the lengths in sequence order;
 * the cost model then counts the visible pairs of any two position ranges in O(log n). */
typedef struct {
    int64_t n;     /* documents */
    int64_t *end;  /* [n] exclusive end position of each document, increasing; end[n - 1] = seq_len */
    int64_t *tri;  /* [n + 1] tri[i] = visible pairs of documents 0 .. i-1 (sum of len (len + 1) / 2) */
    double *tri_len; /* [n + 1] the same sums with each document's pairs weighted by its length */
} hexiseq_documents;

/* lengths[0 .. n): every length >= 1, sum <= HEXISEQ's longest sequence. Free with hexiseq_documents_free. */
HEXISEQ_API hexiseq_status hexiseq_documents_init(const int64_t *lengths, int64_t n, hexiseq_documents *out);
HEXISEQ_API void hexiseq_documents_free(hexiseq_documents *docs);
/* Visible (query, key) pairs for queries in [q0, q1) and keys in [k0, k1): causal, and inside one document
 * when `docs` is not NULL. */
HEXISEQ_API int64_t hexiseq_visible_pairs(const hexiseq_documents *docs, int64_t q0, int64_t q1, int64_t k0,
                                          int64_t k1);
/* The documents' pieces inside [p0, p1) (each document clipped to the range): adds to *pairs the pieces'
 * own visible pairs and to *pairs_len the same weighted by the piece's length, so that pairs_len / pairs is
 * the pair-weighted mean length of the documents a kernel meets there. O(log n). */
HEXISEQ_API void hexiseq_document_pieces(const hexiseq_documents *docs, int64_t p0, int64_t p1, double *pairs,
                                         double *pairs_len);

typedef struct {
    int32_t sequences;       /* sequences per step, each of seq_len tokens, run one after another */
    int32_t checkpointing;   /* 1: full activation checkpointing (recompute each layer's forward) */
    int32_t sharding;        /* hexiseq_sharding */
    double reserved_gib;     /* per-device memory kept back for the framework, CUDA context, fragmentation */
    int32_t state_shares;    /* hexiseq_state_shares (after the first four, so that {sequences, checkpointing,
                                sharding, reserved_gib} initialisers keep meaning even shares) */
    const hexiseq_documents *documents; /* NULL: one causal document per sequence; else every sequence packs
                                these documents (causal only; their lengths sum to seq_len) */
    int32_t memory_features; /* hexiseq_memory_feature mask: what the cost model may use on a device whose
                                activations do not fit otherwise (0, a zeroed struct: none) */
} hexiseq_training;

/* Ways a device can trade time for memory. The cost model chooses per device, among those the training allows,
 * the combination that fits with the least added time (none when nothing is needed); the scheduler plans shares
 * that need them where that is predicted faster or is the only way to fit. */
typedef enum {
    HEXISEQ_OFFLOAD = 1,   /* activation checkpoints copied to host memory in the forward and back before the
                              layer's backward, overlapped with the neighbouring layer's compute (needs
                              checkpointing): two layers' checkpoints stay on the device */
    HEXISEQ_TILE_MLP = 2,  /* the MLP run HEXISEQ_TILE_TOKENS tokens at a time and each tile recomputed in the
                              backward: its intermediate activations are one tile's, for one more MLP forward */
    HEXISEQ_TILE_LOSS = 4, /* the logits and loss a tile at a time, recomputed in the backward: one tile's logits,
                              for one more output-head forward */
    HEXISEQ_MEMORY_FEATURES_ALL = 7
} hexiseq_memory_feature;
/* Tokens of one tile of the tiled MLP and loss (the runtime's hexiseq.nn.TiledMLP and tiled_cross_entropy use the
 * tile count ceil(tokens / this)). */
#define HEXISEQ_TILE_TOKENS 4096

HEXISEQ_API void hexiseq_training_default(hexiseq_training *out);

/* ------------------------------------------------------------------ layout (what a plan describes) */

/* Groups are listed in ring order. Members of group g are device[offset_g .. offset_g + group_size[g])
 * with offset_g = sum of earlier group sizes; per-device arrays share that order.
 * Inside a group the member order is the rank order: token shares are laid out in it and head ranges
 * must tile [0, heads) in it (head_lo[first] = 0, each next starts where the last ended). */
/* How a group's S_g positions lie in the sequence. */
typedef enum {
    HEXISEQ_CHUNK_ZIGZAG = 0,     /* a front chunk and its mirrored back chunk: balances one causal document */
    HEXISEQ_CHUNK_CONTIGUOUS = 1  /* one contiguous range per group, in ring order from position 0: with many
                                     short documents the work sits near the diagonal and is balanced by
                                     lengths alone, and a group's queries meet fewer remote keys */
} hexiseq_chunking;

typedef struct {
    int32_t n_groups;
    int32_t n_devices;
    int32_t *group_size;     /* [n_groups] */
    int64_t *group_seq;      /* [n_groups] S_g, token positions the group owns; sum = seq_len */
    int32_t *device;         /* [n_devices] cluster device ids */
    int64_t *tokens;         /* [n_devices] s_r, token-parallel share; sum over a group = S_g */
    int32_t *head_lo;        /* [n_devices] first query head of the device's range */
    int32_t *head_count;     /* [n_devices] h_r, may be 0 */
    int32_t chunking;        /* hexiseq_chunking (hexiseq_layout_alloc: zigzag) */
} hexiseq_layout;

/* Allocates the arrays (zeroed); free with hexiseq_layout_free. */
HEXISEQ_API hexiseq_status hexiseq_layout_alloc(int32_t n_groups, int32_t n_devices, hexiseq_layout *out);
HEXISEQ_API void hexiseq_layout_free(hexiseq_layout *layout);

/* Positions of group g: a front chunk [front_start, front_start + front_len) and a back chunk [back_start,
 * back_start + back_len). Front chunks follow the ring order from position 0. Zigzag: back chunks mirror
 * them from the end of the sequence (generalised to unequal S_g). Contiguous: the front chunk is all S_g
 * positions and the back chunk is empty (back_start = its end). */
typedef struct {
    int64_t front_start, front_len, back_start, back_len;
} hexiseq_group_span;

HEXISEQ_API hexiseq_status hexiseq_layout_spans(const hexiseq_layout *layout, hexiseq_group_span *spans);

/* ------------------------------------------------------------------ cost model */

/* Per device, whole training step (all layers, forward + backward, all sequences). */
typedef struct {
    double gemm_s;           /* token-parallel compute: projections, MLP, output head */
    double layer_gemm_s;     /* of which one layer, forward + backward, one sequence (no recompute, no head) */
    double mem_bound_s;      /* memory-bound work beside the matmuls: norms, residual adds, rotary, the MLP's
                                activation (forward, backward, recompute), the loss over the logits, and the
                                optimizer step over the parameters the device updates */
    double layer_mem_bound_s; /* of which one layer, forward + backward, one sequence (no recompute) */
    double attn_s;           /* attention kernels over all ring steps */
    double a2a_s;            /* this device's all-to-all transfers, serialised */
    double ring_exposed_s;   /* ring receive/send time not hidden behind attention, plus per-step sync */
    double runtime_s;        /* the runtime's work around the kernels (measured runtime curves; else 0) */
    double busy_s;           /* gemm_s + mem_bound_s + offload_s + tiling_s + max(a2a of its group) + attn_s +
                                ring_exposed_s + runtime_s */
    double mem_states_gib;   /* parameters, gradients, optimizer states, gathered layer weights */
    double mem_act_gib;      /* token-parallel activations (incl. logits) */
    double mem_attn_gib;     /* attention working set: Q, K, V, O of the group's tokens for its heads */
    double mem_ring_gib;     /* ring double buffers (K, V and dK, dV) */
    double mem_total_gib;    /* the above plus reserved_gib */
    double mem_cap_gib;      /* device memory */
    double state_share;      /* fraction of the sharded model states the device holds (1/N under even shares) */
    /* The traffic the times above charge, for checking against what the runtime sends (bytes): */
    double ring_send_bytes;  /* per token of a ring block: K, V of its first-held heads the next group needs */
    double ring_recv_bytes;  /* per token of a ring block: K, V of its kv heads from the previous group */
    double a2a_send_bytes;   /* one layer's forward all-to-alls (Q, K, V in, O out), one sequence, to the */
    double a2a_recv_bytes;   /*   group's other members and from them */
    double a2a_grad_send_bytes; /* one layer's backward all-to-alls (dO in, dQ and the first-held heads' dK, */
    double a2a_grad_recv_bytes; /*   dV out), one sequence, to the group's other members and from them */
    int32_t kv_lo;           /* first kv head the device needs */
    int32_t kv_count;        /* kv heads it needs (0 when it has no query heads) */
    int32_t first_lo;        /* first kv head the device first-holds: it is the lowest member of its group (in */
    int32_t first_count;     /*   layout order) whose kv range holds it; contiguous, 0 heads when none */
    int32_t features;        /* hexiseq_memory_feature mask the device uses (chosen by the cost model) */
    double offload_s;        /* copies of offloaded checkpoints not hidden behind the layers' compute, whole step */
    double tiling_s;         /* what tiling adds: the extra MLP / head forwards, and smaller matmuls, whole step */
    double mem_host_gib;     /* host memory its offloaded checkpoints take */
    double host_cap_gib;     /* host memory it may use (hexiseq_device_info.host_memory_gib) */
} hexiseq_device_cost;

typedef struct {
    double step_time_s;      /* predicted step time: sum over phases of the slowest device's phase time,
                                plus the exposed gradient collectives */
    double gemm_phase_s;     /* slowest device's token-parallel phase: matmuls, memory-bound work, and what
                                offloading and tiling add */
    double a2a_phase_s;      /* slowest group's all-to-all */
    double ring_phase_s;     /* slowest device's attention + exposed ring communication */
    double grad_sync_s;      /* parameter and gradient collectives over all devices, whole step */
    double grad_exposed_s;   /* the part of grad_sync_s that compute does not hide */
    double lower_bound_s;    /* total work / total effective rate; no layout can beat it under this model */
    double tokens_per_s;     /* sequences * seq_len / step_time_s */
    int32_t gemm_bottleneck; /* device ids of the slowest device in each phase */
    int32_t a2a_bottleneck;
    int32_t ring_bottleneck;
    int32_t fits;            /* 1 when every device's mem_total_gib <= mem_cap_gib */
    int32_t short_device;    /* device with the largest shortfall (-1 when fits) */
    double short_gib;        /* its shortfall, GiB */
} hexiseq_plan_cost;

/* Checks the layout against the cluster and model (HEXISEQ_ERR_LAYOUT with a message naming the field)
 * and scores it. `per_device` has n_devices entries in the layout's device order. */
HEXISEQ_API hexiseq_status hexiseq_evaluate(const hexiseq_cluster *cluster, const hexiseq_model *model,
                                            const hexiseq_training *training, int64_t seq_len,
                                            int32_t causal, const hexiseq_layout *layout,
                                            hexiseq_device_cost *per_device, hexiseq_plan_cost *out);

/* ------------------------------------------------------------------ strategies */

typedef enum {
    HEXISEQ_STRATEGY_RING = 0,    /* pure context parallelism: one device per group, equal shares */
    HEXISEQ_STRATEGY_ULYSSES = 1, /* pure head parallelism: one group, equal shares (needs A % N == 0) */
    HEXISEQ_STRATEGY_USP = 2,     /* uniform CP x HP mesh, every valid factorisation, best kept */
    HEXISEQ_STRATEGY_HEXISEQ = 3, /* the asymmetric hierarchical scheduler (csrc/scheduler/) */
    HEXISEQ_STRATEGY_COUNT = 4
} hexiseq_strategy;

HEXISEQ_API const char *hexiseq_strategy_name(hexiseq_strategy strategy);

/* Best layout of one strategy. On success `out` is allocated (free with hexiseq_layout_free) and
 * `cost` filled. Layouts that do not fit memory are kept only when nothing fits: then the call returns
 * HEXISEQ_ERR_MEMORY with the least-short layout in `out`/`cost` and a message naming the short device.
 * HEXISEQ_ERR_UNSUPPORTED when the strategy has no valid layout (e.g. Ulysses with A % N != 0). */
HEXISEQ_API hexiseq_status hexiseq_plan_strategy(const hexiseq_cluster *cluster, const hexiseq_model *model,
                                                 const hexiseq_training *training, int64_t seq_len,
                                                 int32_t causal, hexiseq_strategy strategy,
                                                 hexiseq_layout *out, hexiseq_plan_cost *cost);

/* Limits and progress of one planning call. A zeroed struct (or a NULL pointer) means "no limit, no
 * callback". */
typedef int (*hexiseq_progress_fn)(void *user); /* return nonzero to cancel the call */
typedef struct {
    double time_limit_s;          /* > 0: stop after about this long with the best plan found so far (never
                                     before a first layout that fits); <= 0: no limit */
    hexiseq_progress_fn progress; /* optional: called from the planning thread about every 50 ms;
                                     a nonzero return ends the call with HEXISEQ_ERR_CANCELLED */
    void *progress_user;          /* passed to `progress` */
} hexiseq_plan_options;

/* What a planning call did. */
typedef struct {
    int32_t stopped_early;        /* 1: the time limit ended the search; the plan is the best found by then */
    int64_t evaluations;          /* layouts scored by the cost model */
    double elapsed_s;             /* wall time of the call */
} hexiseq_plan_info;

/* hexiseq_plan_strategy with limits: `options` and `info` may be NULL. */
HEXISEQ_API hexiseq_status hexiseq_plan_strategy_ex(const hexiseq_cluster *cluster, const hexiseq_model *model,
                                                    const hexiseq_training *training, int64_t seq_len,
                                                    int32_t causal, hexiseq_strategy strategy,
                                                    const hexiseq_plan_options *options, hexiseq_layout *out,
                                                    hexiseq_plan_cost *cost, hexiseq_plan_info *info);

/* Re-balance a layout for another batch: the same groups, members, head ranges and ring order (so the
 * same all-to-all groups and ring), with the sequence split (S_g, token shares and chunking) optimised
 * again for `training->documents`. For packed batches whose documents change every step: a few cost
 * model evaluations instead of a full search. The result is never predicted slower than `in` itself
 * when `in` already splits seq_len. `out` is allocated (free with hexiseq_layout_free). */
HEXISEQ_API hexiseq_status hexiseq_rebalance(const hexiseq_cluster *cluster, const hexiseq_model *model,
                                             const hexiseq_training *training, int64_t seq_len, int32_t causal,
                                             const hexiseq_layout *in, hexiseq_layout *out, hexiseq_plan_cost *cost);
/* hexiseq_rebalance that also hands each group's heads out again over its members by their attention rates (one
 * head at a time and, with GQA, whole kv heads, the better kept; a member with no heads keeps none): the same
 * groups, members and ring order, so the same all-to-all groups and ring. For devices whose speed has changed. */
HEXISEQ_API hexiseq_status hexiseq_rebalance_heads(const hexiseq_cluster *cluster, const hexiseq_model *model,
                                                   const hexiseq_training *training, int64_t seq_len, int32_t causal,
                                                   const hexiseq_layout *in, hexiseq_layout *out,
                                                   hexiseq_plan_cost *cost);

/* ------------------------------------------------------------------ batch assignment */

/* One training step's batch of sequences of unequal lengths, to be divided among G groups of devices. Each
 * sequence goes to exactly one group; a group runs what it holds one after another, so its time is its fixed
 * time plus the sum of the costs of what it holds, and the step takes as long as its slowest group. */
typedef struct {
    int32_t n_groups;         /* G >= 1 */
    int32_t n_seqs;           /* N >= 0 */
    const double *cost_s;     /* [G * N], row-major by group: seconds group g takes for sequence i when it holds it
                                 (finite >= 0; INFINITY: g cannot run i at all, e.g. too long for its memory) */
    const double *fixed_s;    /* [G] seconds group g pays per step whatever it holds (>= 0, finite); NULL: 0 */
    const int64_t *tokens;    /* [N] tokens of sequence i (>= 1) */
    const int64_t *capacity;  /* [G] most tokens group g can hold at once (>= 1); NULL: no limit */
} hexiseq_batch_problem;

typedef struct {
    double makespan_s;        /* max over groups of fixed_s[g] + the sum of cost_s[g][i] over the i it holds; a group
                                 holding nothing still pays fixed_s[g] (it is part of the step) */
    double lower_bound_s;     /* valid lower bound on the makespan of ANY feasible assignment */
    int32_t exact;            /* 1 when the assignment is proven optimal (exhaustive search ran, or makespan equals the
                                 bound within a relative 1e-12) */
    int64_t iterations;       /* rounds of the local search (each applies its best improving move or swap, but the
                                 last, which found none): the work the heuristic did */
} hexiseq_batch_result;

/* Assigns every sequence of `p` to one group that can run it (finite cost) within the group's token capacity,
 * minimising the makespan: exhaustively (branch and bound) when G^N <= 200,000, else by a greedy placement and
 * a local search (csrc/assign/batch.c). Writes group_of[i] (the group of sequence i), group_time_s[g] (fixed
 * plus the costs it holds, seconds) and `result`. time_limit_s > 0 stops the search after about that long with
 * the best assignment found; <= 0: no limit beyond the search's own caps.
 * HEXISEQ_ERR_NULL: p, group_time_s or result NULL, or cost_s, tokens or group_of NULL while N > 0.
 * HEXISEQ_ERR_INVALID: a count, cost, fixed time, token count, capacity or the time limit out of its domain.
 * HEXISEQ_ERR_MEMORY: a sequence that no group can run within its capacity, or capacities so tight (this is
 * bin packing) that the greedy placement left a sequence without room; the message names it and the room
 * left. group_of may be NULL when N = 0. */
HEXISEQ_API hexiseq_status hexiseq_batch_assign(const hexiseq_batch_problem *p, double time_limit_s,
                                                int32_t *group_of /* [N] out */, double *group_time_s /* [G] out */,
                                                hexiseq_batch_result *result);

/* hexiseq_batch_assign without the exhaustive search and with a cheap lower bound (the per-sequence one and a single
 * weighted evaluation): the greedy placement and the local search until time_limit_s. For ranking many candidate
 * groupings of one batch quickly, where the bound is not wanted (a batch planner's inner loop). */
HEXISEQ_API hexiseq_status hexiseq_batch_assign_quick(const hexiseq_batch_problem *p, double time_limit_s,
                                                      int32_t *group_of, double *group_time_s,
                                                      hexiseq_batch_result *result);
/* hexiseq_batch_assign_quick from its first start only (the greedy placement costliest first) with at most
 * max_rounds (>= 1) rounds of local search instead of a time limit: the same result on every machine and every run,
 * whatever its load (a time limit stops after however many rounds the clock allowed). For ranking candidate
 * groupings where every rank of a job must choose alike. */
HEXISEQ_API hexiseq_status hexiseq_batch_assign_rounds(const hexiseq_batch_problem *p, int64_t max_rounds,
                                                       int32_t *group_of, double *group_time_s,
                                                       hexiseq_batch_result *result);

/* ------------------------------------------------------------------ pipelines */

/* A pipeline of P stages running M micro-batches one forward, one backward (1F1B): stage s runs min(P - 1 - s, M)
 * forwards first, then one forward and one backward in turn, then the backwards left. A forward of micro-batch i on
 * stage s starts once the stage is free and stage s - 1's forward of i has ended and its activations have arrived
 * (send_s[s - 1] later); a backward of i once stage s + 1's backward of i has ended and the gradient has arrived
 * (send_s[s] later); the last stage's backward of i follows its own forward of i. A stage runs one thing at a time;
 * sends overlap compute (a stage that sends does not wait for the transfer). */
typedef struct {
    int32_t n_stages;          /* P >= 1 */
    int32_t micro_batches;     /* M >= 1 */
    const double *forward_s;   /* [P] one micro-batch's forward on stage s, seconds (finite, >= 0) */
    const double *backward_s;  /* [P] its backward, recomputation included (finite, >= 0) */
    const double *send_s;      /* [P - 1] a micro-batch's activations from stage s to s + 1, and as long for their
                                  gradient back (finite, >= 0); NULL: 0 */
} hexiseq_pipeline;

typedef struct {
    double step_s;             /* when the last backward ends (the pipeline starts at 0) */
    double work_s;             /* the busiest stage's work: M x (forward + backward) */
    double bubble_s;           /* step_s - work_s: what the schedule adds to the busiest stage's work */
    int32_t bottleneck;        /* the busiest stage (the first of equals) */
} hexiseq_pipeline_timing;

/* Simulates the schedule of `p` (csrc/pipeline/schedule.c). Writes `out`, and when not NULL idle_s[s] (step_s
 * minus stage s's work) and in_flight[s] (the most micro-batches whose forward stage s has run and whose backward
 * it has not: whose activations it holds at once; min(P - s, M) under 1F1B).
 * HEXISEQ_ERR_NULL: p, out, or forward_s / backward_s NULL. HEXISEQ_ERR_INVALID: a count or a time out of its
 * domain (the message names the field and the value). */
HEXISEQ_API hexiseq_status hexiseq_pipeline_schedule(const hexiseq_pipeline *p, double *idle_s /* [P] out */,
                                                     int32_t *in_flight /* [P] out */, hexiseq_pipeline_timing *out);

/* Splits `layers` consecutive layers over P stages: stage s takes n_s >= 1 of them (at most most_layers[s] when
 * most_layers is not NULL: what its memory holds) and takes fixed_s[s] + n_s x layer_s[s] seconds (its time per
 * micro-batch: the embedding or the output head where they fall, plus its layers). Minimises the slowest stage;
 * among the splits that reach it, takes layers off the slowest stages first. Writes layers_out[s] and *max_stage_s.
 * HEXISEQ_ERR_NULL: a required pointer NULL. HEXISEQ_ERR_INVALID: P < 1, layers < P, a time not finite or
 * negative, a cap < 1. HEXISEQ_ERR_MEMORY: the caps hold fewer than `layers` layers (the message gives both). */
HEXISEQ_API hexiseq_status hexiseq_pipeline_split(int32_t n_stages, int32_t layers, const double *fixed_s,
                                                  const double *layer_s, const int32_t *most_layers,
                                                  int32_t *layers_out /* [P] out */, double *max_stage_s);

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_H */
