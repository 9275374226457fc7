/* Cluster and model descriptions: construction and validation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int finite_positive(double x) { return isfinite(x) && x > 0.0; }

/* Overrides: 0 or negative means "catalog"; NaN and infinity are errors. */
static hexiseq_status check_override(double x, int32_t node, const char *field, int fraction) {
    if (isnan(x) || isinf(x))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes[%d].%s must be a finite number, got %g", node, field, x);
    if (fraction && x > 1.0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes[%d].%s must be in (0, 1], got %g", node, field, x);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_cluster_create(int32_t n_nodes, const hexiseq_node_desc *nodes, double inter_node_gbps,
                                      const double *bandwidth_gbps, hexiseq_cluster **out) {
    hexiseq_clear_error();
    if (!nodes || !out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "nodes and out must not be NULL");
    *out = NULL;
    if (n_nodes < 1 || n_nodes > HEXISEQ_MAX_DEVICES)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes: need between 1 and %d nodes, got %d", HEXISEQ_MAX_DEVICES,
                            n_nodes);
    if (!finite_positive(inter_node_gbps))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "inter_node_gbps must be a positive number, got %g", inter_node_gbps);
    int64_t total = 0;
    for (int32_t i = 0; i < n_nodes; ++i) {
        const hexiseq_node_desc *nd = &nodes[i];
        if (!nd->gpu)
            return hexiseq_fail(HEXISEQ_ERR_NULL, "nodes[%d].gpu must not be NULL", i);
        if (hexiseq_gpu_index(nd->gpu) < 0) {
            hexiseq_gpu_spec tmp;
            hexiseq_status s = hexiseq_gpu_find(nd->gpu, &tmp); /* builds the message listing known models */
            char msg[600];
            strncpy(msg, hexiseq_last_error(), sizeof msg - 1);
            msg[sizeof msg - 1] = '\0';
            return hexiseq_fail(s, "nodes[%d].gpu: %s", i, msg);
        }
        if (nd->count < 1 || nd->count > HEXISEQ_MAX_DEVICES)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes[%d].count must be in [1, %d], got %d", i,
                                HEXISEQ_MAX_DEVICES, nd->count);
        if (!finite_positive(nd->intra_gbps))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes[%d].intra_gbps must be a positive number, got %g", i,
                                nd->intra_gbps);
        HEXISEQ_CHECK(check_override(nd->memory_gib, i, "memory_gib", 0));
        HEXISEQ_CHECK(check_override(nd->peak_tflops, i, "peak_tflops", 0));
        HEXISEQ_CHECK(check_override(nd->gemm_eff, i, "gemm_eff", 1));
        HEXISEQ_CHECK(check_override(nd->attn_eff, i, "attn_eff", 1));
        total += nd->count;
    }
    if (total > HEXISEQ_MAX_DEVICES)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes: at most %d devices in all, got %lld", HEXISEQ_MAX_DEVICES,
                            (long long)total);
    if (total < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes: the cluster has no devices");
    int32_t n = (int32_t)total;
    if (bandwidth_gbps) {
        for (int64_t a = 0; a < n; ++a)
            for (int64_t b = 0; b < n; ++b)
                if (a != b && !finite_positive(bandwidth_gbps[a * n + b]))
                    return hexiseq_fail(HEXISEQ_ERR_INVALID, "bandwidth_gbps[%lld][%lld] must be a positive number, got %g",
                                        (long long)a, (long long)b, bandwidth_gbps[a * n + b]);
    }

    hexiseq_cluster *c = calloc(1, sizeof *c);
    if (!c)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate the cluster");
    c->n_nodes = n_nodes;
    c->n_devices = n;
    c->inter_gbps = inter_node_gbps;
    c->dev = calloc((size_t)n, sizeof *c->dev);
    c->intra_gbps = calloc((size_t)n_nodes, sizeof *c->intra_gbps);
    if (bandwidth_gbps)
        c->bw = malloc((size_t)n * (size_t)n * sizeof *c->bw);
    if (!c->dev || !c->intra_gbps || (bandwidth_gbps && !c->bw)) {
        hexiseq_cluster_destroy(c);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate a cluster of %d devices", n);
    }
    if (bandwidth_gbps)
        memcpy(c->bw, bandwidth_gbps, (size_t)n * (size_t)n * sizeof *c->bw);
    int32_t d = 0;
    for (int32_t i = 0; i < n_nodes; ++i) {
        const hexiseq_node_desc *nd = &nodes[i];
        hexiseq_gpu_spec spec;
        int gi = hexiseq_gpu_index(nd->gpu);
        hexiseq_gpu_catalog_get(gi, &spec);
        c->intra_gbps[i] = nd->intra_gbps;
        for (int32_t k = 0; k < nd->count; ++k, ++d) {
            hexiseq_device_info *di = &c->dev[d];
            di->node = i;
            di->gpu_index = gi;
            di->memory_gib = nd->memory_gib > 0 ? nd->memory_gib : spec.memory_gib;
            di->peak_tflops = nd->peak_tflops > 0 ? nd->peak_tflops : spec.peak_tflops;
            di->gemm_eff = nd->gemm_eff > 0 ? nd->gemm_eff : spec.gemm_eff;
            di->attn_eff = nd->attn_eff > 0 ? nd->attn_eff : spec.attn_eff;
        }
    }
    *out = c;
    return HEXISEQ_OK;
}

void hexiseq_cluster_destroy(hexiseq_cluster *c) {
    if (!c)
        return;
    free(c->dev);
    free(c->intra_gbps);
    free(c->bw);
    free(c);
}

int32_t hexiseq_cluster_num_devices(const hexiseq_cluster *c) { return c ? c->n_devices : 0; }
int32_t hexiseq_cluster_num_nodes(const hexiseq_cluster *c) { return c ? c->n_nodes : 0; }

hexiseq_status hexiseq_cluster_device(const hexiseq_cluster *c, int32_t device, hexiseq_device_info *out) {
    hexiseq_clear_error();
    if (!c || !out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "cluster and out must not be NULL");
    if (device < 0 || device >= c->n_devices)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "device must be in [0, %d), got %d", c->n_devices, device);
    *out = c->dev[device];
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_cluster_bandwidth(const hexiseq_cluster *c, int32_t a, int32_t b, double *gbps) {
    hexiseq_clear_error();
    if (!c || !gbps)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "cluster and gbps must not be NULL");
    if (a < 0 || a >= c->n_devices || b < 0 || b >= c->n_devices || a == b)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices must be two different ids in [0, %d), got %d and %d",
                            c->n_devices, a, b);
    *gbps = hexiseq_bw_bytes(c, a, b) / 1e9;
    return HEXISEQ_OK;
}

/* ------------------------------------------------------------------ model */

hexiseq_status hexiseq_model_validate(const hexiseq_model *m) {
    hexiseq_clear_error();
    if (!m)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "model must not be NULL");
    const struct {
        const char *name;
        int32_t value, lo, hi;
    } fields[] = {
        {"layers", m->layers, 1, 100000},   {"hidden", m->hidden, 1, 1 << 20},
        {"heads", m->heads, 1, 1 << 16},    {"kv_heads", m->kv_heads, 1, 1 << 16},
        {"head_dim", m->head_dim, 1, 4096}, {"ffn", m->ffn, 1, 1 << 24},
        {"vocab", m->vocab, 1, 1 << 26},    {"dtype_bytes", m->dtype_bytes, 1, 8},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; ++i)
        if (fields[i].value < fields[i].lo || fields[i].value > fields[i].hi)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.%s must be in [%d, %d], got %d", fields[i].name,
                                fields[i].lo, fields[i].hi, fields[i].value);
    if (m->kv_heads > m->heads || m->heads % m->kv_heads != 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.heads (%d) must be a multiple of model.kv_heads (%d)", m->heads,
                            m->kv_heads);
    if (m->gated_mlp != 0 && m->gated_mlp != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.gated_mlp must be 0 or 1, got %d", m->gated_mlp);
    return HEXISEQ_OK;
}

/* Parameters of one transformer layer: q, k, v, o projections, the MLP, two norms. */
double hexiseq_layer_params(const hexiseq_model *m) {
    double H = m->hidden, q = (double)m->heads * m->head_dim, kv = (double)m->kv_heads * m->head_dim;
    return H * q + 2.0 * H * kv + q * H + (m->gated_mlp ? 3.0 : 2.0) * H * m->ffn + 2.0 * H;
}

hexiseq_status hexiseq_model_params(const hexiseq_model *m, double *params) {
    HEXISEQ_CHECK(hexiseq_model_validate(m));
    if (!params)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "params must not be NULL");
    /* embedding + untied output head + final norm */
    *params = m->layers * hexiseq_layer_params(m) + 2.0 * (double)m->vocab * m->hidden + m->hidden;
    return HEXISEQ_OK;
}

void hexiseq_training_default(hexiseq_training *out) {
    if (!out)
        return;
    out->sequences = 1;
    out->checkpointing = 0;
    out->sharding = HEXISEQ_SHARD_FULL;
    out->reserved_gib = 2.0;
}
