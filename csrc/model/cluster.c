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

/* A measured curve: at most HEXISEQ_MAX_CURVE points, sizes > 0 strictly increasing, rates > 0. */
static hexiseq_status check_curve(const hexiseq_rate_curve *cv, int32_t dev, const char *field) {
    if (cv->n < 0 || cv->n > HEXISEQ_MAX_CURVE)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices[%d].%s must have between 0 and %d points, got %d", dev,
                            field, HEXISEQ_MAX_CURVE, cv->n);
    for (int32_t i = 0; i < cv->n; ++i) {
        if (!finite_positive(cv->size[i]))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices[%d].%s[%d]: size must be a positive finite number, got %g",
                                dev, field, i, cv->size[i]);
        if (!finite_positive(cv->tflops[i]))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices[%d].%s[%d]: %s must be a positive finite number, got %g",
                                dev, field, i, strncmp(field, "runtime", 7) == 0 ? "ns per element" : "tflops",
                                cv->tflops[i]);
        if (i > 0 && !(cv->size[i] > cv->size[i - 1]))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices[%d].%s[%d]: sizes must increase, got %g after %g", dev,
                                field, i, cv->size[i], cv->size[i - 1]);
    }
    return HEXISEQ_OK;
}

/* A node of a model outside the catalog needs, on every device, a memory size, a matmul rate and an
 * attention rate, from the node's overrides or the device's measurements. */
static hexiseq_status check_described(const hexiseq_node_desc *nd, int32_t node, int32_t first,
                                      const hexiseq_device_desc *devices) {
    const char *missing = NULL;
    int32_t dev = first;
    for (int32_t k = 0; k < nd->count && !missing; ++k, ++dev) {
        const hexiseq_device_desc *dd = devices ? &devices[dev] : NULL;
        if (!(nd->memory_gib > 0) && !(dd && dd->memory_gib > 0))
            missing = "memory_gib";
        else if (!(nd->peak_tflops > 0 && nd->gemm_eff > 0) && !(dd && dd->gemm.n > 0))
            missing = "matmul rate";
        else if (!(nd->peak_tflops > 0 && nd->attn_eff > 0) && !(dd && dd->attn.n > 0))
            missing = "attention rate";
    }
    if (!missing)
        return HEXISEQ_OK;
    char known[400];
    hexiseq_gpu_known_list(known, sizeof known);
    return hexiseq_fail(HEXISEQ_ERR_UNKNOWN_GPU,
                        "nodes[%d].gpu '%.64s' is not in the GPU catalog: describe it with memory_gib, peak_tflops, "
                        "gemm_eff and attn_eff (or measured rates per device; device %d has no %s), or use one of: %s",
                        node, nd->gpu, dev - 1, missing, known);
}

hexiseq_status hexiseq_cluster_create(int32_t n_nodes, const hexiseq_node_desc *nodes, double inter_node_gbps,
                                      const double *bandwidth_gbps, hexiseq_cluster **out) {
    return hexiseq_cluster_create_ex(n_nodes, nodes, inter_node_gbps, bandwidth_gbps, NULL, out);
}

static int same_curve(const hexiseq_rate_curve *a, const hexiseq_rate_curve *b) {
    if (a->n != b->n)
        return 0;
    for (int32_t i = 0; i < a->n; ++i)
        if (a->size[i] != b->size[i] || a->tflops[i] != b->tflops[i])
            return 0;
    return 1;
}

int hexiseq_same_device(const hexiseq_device_info *a, const hexiseq_device_info *b) {
    return a->gpu_index == b->gpu_index && strcmp(a->gpu_name, b->gpu_name) == 0 && a->memory_gib == b->memory_gib &&
           a->peak_tflops == b->peak_tflops && a->gemm_eff == b->gemm_eff && a->attn_eff == b->attn_eff &&
           same_curve(&a->gemm_curve, &b->gemm_curve) && same_curve(&a->attn_curve, &b->attn_curve) &&
           same_curve(&a->attn_causal_curve, &b->attn_causal_curve) &&
           same_curve(&a->attn_document_curve, &b->attn_document_curve) &&
           same_curve(&a->runtime_curve, &b->runtime_curve) && same_curve(&a->runtime_a2a_curve, &b->runtime_a2a_curve) &&
           same_curve(&a->runtime_ring_curve, &b->runtime_ring_curve) && a->mem_bound_gbps == b->mem_bound_gbps &&
           a->host_gbps == b->host_gbps && a->host_memory_gib == b->host_memory_gib;
}

static int ascending(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double hexiseq_memory_beyond(const hexiseq_cluster *c, double level) {
    int32_t lo = 0, hi = c->n_devices; /* first device above level: mem_sorted[lo] > level */
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (c->mem_sorted[mid] > level)
            hi = mid;
        else
            lo = mid + 1;
    }
    return c->mem_above[lo] - level * (double)(c->n_devices - lo);
}

#define DEVICE_CLASSES_SEEN 16 /* recent classes a device is compared with before it opens a new one */

/* The figures of struct hexiseq_cluster that are derived from the rest (see internal.h). Returns 0 when
 * out of memory. */
static int derive(hexiseq_cluster *c) {
    int32_t n = c->n_devices, seen[DEVICE_CLASSES_SEEN], n_seen = 0;
    c->dev_class = malloc((size_t)n * sizeof *c->dev_class);
    c->node_of = malloc((size_t)n * sizeof *c->node_of);
    if (!c->dev_class || !c->node_of)
        return 0;
    for (int32_t i = 0; i < n; ++i)
        c->node_of[i] = c->dev[i].node;
    for (int32_t i = 0; i < n; ++i) {
        int32_t cls = i;
        for (int32_t k = 0; k < n_seen && cls == i; ++k)
            if (hexiseq_same_device(&c->dev[i], &c->dev[seen[k]]))
                cls = seen[k];
        if (cls == i) {
            memmove(seen + 1, seen, (size_t)(n_seen < DEVICE_CLASSES_SEEN ? n_seen : DEVICE_CLASSES_SEEN - 1) * sizeof *seen);
            seen[0] = i;
            n_seen += n_seen < DEVICE_CLASSES_SEEN;
        }
        c->dev_class[i] = cls;
    }
    c->ring_bw_min = INFINITY;
    c->ring_lat_max_s = 0.0;
    for (int32_t i = 0; i < n && n > 1; ++i) {
        int32_t j = (i + 1) % n;
        c->ring_bw_min = fmin(c->ring_bw_min, hexiseq_bw_bytes(c, i, j));
        c->ring_lat_max_s = fmax(c->ring_lat_max_s, hexiseq_lat_s(c, i, j));
    }
    c->mem_sorted = malloc((size_t)n * sizeof *c->mem_sorted);
    c->mem_above = malloc(((size_t)n + 1) * sizeof *c->mem_above);
    if (!c->mem_sorted || !c->mem_above)
        return 0;
    for (int32_t i = 0; i < n; ++i)
        c->mem_sorted[i] = c->dev[i].memory_gib;
    qsort(c->mem_sorted, (size_t)n, sizeof *c->mem_sorted, ascending);
    c->mem_above[n] = 0.0;
    for (int32_t i = n - 1; i >= 0; --i)
        c->mem_above[i] = c->mem_above[i + 1] + c->mem_sorted[i];
    c->gemm_rate_sum = c->attn_rate_sum[0] = c->attn_rate_sum[1] = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        c->gemm_rate_sum += hexiseq_gemm_plateau(&c->dev[i]);
        c->attn_rate_sum[0] += hexiseq_attn_plateau(&c->dev[i], 0);
        c->attn_rate_sum[1] += hexiseq_attn_plateau(&c->dev[i], 1);
    }
    return 1;
}

hexiseq_status hexiseq_cluster_create_ex(int32_t n_nodes, const hexiseq_node_desc *nodes, double inter_node_gbps,
                                         const double *bandwidth_gbps, const hexiseq_cluster_options *options,
                                         hexiseq_cluster **out) {
    hexiseq_clear_error();
    if (!nodes || !out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "nodes and out must not be NULL");
    *out = NULL;
    const hexiseq_device_desc *devices = options ? options->devices : NULL;
    const double *latency_us = options ? options->latency_us : NULL;
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
        if (!isfinite(nd->host_memory_gib))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "nodes[%d].host_memory_gib must be a finite number, got %g", i,
                                nd->host_memory_gib);
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
    if (latency_us) {
        for (int64_t a = 0; a < n; ++a)
            for (int64_t b = 0; b < n; ++b) {
                double v = latency_us[a * n + b];
                if (a != b && !(isfinite(v) && v >= 0.0))
                    return hexiseq_fail(HEXISEQ_ERR_INVALID, "latency_us[%lld][%lld] must be a finite number >= 0, got %g",
                                        (long long)a, (long long)b, v);
            }
    }
    if (devices) {
        for (int32_t d = 0; d < n; ++d) {
            const hexiseq_device_desc *dd = &devices[d];
            if (!isfinite(dd->memory_gib))
                return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices[%d].memory_gib must be a finite number, got %g", d,
                                    dd->memory_gib);
            if (!isfinite(dd->host_gbps))
                return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices[%d].host_gbps must be a finite number, got %g", d,
                                    dd->host_gbps);
            if (!isfinite(dd->mem_bound_gbps))
                return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices[%d].mem_bound_gbps must be a finite number, got %g",
                                    d, dd->mem_bound_gbps);
            HEXISEQ_CHECK(check_curve(&dd->gemm, d, "gemm_tflops"));
            HEXISEQ_CHECK(check_curve(&dd->attn, d, "attn_tflops"));
            HEXISEQ_CHECK(check_curve(&dd->attn_causal, d, "attn_causal_tflops"));
            HEXISEQ_CHECK(check_curve(&dd->attn_document, d, "attn_document_tflops"));
            HEXISEQ_CHECK(check_curve(&dd->runtime, d, "runtime_ns"));
            HEXISEQ_CHECK(check_curve(&dd->runtime_a2a, d, "runtime_a2a_ns"));
            HEXISEQ_CHECK(check_curve(&dd->runtime_ring, d, "runtime_ring_ns"));
        }
    }
    for (int32_t i = 0, first = 0; i < n_nodes; first += nodes[i].count, ++i)
        if (hexiseq_gpu_index(nodes[i].gpu) < 0)
            HEXISEQ_CHECK(check_described(&nodes[i], i, first, devices));

    hexiseq_cluster *c = calloc(1, sizeof *c);
    if (!c)
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate the cluster");
    c->n_nodes = n_nodes;
    c->n_devices = n;
    c->inter_gbps = inter_node_gbps;
    c->dev = calloc((size_t)n, sizeof *c->dev);
    c->intra_gbps = calloc((size_t)n_nodes, sizeof *c->intra_gbps);
    c->node_gpu = calloc((size_t)n_nodes, sizeof *c->node_gpu);
    if (bandwidth_gbps)
        c->bw = malloc((size_t)n * (size_t)n * sizeof *c->bw);
    if (latency_us)
        c->lat = malloc((size_t)n * (size_t)n * sizeof *c->lat);
    int ok = c->dev && c->intra_gbps && c->node_gpu && (!bandwidth_gbps || c->bw) && (!latency_us || c->lat);
    for (int32_t i = 0; ok && i < n_nodes; ++i)
        if (hexiseq_gpu_index(nodes[i].gpu) < 0) {
            size_t len = strlen(nodes[i].gpu);
            c->node_gpu[i] = malloc(len + 1);
            if (c->node_gpu[i])
                memcpy(c->node_gpu[i], nodes[i].gpu, len + 1);
            else
                ok = 0;
        }
    if (!ok) {
        hexiseq_cluster_destroy(c);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate a cluster of %d devices", n);
    }
    if (bandwidth_gbps)
        memcpy(c->bw, bandwidth_gbps, (size_t)n * (size_t)n * sizeof *c->bw);
    if (latency_us)
        memcpy(c->lat, latency_us, (size_t)n * (size_t)n * sizeof *c->lat);
    int32_t d = 0;
    for (int32_t i = 0; i < n_nodes; ++i) {
        const hexiseq_node_desc *nd = &nodes[i];
        hexiseq_gpu_spec spec;
        int gi = hexiseq_gpu_index(nd->gpu);
        if (gi >= 0) {
            hexiseq_gpu_catalog_get(gi, &spec);
        } else { /* fully described (checked above): nothing comes from a catalog entry */
            memset(&spec, 0, sizeof spec);
            spec.name = c->node_gpu[i];
        }
        c->intra_gbps[i] = nd->intra_gbps;
        int32_t node_first = d;
        for (int32_t k = 0; k < nd->count; ++k, ++d) {
            hexiseq_device_info *di = &c->dev[d];
            const hexiseq_device_desc *dd = devices ? &devices[d] : NULL;
            di->node = i;
            di->gpu_index = gi;
            di->gpu_name = spec.name;
            di->memory_gib = nd->memory_gib > 0 ? nd->memory_gib : spec.memory_gib;
            if (dd && dd->memory_gib > 0)
                di->memory_gib = dd->memory_gib;
            di->peak_tflops = nd->peak_tflops > 0 ? nd->peak_tflops : spec.peak_tflops;
            di->gemm_eff = nd->gemm_eff > 0 ? nd->gemm_eff : spec.gemm_eff;
            di->attn_eff = nd->attn_eff > 0 ? nd->attn_eff : spec.attn_eff;
            di->hbm_gbps = spec.hbm_gbps;
            di->mem_bound_gbps = dd && dd->mem_bound_gbps > 0 ? dd->mem_bound_gbps : spec.hbm_gbps * MEM_BOUND_EFF;
            di->host_gbps = dd && dd->host_gbps > 0 ? dd->host_gbps : spec.host_gbps * HEXISEQ_HOST_LINK_EFF;
            if (dd) {
                di->gemm_curve = dd->gemm;
                di->attn_curve = dd->attn;
                di->attn_causal_curve = dd->attn_causal;
                di->attn_document_curve = dd->attn_document;
                di->runtime_curve = dd->runtime;
                di->runtime_a2a_curve = dd->runtime_a2a;
                di->runtime_ring_curve = dd->runtime_ring;
            }
        }
        /* the node's host memory, split evenly among its devices (unless given: twice their memory) */
        double host = nd->host_memory_gib;
        if (!(host > 0)) {
            host = 0.0;
            for (int32_t k = node_first; k < d; ++k)
                host += HEXISEQ_HOST_MEMORY_FACTOR * c->dev[k].memory_gib;
        }
        for (int32_t k = node_first; k < d; ++k)
            c->dev[k].host_memory_gib = host / nd->count;
    }
    if (!derive(c)) {
        hexiseq_cluster_destroy(c);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate a cluster of %d devices", n);
    }
    *out = c;
    return HEXISEQ_OK;
}

void hexiseq_cluster_destroy(hexiseq_cluster *c) {
    if (!c)
        return;
    if (c->node_gpu)
        for (int32_t i = 0; i < c->n_nodes; ++i)
            free(c->node_gpu[i]);
    free(c->node_gpu);
    free(c->dev);
    free(c->intra_gbps);
    free(c->bw);
    free(c->lat);
    free(c->dev_class);
    free(c->node_of);
    free(c->mem_sorted);
    free(c->mem_above);
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

static hexiseq_status check_pair(const hexiseq_cluster *c, int32_t a, int32_t b, const void *out, const char *what) {
    if (!c || !out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "cluster and %s must not be NULL", what);
    if (a < 0 || a >= c->n_devices || b < 0 || b >= c->n_devices || a == b)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "devices must be two different ids in [0, %d), got %d and %d",
                            c->n_devices, a, b);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_cluster_bandwidth(const hexiseq_cluster *c, int32_t a, int32_t b, double *gbps) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(check_pair(c, a, b, gbps, "gbps"));
    *gbps = hexiseq_bw_bytes(c, a, b) / 1e9;
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_cluster_latency(const hexiseq_cluster *c, int32_t a, int32_t b, double *us) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(check_pair(c, a, b, us, "us"));
    *us = hexiseq_lat_us(c, a, b);
    return HEXISEQ_OK;
}

/* ------------------------------------------------------------------ model */

/* Integer inputs and their ranges: one table for the checks below and for hexiseq_int_range. */
static const struct {
    const char *name;
    int64_t lo, hi;
} int_ranges[] = {
    {"model.layers", 1, 100000},   {"model.hidden", 1, 1 << 20},  {"model.heads", 1, 1 << 16},
    {"model.kv_heads", 1, 1 << 16}, {"model.head_dim", 1, 4096},  {"model.ffn", 1, 1 << 24},
    {"model.vocab", 1, 1 << 26},   {"model.dtype_bytes", 1, 8},  {"model.gated_mlp", 0, 1},
    {"nodes.count", 1, HEXISEQ_MAX_DEVICES},        {"devices", 1, HEXISEQ_MAX_DEVICES},
    {"seq_len", 1, HEXISEQ_MAX_SEQ_LEN},            {"training.sequences", 1, INT32_MAX},
    {"training.checkpointing", 0, 1},              {"training.sharding", HEXISEQ_SHARD_FULL, HEXISEQ_SHARD_NONE},
    {"model.window", 0, HEXISEQ_MAX_SEQ_LEN},      {"model.window_layers", 0, 100000},
    {"training.memory_features", 0, HEXISEQ_MEMORY_FEATURES_ALL},
    {"model.no_embedding", 0, 1},                  {"model.no_head", 0, 1},
};

hexiseq_status hexiseq_int_range(const char *field, int64_t *lo, int64_t *hi) {
    hexiseq_clear_error();
    if (!field || !lo || !hi)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "field, lo and hi must not be NULL");
    for (size_t i = 0; i < sizeof int_ranges / sizeof int_ranges[0]; ++i)
        if (strcmp(int_ranges[i].name, field) == 0) {
            *lo = int_ranges[i].lo;
            *hi = int_ranges[i].hi;
            return HEXISEQ_OK;
        }
    return hexiseq_fail(HEXISEQ_ERR_INVALID, "no integer input is called '%.64s'", field);
}

hexiseq_status hexiseq_model_validate(const hexiseq_model *m) {
    hexiseq_clear_error();
    if (!m)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "model must not be NULL");
    const int32_t values[] = {m->layers, m->hidden, m->heads, m->kv_heads, m->head_dim, m->ffn, m->vocab,
                              m->dtype_bytes}; /* the first entries of int_ranges, in order */
    for (size_t i = 0; i < sizeof values / sizeof values[0]; ++i)
        if (values[i] < int_ranges[i].lo || values[i] > int_ranges[i].hi)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must be in [%lld, %lld], got %d", int_ranges[i].name,
                                (long long)int_ranges[i].lo, (long long)int_ranges[i].hi, values[i]);
    if (m->kv_heads > m->heads || m->heads % m->kv_heads != 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.heads (%d) must be a multiple of model.kv_heads (%d)", m->heads,
                            m->kv_heads);
    if (m->gated_mlp != 0 && m->gated_mlp != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.gated_mlp must be 0 or 1, got %d", m->gated_mlp);
    if (m->window < 0 || (int64_t)m->window > HEXISEQ_MAX_SEQ_LEN)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.window must be in [0, %lld] (0: no window), got %d",
                            (long long)HEXISEQ_MAX_SEQ_LEN, m->window);
    if (m->window_layers < 0 || m->window_layers > m->layers)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.window_layers must be in [0, model.layers = %d], got %d",
                            m->layers, m->window_layers);
    if (m->no_embedding != 0 && m->no_embedding != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.no_embedding must be 0 or 1, got %d", m->no_embedding);
    if (m->no_head != 0 && m->no_head != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "model.no_head must be 0 or 1, got %d", m->no_head);
    if ((m->window > 0) != (m->window_layers > 0))
        return hexiseq_fail(HEXISEQ_ERR_INVALID,
                            "model.window = %d and model.window_layers = %d: give both (a window and the layers "
                            "that use it) or neither",
                            m->window, m->window_layers);
    return HEXISEQ_OK;
}

/* Parameters of one transformer layer: q, k, v, o projections, the MLP, two norms. */
double hexiseq_layer_params(const hexiseq_model *m) {
    double H = m->hidden, q = (double)m->heads * m->head_dim, kv = (double)m->kv_heads * m->head_dim;
    return H * q + 2.0 * H * kv + q * H + (m->gated_mlp ? 3.0 : 2.0) * H * m->ffn + 2.0 * H;
}

/* the layers + the embedding + the untied output head and final norm (each where the model, or stage, holds it) */
double hexiseq_total_params(const hexiseq_model *m) {
    return m->layers * hexiseq_layer_params(m) + hexiseq_embedding_params(m) + hexiseq_head_params(m);
}

double hexiseq_embedding_params(const hexiseq_model *m) {
    return m->no_embedding ? 0.0 : (double)m->vocab * m->hidden;
}

double hexiseq_head_params(const hexiseq_model *m) {
    return m->no_head ? 0.0 : (double)m->vocab * m->hidden + m->hidden;
}

hexiseq_status hexiseq_model_params(const hexiseq_model *m, double *params) {
    HEXISEQ_CHECK(hexiseq_model_validate(m));
    if (!params)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "params must not be NULL");
    *params = hexiseq_total_params(m);
    return HEXISEQ_OK;
}

void hexiseq_training_default(hexiseq_training *out) {
    if (!out)
        return;
    out->sequences = 1;
    out->checkpointing = 0;
    out->sharding = HEXISEQ_SHARD_FULL;
    out->reserved_gib = 2.0;
    out->state_shares = HEXISEQ_STATES_EVEN;
    out->documents = NULL;
    out->memory_features = 0;
}
