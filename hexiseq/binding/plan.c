/* The planner's binding: the GPU catalog, clusters, models and training settings from Python tuples and lists,
 * layouts and costs back as dicts of NumPy arrays; evaluate and plan_strategy run the core without the GIL. It
 * holds no algorithm; everything it calls is declared in csrc/common/hexiseq.h, except the rate curves' reading
 * and the memory bound (csrc/model/internal.h). The core's enums by name are in enums.c. */
#include "binding.h"
#include "internal.h" /* hexiseq_curve_tflops, hexiseq_memory_tokens_bound */

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#define MAX_NODES 65536
#define HEXISEQ_MAX_DEVICES_BINDING 65536 /* the core rejects larger clusters by itself */

/* ------------------------------------------------------------------ conversions */

static PyObject *new_array(int typenum, npy_intp n, const void *src, size_t elem) {
    PyObject *arr = PyArray_SimpleNew(1, &n, typenum);
    if (arr && n)
        memcpy(PyArray_DATA((PyArrayObject *)arr), src, (size_t)n * elem);
    return arr;
}

/* Read a 1-D sequence into a contiguous array of `typenum` with exactly `n` elements (n < 0: any). */
static PyArrayObject *as_array(PyObject *obj, int typenum, npy_intp n, const char *name) {
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROMANY(obj, typenum, 1, 1, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!arr) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D sequence of numbers", name);
        return NULL;
    }
    if (n >= 0 && PyArray_SIZE(arr) != n) {
        PyErr_Format(PyExc_ValueError, "%s must have %zd entries, got %zd", name, (Py_ssize_t)n,
                     (Py_ssize_t)PyArray_SIZE(arr));
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* Raise InvalidArgumentError with a formatted message; returns -1. */
static int invalid(PyObject *module, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    PyOS_vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PyErr_SetString(get_state(module)->errors[HEXISEQ_ERR_INVALID], msg);
    return -1;
}

/* An integer for the core input `field` (a hexiseq_int_range name), `shown` as in messages ("nodes[3].count"):
 * a value outside int32 raises InvalidArgumentError naming the value and the core's range, never OverflowError;
 * values inside int32 are range-checked by the core itself. Returns 1, or 0 with an exception set. */
static int int32_arg(PyObject *module, PyObject *obj, const char *field, const char *shown, int32_t *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_INVALID], "%s must be an integer, got %R", shown, obj);
        return 0;
    }
    if (overflow || v < INT32_MIN || v > INT32_MAX) {
        int64_t lo = INT32_MIN, hi = INT32_MAX;
        hexiseq_int_range(field, &lo, &hi);
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_INVALID], "%s must be in [%lld, %lld], got %S", shown,
                     (long long)lo, (long long)hi, obj);
        return 0;
    }
    *out = (int32_t)v;
    return 1;
}

/* A measured curve from None or a sequence of (size, tflops) pairs. */
static int parse_curve(PyObject *module, PyObject *obj, Py_ssize_t dev, const char *field, hexiseq_rate_curve *out) {
    memset(out, 0, sizeof *out);
    if (obj == Py_None)
        return 0;
    PyObject *seq = PySequence_Fast(obj, "");
    if (!seq) {
        PyErr_Clear();
        return invalid(module, "devices[%zd].%s must be a list of [size, tflops] pairs", dev, field);
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > HEXISEQ_MAX_CURVE) {
        Py_DECREF(seq);
        return invalid(module, "devices[%zd].%s has %zd points, at most %d", dev, field, n, HEXISEQ_MAX_CURVE);
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(pair, "dd", &out->size[i], &out->tflops[i])) {
            PyErr_Clear();
            Py_DECREF(seq);
            return invalid(module, "devices[%zd].%s[%zd] must be a [size, tflops] pair of numbers", dev, field, i);
        }
    }
    out->n = (int32_t)n;
    Py_DECREF(seq);
    return 0;
}

/* Per-device descriptions from None or a list of n entries, each None or (memory_gib, gemm, attn, attn_causal,
 * attn_document, runtime, runtime_a2a, runtime_ring, mem_bound_gbps) with curves as above. Returns a PyMem block (NULL with *none set when not given) or NULL on error. */
static hexiseq_device_desc *parse_devices(PyObject *module, PyObject *obj, int64_t n, int *none) {
    *none = obj == Py_None;
    if (*none)
        return NULL;
    if (!PyList_Check(obj)) {
        invalid(module, "devices must be a list with one entry per device");
        return NULL;
    }
    if (PyList_GET_SIZE(obj) != n) {
        invalid(module, "devices must have one entry per device (%lld), got %zd", (long long)n, PyList_GET_SIZE(obj));
        return NULL;
    }
    hexiseq_device_desc *dd = PyMem_Calloc(n ? (size_t)n : 1, sizeof *dd);
    if (!dd) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; ++i) {
        PyObject *item = PyList_GET_ITEM(obj, i), *g, *a, *ac, *ad, *rt, *ra, *rr;
        if (item == Py_None)
            continue;
        if (!PyArg_ParseTuple(item,
                              "dOOOOOOOd|d;devices entries are (memory_gib, gemm, attn, attn_causal, attn_document, "
                              "runtime, runtime_a2a, runtime_ring, mem_bound_gbps[, host_gbps])",
                              &dd[i].memory_gib, &g, &a, &ac, &ad, &rt, &ra, &rr, &dd[i].mem_bound_gbps,
                              &dd[i].host_gbps) ||
            parse_curve(module, g, i, "gemm_tflops", &dd[i].gemm) < 0 ||
            parse_curve(module, a, i, "attn_tflops", &dd[i].attn) < 0 ||
            parse_curve(module, ac, i, "attn_causal_tflops", &dd[i].attn_causal) < 0 ||
            parse_curve(module, ad, i, "attn_document_tflops", &dd[i].attn_document) < 0 ||
            parse_curve(module, rt, i, "runtime_ns", &dd[i].runtime) < 0 ||
            parse_curve(module, ra, i, "runtime_a2a_ns", &dd[i].runtime_a2a) < 0 ||
            parse_curve(module, rr, i, "runtime_ring_ns", &dd[i].runtime_ring) < 0) {
            PyMem_Free(dd);
            return NULL;
        }
    }
    return dd;
}

/* A square matrix of the cluster's size from None or a 2-D sequence; *arr stays NULL for None. */
static int parse_matrix(PyObject *obj, int64_t n, const char *name, PyArrayObject **arr) {
    *arr = NULL;
    if (obj == Py_None)
        return 0;
    *arr = (PyArrayObject *)PyArray_FROMANY(obj, NPY_DOUBLE, 2, 2, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!*arr)
        return -1;
    if (PyArray_DIM(*arr, 0) != n || PyArray_DIM(*arr, 1) != n) {
        PyErr_Format(PyExc_ValueError, "%s must be a %lld x %lld matrix (one row per device), got %zd x %zd", name,
                     (long long)n, (long long)n, (Py_ssize_t)PyArray_DIM(*arr, 0), (Py_ssize_t)PyArray_DIM(*arr, 1));
        Py_CLEAR(*arr);
        return -1;
    }
    return 0;
}

/* A cluster from (nodes, inter_node_gbps, bandwidth matrix or None, latency matrix or None, devices or None),
 * nodes being tuples (gpu, count, intra_gbps, memory_gib, peak_tflops, gemm_eff, attn_eff). */
static hexiseq_cluster *make_cluster(PyObject *module, PyObject *nodes, double inter, PyObject *bw_obj,
                                     PyObject *lat_obj, PyObject *dev_obj) {
    if (!PyList_Check(nodes)) {
        PyErr_SetString(PyExc_TypeError, "nodes must be a list of tuples");
        return NULL;
    }
    Py_ssize_t n_nodes = PyList_GET_SIZE(nodes);
    if (n_nodes > MAX_NODES) {
        PyErr_Format(PyExc_ValueError, "nodes: at most %d nodes, got %zd", MAX_NODES, n_nodes);
        return NULL;
    }
    hexiseq_node_desc *desc = PyMem_Calloc(n_nodes ? (size_t)n_nodes : 1, sizeof *desc);
    if (!desc)
        return (hexiseq_cluster *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n_nodes; ++i) {
        hexiseq_node_desc *d = &desc[i];
        PyObject *count;
        char shown[48];
        PyOS_snprintf(shown, sizeof shown, "nodes[%zd].count", i);
        if (!PyArg_ParseTuple(PyList_GET_ITEM(nodes, i),
                              "sOddddd|d;nodes entries are (gpu, count, intra_gbps, memory_gib, peak_tflops, gemm_eff, "
                              "attn_eff[, host_memory_gib])",
                              &d->gpu, &count, &d->intra_gbps, &d->memory_gib, &d->peak_tflops, &d->gemm_eff,
                              &d->attn_eff, &d->host_memory_gib) ||
            !int32_arg(module, count, "nodes.count", shown, &d->count)) {
            PyMem_Free(desc);
            return NULL;
        }
    }
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n_nodes; ++i)
        total += desc[i].count > 0 ? desc[i].count : 0;
    PyArrayObject *bw = NULL, *lat = NULL;
    hexiseq_device_desc *devices = NULL;
    hexiseq_cluster *c = NULL;
    hexiseq_cluster_options opt = {NULL, NULL};
    hexiseq_status s;
    int no_devices = 1;
    if (parse_matrix(bw_obj, total, "bandwidth_gbps", &bw) < 0 || parse_matrix(lat_obj, total, "latency_us", &lat) < 0)
        goto done;
    if (total <= HEXISEQ_MAX_DEVICES_BINDING) {
        devices = parse_devices(module, dev_obj, total, &no_devices);
        if (!devices && !no_devices)
            goto done;
    }
    opt.devices = devices;
    opt.latency_us = lat ? (const double *)PyArray_DATA(lat) : NULL;
    s = hexiseq_cluster_create_ex((int32_t)n_nodes, desc, inter, bw ? (const double *)PyArray_DATA(bw) : NULL,
                                                 &opt, &c);
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        c = NULL;
    }
done:
    Py_XDECREF(bw);
    Py_XDECREF(lat);
    PyMem_Free(devices);
    PyMem_Free(desc);
    return c;
}

/* A model from (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, dtype_bytes, gated_mlp[, window,
 * window_layers[, no_embedding, no_head]]). */
static int parse_model(PyObject *module, PyObject *obj, hexiseq_model *m) {
    static const char *names[13] = {"model.layers", "model.hidden", "model.heads", "model.kv_heads", "model.head_dim",
                                    "model.ffn", "model.vocab", "model.dtype_bytes", "model.gated_mlp",
                                    "model.window", "model.window_layers", "model.no_embedding", "model.no_head"};
    int32_t *dst[13] = {&m->layers, &m->hidden, &m->heads, &m->kv_heads, &m->head_dim, &m->ffn, &m->vocab,
                        &m->dtype_bytes, &m->gated_mlp, &m->window, &m->window_layers, &m->no_embedding,
                        &m->no_head};
    memset(m, 0, sizeof *m);
    const Py_ssize_t n = PyTuple_Check(obj) ? PyTuple_GET_SIZE(obj) : 0;
    if (n != 9 && n != 11 && n != 13) {
        PyErr_SetString(PyExc_TypeError, "model is (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, "
                                         "dtype_bytes, gated_mlp[, window, window_layers[, no_embedding, no_head]])");
        return 0;
    }
    for (int i = 0; i < (int)n; ++i)
        if (!int32_arg(module, PyTuple_GET_ITEM(obj, i), names[i], names[i], dst[i]))
            return 0;
    return 1;
}

/* A training setting from (sequences, checkpointing, sharding, reserved_gib, state_shares[, memory_features]). */
static int parse_training(PyObject *module, PyObject *obj, hexiseq_training *t) {
    static const char *names[5] = {"training.sequences", "training.checkpointing", "training.sharding",
                                   "training.state_shares", "training.memory_features"};
    int32_t *dst[4] = {&t->sequences, &t->checkpointing, &t->sharding, &t->state_shares};
    memset(t, 0, sizeof *t);
    const Py_ssize_t n = PyTuple_Check(obj) ? PyTuple_GET_SIZE(obj) : 0;
    if (n != 5 && n != 6) {
        PyErr_SetString(PyExc_TypeError, "training is (sequences, checkpointing, sharding, reserved_gib, state_shares"
                                         "[, memory_features])");
        return 0;
    }
    if (n == 6 && !int32_arg(module, PyTuple_GET_ITEM(obj, 5), names[4], names[4], &t->memory_features))
        return 0;
    for (int i = 0; i < 3; ++i)
        if (!int32_arg(module, PyTuple_GET_ITEM(obj, i), names[i], names[i], dst[i]))
            return 0;
    t->reserved_gib = PyFloat_AsDouble(PyTuple_GET_ITEM(obj, 3));
    if (t->reserved_gib == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_INVALID], "training.reserved_gib must be a number, got %R",
                     PyTuple_GET_ITEM(obj, 3));
        return 0;
    }
    return int32_arg(module, PyTuple_GET_ITEM(obj, 4), names[3], names[3], dst[3]);
}

/* Documents from None (none) or a 1-D sequence of lengths into *d (free with hexiseq_documents_free);
 * *use is d, or NULL for None. Returns 0 with an exception set on failure. */
static int parse_documents(PyObject *module, PyObject *obj, hexiseq_documents *d, const hexiseq_documents **use) {
    memset(d, 0, sizeof *d);
    *use = NULL;
    if (!obj || obj == Py_None)
        return 1;
    PyArrayObject *arr = as_array(obj, NPY_INT64, -1, "documents");
    if (!arr)
        return 0;
    hexiseq_status st = hexiseq_documents_init(PyArray_DATA(arr), PyArray_SIZE(arr), d);
    Py_DECREF(arr);
    if (st != HEXISEQ_OK) {
        raise_status(module, st);
        return 0;
    }
    *use = d;
    return 1;
}

/* The model, the training and its documents of a planner call. Returns 0 with an exception set. */
static int parse_inputs(PyObject *module, PyObject *model_obj, PyObject *train_obj, PyObject *docs_obj,
                        hexiseq_model *m, hexiseq_training *t, hexiseq_documents *docs) {
    return parse_model(module, model_obj, m) && parse_training(module, train_obj, t) &&
           parse_documents(module, docs_obj, docs, &t->documents);
}

static PyObject *layout_to_dict(const hexiseq_layout *l) {
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N,s:i}",
                         "group_size", new_array(NPY_INT32, l->n_groups, l->group_size, sizeof(int32_t)),
                         "group_seq", new_array(NPY_INT64, l->n_groups, l->group_seq, sizeof(int64_t)),
                         "device", new_array(NPY_INT32, l->n_devices, l->device, sizeof(int32_t)),
                         "tokens", new_array(NPY_INT64, l->n_devices, l->tokens, sizeof(int64_t)),
                         "head_lo", new_array(NPY_INT32, l->n_devices, l->head_lo, sizeof(int32_t)),
                         "head_count", new_array(NPY_INT32, l->n_devices, l->head_count, sizeof(int32_t)),
                         "chunking", (int)l->chunking);
}

static PyObject *plan_cost_to_dict(const hexiseq_plan_cost *p) {
    return Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:i,s:i,s:i,s:O,s:i,s:d}", "step_time_s", p->step_time_s,
                         "gemm_phase_s", p->gemm_phase_s, "a2a_phase_s", p->a2a_phase_s, "ring_phase_s",
                         p->ring_phase_s, "grad_sync_s", p->grad_sync_s, "grad_exposed_s", p->grad_exposed_s,
                         "lower_bound_s", p->lower_bound_s, "tokens_per_s", p->tokens_per_s, "gemm_bottleneck",
                         p->gemm_bottleneck, "a2a_bottleneck", p->a2a_bottleneck, "ring_bottleneck",
                         p->ring_bottleneck, "fits", p->fits ? Py_True : Py_False, "short_device", p->short_device,
                         "short_gib", p->short_gib);
}

/* Per-device cost columns, in the layout's device order. */
static PyObject *device_costs_to_dict(const hexiseq_device_cost *dc, npy_intp n) {
    /* every column of hexiseq_device_cost: a double, or an int32 where is_int */
    static const struct {
        const char *name;
        size_t offset;
        int is_int;
    } cols[] = {
        {"gemm_s", offsetof(hexiseq_device_cost, gemm_s), 0},
        {"layer_gemm_s", offsetof(hexiseq_device_cost, layer_gemm_s), 0},
        {"mem_bound_s", offsetof(hexiseq_device_cost, mem_bound_s), 0},
        {"layer_mem_bound_s", offsetof(hexiseq_device_cost, layer_mem_bound_s), 0},
        {"attn_s", offsetof(hexiseq_device_cost, attn_s), 0},
        {"a2a_s", offsetof(hexiseq_device_cost, a2a_s), 0},
        {"ring_exposed_s", offsetof(hexiseq_device_cost, ring_exposed_s), 0},
        {"runtime_s", offsetof(hexiseq_device_cost, runtime_s), 0},
        {"busy_s", offsetof(hexiseq_device_cost, busy_s), 0},
        {"mem_states_gib", offsetof(hexiseq_device_cost, mem_states_gib), 0},
        {"mem_act_gib", offsetof(hexiseq_device_cost, mem_act_gib), 0},
        {"mem_attn_gib", offsetof(hexiseq_device_cost, mem_attn_gib), 0},
        {"mem_ring_gib", offsetof(hexiseq_device_cost, mem_ring_gib), 0},
        {"mem_total_gib", offsetof(hexiseq_device_cost, mem_total_gib), 0},
        {"mem_cap_gib", offsetof(hexiseq_device_cost, mem_cap_gib), 0},
        {"state_share", offsetof(hexiseq_device_cost, state_share), 0},
        {"ring_send_bytes", offsetof(hexiseq_device_cost, ring_send_bytes), 0},
        {"ring_recv_bytes", offsetof(hexiseq_device_cost, ring_recv_bytes), 0},
        {"a2a_send_bytes", offsetof(hexiseq_device_cost, a2a_send_bytes), 0},
        {"a2a_recv_bytes", offsetof(hexiseq_device_cost, a2a_recv_bytes), 0},
        {"a2a_grad_send_bytes", offsetof(hexiseq_device_cost, a2a_grad_send_bytes), 0},
        {"a2a_grad_recv_bytes", offsetof(hexiseq_device_cost, a2a_grad_recv_bytes), 0},
        {"kv_lo", offsetof(hexiseq_device_cost, kv_lo), 1},
        {"kv_count", offsetof(hexiseq_device_cost, kv_count), 1},
        {"first_lo", offsetof(hexiseq_device_cost, first_lo), 1},
        {"first_count", offsetof(hexiseq_device_cost, first_count), 1},
        {"features", offsetof(hexiseq_device_cost, features), 1},
        {"offload_s", offsetof(hexiseq_device_cost, offload_s), 0},
        {"tiling_s", offsetof(hexiseq_device_cost, tiling_s), 0},
        {"mem_host_gib", offsetof(hexiseq_device_cost, mem_host_gib), 0},
        {"host_cap_gib", offsetof(hexiseq_device_cost, host_cap_gib), 0},
    };
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    for (size_t c = 0; c < sizeof cols / sizeof cols[0]; ++c) {
        PyObject *arr = PyArray_SimpleNew(1, &n, cols[c].is_int ? NPY_INT32 : NPY_DOUBLE);
        if (!arr) {
            Py_DECREF(out);
            return NULL;
        }
        void *dst = PyArray_DATA((PyArrayObject *)arr);
        for (npy_intp i = 0; i < n; ++i) {
            const char *field = (const char *)&dc[i] + cols[c].offset;
            if (cols[c].is_int)
                ((int32_t *)dst)[i] = *(const int32_t *)field;
            else
                ((double *)dst)[i] = *(const double *)field;
        }
        int rc = PyDict_SetItemString(out, cols[c].name, arr);
        Py_DECREF(arr);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* ------------------------------------------------------------------ functions */

static PyObject *core_gpu_catalog(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    int n = hexiseq_gpu_catalog_size();
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (int i = 0; i < n; ++i) {
        hexiseq_gpu_spec g;
        hexiseq_status s = hexiseq_gpu_catalog_get(i, &g);
        if (s != HEXISEQ_OK) {
            Py_DECREF(out);
            return raise_status(module, s);
        }
        PyObject *aliases = PyList_New(0);
        for (int a = 0; aliases && a < hexiseq_gpu_alias_count(); ++a) {
            const char *alias, *name;
            if (hexiseq_gpu_alias_get(a, &alias, &name) != HEXISEQ_OK || strcmp(name, g.name) != 0)
                continue;
            PyObject *text = PyUnicode_FromString(alias);
            if (!text || PyList_Append(aliases, text) < 0) {
                Py_XDECREF(text);
                Py_CLEAR(aliases);
                break;
            }
            Py_DECREF(text);
        }
        PyObject *item = aliases ? Py_BuildValue("{s:s,s:d,s:d,s:d,s:d,s:d,s:s,s:s,s:d,s:N}", "name", g.name, "peak_tflops",
                                                 g.peak_tflops, "memory_gib", g.memory_gib, "hbm_gbps", g.hbm_gbps,
                                                 "gemm_eff", g.gemm_eff, "attn_eff", g.attn_eff, "source", g.source,
                                                 "attn_kernel", g.attn_kernel, "host_gbps", g.host_gbps, "aliases",
                                                 aliases)
                                 : NULL;
        if (!item) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* gpu_find(name) -> canonical name; raises UnknownGPUError listing the known models. */
static PyObject *core_gpu_find(PyObject *module, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    hexiseq_gpu_spec g;
    hexiseq_status s = hexiseq_gpu_find(name, &g);
    if (s != HEXISEQ_OK)
        return raise_status(module, s);
    return PyUnicode_FromString(g.name);
}

/* gpu_from_device_name(name) -> the catalog name of a device as its driver names it, or None. */
static PyObject *core_gpu_from_device_name(PyObject *Py_UNUSED(module), PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    const char *gpu = hexiseq_gpu_from_device_name(name);
    if (!gpu)
        Py_RETURN_NONE;
    return PyUnicode_FromString(gpu);
}

/* check_cluster(nodes, inter_gbps, bandwidth, latency, devices) -> number of devices; validates through the core. */
static PyObject *core_check_cluster(PyObject *module, PyObject *args) {
    PyObject *nodes, *bw, *lat, *dev;
    double inter;
    if (!PyArg_ParseTuple(args, "OdOOO:check_cluster", &nodes, &inter, &bw, &lat, &dev))
        return NULL;
    hexiseq_cluster *c = make_cluster(module, nodes, inter, bw, lat, dev);
    if (!c)
        return NULL;
    int32_t n = hexiseq_cluster_num_devices(c);
    hexiseq_cluster_destroy(c);
    return PyLong_FromLong(n);
}

/* int_range(field) -> (lo, hi): the range the core accepts for an integer input (see hexiseq_int_range). */
static PyObject *core_int_range(PyObject *module, PyObject *arg) {
    const char *field = PyUnicode_AsUTF8(arg);
    if (!field)
        return NULL;
    int64_t lo, hi;
    hexiseq_status s = hexiseq_int_range(field, &lo, &hi);
    if (s != HEXISEQ_OK)
        return raise_status(module, s);
    return Py_BuildValue("(LL)", (long long)lo, (long long)hi);
}

/* layout_spans(group_seq, chunking=0) -> (front_start, front_len, back_start, back_len), int64 arrays by
 * group: the positions each group owns (hexiseq_layout_spans, the rule the cost model prices with).
 * group_seq: a 1-D array of int64; chunking: hexiseq_chunking. */
static PyObject *core_layout_spans(PyObject *module, PyObject *args) {
    PyObject *arg;
    int chunking = HEXISEQ_CHUNK_ZIGZAG;
    if (!PyArg_ParseTuple(args, "O|i:layout_spans", &arg, &chunking))
        return NULL;
    PyArrayObject *seq = (PyArrayObject *)PyArray_FROMANY(arg, NPY_INT64, 1, 1, NPY_ARRAY_IN_ARRAY);
    if (!seq)
        return NULL;
    npy_intp n = PyArray_DIM(seq, 0);
    hexiseq_layout l;
    memset(&l, 0, sizeof l);
    l.n_groups = (int32_t)n;
    l.group_seq = (int64_t *)PyArray_DATA(seq);
    l.chunking = chunking;
    hexiseq_group_span *spans = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *spans);
    if (!spans) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    hexiseq_status st = n > INT32_MAX ? HEXISEQ_ERR_INVALID : hexiseq_layout_spans(&l, spans);
    Py_DECREF(seq);
    if (st != HEXISEQ_OK) {
        PyMem_Free(spans);
        return raise_status(module, st);
    }
    PyObject *cols[4] = {NULL, NULL, NULL, NULL};
    for (int c = 0; c < 4; ++c) {
        cols[c] = PyArray_SimpleNew(1, &n, NPY_INT64);
        if (!cols[c])
            break;
        int64_t *dst = PyArray_DATA((PyArrayObject *)cols[c]);
        for (npy_intp g = 0; g < n; ++g)
            dst[g] = c == 0 ? spans[g].front_start : c == 1 ? spans[g].front_len
                     : c == 2 ? spans[g].back_start : spans[g].back_len;
    }
    PyMem_Free(spans);
    PyObject *out = NULL;
    if (cols[0] && cols[1] && cols[2] && cols[3])
        out = PyTuple_Pack(4, cols[0], cols[1], cols[2], cols[3]);
    for (int c = 0; c < 4; ++c)
        Py_XDECREF(cols[c]);
    return out;
}

/* curve_at(curve, size, runtime=False): a measured curve read at `size` exactly as the cost model reads it (a
 * rate: linear in log(size), clamped to its end points; runtime=True: a runtime curve's total nanoseconds at `size`
 * elements, hexiseq_runtime_curve_ns), so that the calibration's own arithmetic on curves cannot drift from the
 * model's. */
static PyObject *core_curve_at(PyObject *module, PyObject *args) {
    PyObject *obj;
    double size;
    int runtime = 0;
    hexiseq_rate_curve cv;
    if (!PyArg_ParseTuple(args, "Od|p", &obj, &size, &runtime))
        return NULL;
    if (parse_curve(module, obj, 0, "curve", &cv) < 0)
        return NULL;
    if (cv.n == 0) {
        invalid(module, "curve must have at least one [size, value] point");
        return NULL;
    }
    return PyFloat_FromDouble(runtime ? hexiseq_runtime_curve_ns(&cv, size) : hexiseq_curve_tflops(&cv, size));
}

/* model_params(model) -> parameter count (float). */
static PyObject *core_model_params(PyObject *module, PyObject *arg) {
    hexiseq_model m;
    if (!parse_model(module, arg, &m))
        return NULL;
    double p;
    hexiseq_status s = hexiseq_model_params(&m, &p);
    if (s != HEXISEQ_OK)
        return raise_status(module, s);
    return PyFloat_FromDouble(p);
}

/* A layout dict (the arrays, and "chunking" when not zigzag) as a hexiseq_layout over the arrays it converts
 * into arr[6] (the caller releases them). Returns 0 with an exception set. */
static int parse_layout(PyObject *module, PyObject *layout_obj, PyArrayObject **arr, hexiseq_layout *l) {
    static const char *keys[6] = {"group_size", "group_seq", "device", "tokens", "head_lo", "head_count"};
    static const int types[6] = {NPY_INT32, NPY_INT64, NPY_INT32, NPY_INT64, NPY_INT32, NPY_INT32};
    int32_t chunking = HEXISEQ_CHUNK_ZIGZAG;
    PyObject *chunk_obj = PyDict_GetItemString(layout_obj, "chunking");
    if (chunk_obj && !int32_arg(module, chunk_obj, "layout.chunking", "layout.chunking", &chunking))
        return 0;
    for (int i = 0; i < 6; ++i) {
        PyObject *item = PyDict_GetItemString(layout_obj, keys[i]);
        if (!item) {
            PyErr_Format(PyExc_KeyError, "layout is missing '%s'", keys[i]);
            return 0;
        }
        arr[i] = as_array(item, types[i], -1, keys[i]);
        if (!arr[i])
            return 0;
    }
    npy_intp n_groups = PyArray_SIZE(arr[0]), n_dev = PyArray_SIZE(arr[2]);
    if (PyArray_SIZE(arr[1]) != n_groups) {
        PyErr_Format(PyExc_ValueError, "group_seq must have one entry per group (%zd), got %zd", (Py_ssize_t)n_groups,
                     (Py_ssize_t)PyArray_SIZE(arr[1]));
        return 0;
    }
    for (int i = 3; i < 6; ++i)
        if (PyArray_SIZE(arr[i]) != n_dev) {
            PyErr_Format(PyExc_ValueError, "%s must have one entry per device (%zd), got %zd", keys[i], (Py_ssize_t)n_dev,
                         (Py_ssize_t)PyArray_SIZE(arr[i]));
            return 0;
        }
    if (n_dev > INT32_MAX || n_groups > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "layout is too large");
        return 0;
    }
    *l = (hexiseq_layout){(int32_t)n_groups, (int32_t)n_dev, PyArray_DATA(arr[0]), PyArray_DATA(arr[1]),
                          PyArray_DATA(arr[2]), PyArray_DATA(arr[3]), PyArray_DATA(arr[4]), PyArray_DATA(arr[5]),
                          chunking};
    return 1;
}

/* evaluate(nodes, inter_gbps, bandwidth, latency, devices, model, training, seq_len, causal, layout_dict
 *          [, documents]) -> (per_device dict of arrays, plan dict). layout_dict may hold "chunking";
 * documents: None or the lengths packed in each sequence. */
static PyObject *core_evaluate(PyObject *module, PyObject *args) {
    PyObject *nodes, *bw, *lat, *dev, *model_obj, *train_obj, *layout_obj, *docs_obj = Py_None;
    double inter;
    long long seq_len;
    int causal;
    if (!PyArg_ParseTuple(args, "OdOOOOOLpO!|O:evaluate", &nodes, &inter, &bw, &lat, &dev, &model_obj, &train_obj,
                          &seq_len, &causal, &PyDict_Type, &layout_obj, &docs_obj))
        return NULL;
    hexiseq_model m;
    hexiseq_training t;
    hexiseq_documents docs;
    if (!parse_inputs(module, model_obj, train_obj, docs_obj, &m, &t, &docs))
        return NULL;
    PyArrayObject *arr[6] = {NULL};
    PyObject *result = NULL;
    hexiseq_cluster *c = NULL;
    hexiseq_device_cost *per = NULL;
    hexiseq_layout l;
    if (!parse_layout(module, layout_obj, arr, &l))
        goto done;
    c = make_cluster(module, nodes, inter, bw, lat, dev);
    if (!c)
        goto done;
    npy_intp n_dev = l.n_devices;
    per = PyMem_Calloc(n_dev ? (size_t)n_dev : 1, sizeof *per);
    if (!per) {
        PyErr_NoMemory();
        goto done;
    }
    hexiseq_plan_cost pc;
    hexiseq_status s;
    Py_BEGIN_ALLOW_THREADS s = hexiseq_evaluate(c, &m, &t, seq_len, causal, &l, per, &pc);
    Py_END_ALLOW_THREADS if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    result = Py_BuildValue("(NN)", device_costs_to_dict(per, n_dev), plan_cost_to_dict(&pc));
done:
    for (int i = 0; i < 6; ++i)
        Py_XDECREF(arr[i]);
    hexiseq_cluster_destroy(c);
    PyMem_Free(per);
    hexiseq_documents_free(&docs);
    return result;
}

/* Cancellation of a long plan: the core polls this about every 50 ms from the planning thread, which runs
 * without the GIL; it takes the GIL back just long enough to run pending signal handlers (Ctrl-C raises
 * KeyboardInterrupt there) and asks the core to stop when one raised. */
typedef struct {
    PyThreadState *saved; /* the thread state released around the core call */
} plan_progress;

static int plan_progress_check(void *user) {
    plan_progress *p = (plan_progress *)user;
    PyEval_RestoreThread(p->saved);
    int stop = PyErr_CheckSignals() != 0;
    p->saved = PyEval_SaveThread();
    return stop;
}

/* plan_strategy(nodes, inter_gbps, bandwidth, latency, devices, model, training, seq_len, causal, strategy
 *               [, time_limit_s[, documents]]) -> (layout dict, info dict {stopped_early, evaluations, elapsed_s})
 * time_limit_s <= 0: no limit. A signal handler that raises (Ctrl-C) ends the call with its exception. */
static PyObject *core_plan_strategy(PyObject *module, PyObject *args) {
    PyObject *nodes, *bw, *lat, *dev, *model_obj, *train_obj, *docs_obj = Py_None;
    double inter, time_limit_s = 0.0;
    long long seq_len;
    int causal, strategy;
    if (!PyArg_ParseTuple(args, "OdOOOOOLpi|dO:plan_strategy", &nodes, &inter, &bw, &lat, &dev, &model_obj,
                          &train_obj, &seq_len, &causal, &strategy, &time_limit_s, &docs_obj))
        return NULL;
    hexiseq_model m;
    hexiseq_training t;
    hexiseq_documents docs;
    if (!parse_inputs(module, model_obj, train_obj, docs_obj, &m, &t, &docs))
        return NULL;
    hexiseq_cluster *c = make_cluster(module, nodes, inter, bw, lat, dev);
    if (!c) {
        hexiseq_documents_free(&docs);
        return NULL;
    }
    hexiseq_layout l;
    hexiseq_plan_cost pc;
    hexiseq_plan_info info;
    plan_progress progress;
    hexiseq_plan_options opt = {time_limit_s, plan_progress_check, &progress};
    progress.saved = PyEval_SaveThread();
    hexiseq_status s = hexiseq_plan_strategy_ex(c, &m, &t, seq_len, causal, (hexiseq_strategy)strategy, &opt, &l, &pc,
                                                &info);
    PyEval_RestoreThread(progress.saved);
    hexiseq_cluster_destroy(c);
    hexiseq_documents_free(&docs);
    if (s != HEXISEQ_OK) {
        hexiseq_layout_free(&l);
        if (s == HEXISEQ_ERR_CANCELLED && PyErr_Occurred())
            return NULL; /* the exception a signal handler raised, KeyboardInterrupt for Ctrl-C */
        return raise_status(module, s);
    }
    PyObject *out = layout_to_dict(&l);
    hexiseq_layout_free(&l);
    if (!out)
        return NULL;
    return Py_BuildValue("(N{s:O,s:L,s:d})", out, "stopped_early", info.stopped_early ? Py_True : Py_False,
                         "evaluations", (long long)info.evaluations, "elapsed_s", info.elapsed_s);
}

/* memory_tokens_bound(nodes, inter_gbps, bandwidth, latency, devices, model, training) -> int: the longest sequence
 * any layout could fit in memory (hexiseq_memory_tokens_bound; a necessary condition only), or None when nothing
 * grows with the tokens. */
static PyObject *core_memory_tokens_bound(PyObject *module, PyObject *args) {
    PyObject *nodes, *bw, *lat, *dev, *model_obj, *train_obj;
    double inter;
    if (!PyArg_ParseTuple(args, "OdOOOOO:memory_tokens_bound", &nodes, &inter, &bw, &lat, &dev, &model_obj,
                          &train_obj))
        return NULL;
    hexiseq_model m;
    hexiseq_training t;
    hexiseq_documents docs;
    if (!parse_inputs(module, model_obj, train_obj, Py_None, &m, &t, &docs))
        return NULL;
    hexiseq_documents_free(&docs);
    hexiseq_cluster *c = make_cluster(module, nodes, inter, bw, lat, dev);
    if (!c)
        return NULL;
    int64_t bound = hexiseq_memory_tokens_bound(c, &m, &t);
    hexiseq_cluster_destroy(c);
    if (bound == INT64_MAX)
        Py_RETURN_NONE;
    return PyLong_FromLongLong((long long)bound);
}

/* rebalance(nodes, inter_gbps, bandwidth, latency, devices, model, training, seq_len, causal, layout_dict,
 *           documents[, heads]) -> layout dict: hexiseq_rebalance, or hexiseq_rebalance_heads when heads. */
static PyObject *core_rebalance(PyObject *module, PyObject *args) {
    PyObject *nodes, *bw, *lat, *dev, *model_obj, *train_obj, *layout_obj, *docs_obj;
    double inter;
    long long seq_len;
    int causal;
    int heads = 0;
    if (!PyArg_ParseTuple(args, "OdOOOOOLpO!O|p:rebalance", &nodes, &inter, &bw, &lat, &dev, &model_obj, &train_obj,
                          &seq_len, &causal, &PyDict_Type, &layout_obj, &docs_obj, &heads))
        return NULL;
    hexiseq_model m;
    hexiseq_training t;
    hexiseq_documents docs;
    if (!parse_inputs(module, model_obj, train_obj, docs_obj, &m, &t, &docs))
        return NULL;
    PyObject *result = NULL;
    hexiseq_cluster *c = NULL;
    hexiseq_layout in;
    PyArrayObject *arr[6] = {NULL};
    if (!parse_layout(module, layout_obj, arr, &in))
        goto done;
    c = make_cluster(module, nodes, inter, bw, lat, dev);
    if (!c)
        goto done;
    hexiseq_layout out;
    hexiseq_plan_cost pc;
    hexiseq_status s;
    Py_BEGIN_ALLOW_THREADS s = heads ? hexiseq_rebalance_heads(c, &m, &t, seq_len, causal, &in, &out, &pc)
                                     : hexiseq_rebalance(c, &m, &t, seq_len, causal, &in, &out, &pc);
    Py_END_ALLOW_THREADS if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    result = layout_to_dict(&out);
    hexiseq_layout_free(&out);
done:
    for (int i = 0; i < 6; ++i)
        Py_XDECREF(arr[i]);
    hexiseq_cluster_destroy(c);
    hexiseq_documents_free(&docs);
    return result;
}

/* batch_assign(cost [G, N] float64, fixed [G] or None, tokens [N] int64, capacity [G] or None, time_limit_s[, quick
 *   [, rounds]]) -> (group_of int32 [N], group_time_s [G], {makespan_s, lower_bound_s, exact, iterations}):
 *   hexiseq_batch_assign, or hexiseq_batch_assign_quick when quick is true, or hexiseq_batch_assign_rounds when
 *   rounds > 0 (no time limit then).
 * The cost matrix may hold inf where a group cannot run a sequence. */
static PyObject *core_batch_assign(PyObject *module, PyObject *args) {
    PyObject *cost_obj, *fixed_obj, *tokens_obj, *cap_obj;
    double time_limit_s;
    int quick = 0;
    long long rounds = 0;
    if (!PyArg_ParseTuple(args, "OOOOd|pL:batch_assign", &cost_obj, &fixed_obj, &tokens_obj, &cap_obj, &time_limit_s,
                          &quick, &rounds))
        return NULL;
    PyObject *result = NULL;
    PyArrayObject *cost = NULL, *fixed = NULL, *tokens = NULL, *cap = NULL, *group_of = NULL, *group_time = NULL;
    cost = (PyArrayObject *)PyArray_FROMANY(cost_obj, NPY_DOUBLE, 2, 2, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!cost) {
        invalid(module, "batch cost must be a [groups, sequences] matrix of numbers");
        goto done;
    }
    npy_intp G = PyArray_DIM(cost, 0), N = PyArray_DIM(cost, 1);
    if (G < 1 || G > INT32_MAX || N > INT32_MAX) {
        invalid(module, "batch cost must have 1 to 2^31 - 1 groups and at most 2^31 - 1 sequences, got %zd x %zd",
                (Py_ssize_t)G, (Py_ssize_t)N);
        goto done;
    }
    if (!(tokens = as_array(tokens_obj, NPY_INT64, N, "tokens")))
        goto done;
    if (fixed_obj != Py_None && !(fixed = as_array(fixed_obj, NPY_DOUBLE, G, "fixed_s")))
        goto done;
    if (cap_obj != Py_None && !(cap = as_array(cap_obj, NPY_INT64, G, "capacity")))
        goto done;
    npy_intp n_out = N > 0 ? N : 1;
    group_of = (PyArrayObject *)PyArray_SimpleNew(1, &n_out, NPY_INT32);
    group_time = (PyArrayObject *)PyArray_SimpleNew(1, &G, NPY_DOUBLE);
    if (!group_of || !group_time)
        goto done;
    hexiseq_batch_problem p = {(int32_t)G, (int32_t)N, (const double *)PyArray_DATA(cost),
                               fixed ? (const double *)PyArray_DATA(fixed) : NULL,
                               (const int64_t *)PyArray_DATA(tokens), cap ? (const int64_t *)PyArray_DATA(cap) : NULL};
    hexiseq_batch_result r;
    hexiseq_status s;
    Py_BEGIN_ALLOW_THREADS
    if (rounds > 0)
        s = hexiseq_batch_assign_rounds(&p, (int64_t)rounds, (int32_t *)PyArray_DATA(group_of),
                                        (double *)PyArray_DATA(group_time), &r);
    else
        s = (quick ? hexiseq_batch_assign_quick : hexiseq_batch_assign)(&p, time_limit_s,
                                                                        (int32_t *)PyArray_DATA(group_of),
                                                                        (double *)PyArray_DATA(group_time), &r);
    Py_END_ALLOW_THREADS
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    if (N == 0) {
        Py_DECREF(group_of);
        npy_intp zero = 0;
        group_of = (PyArrayObject *)PyArray_SimpleNew(1, &zero, NPY_INT32);
        if (!group_of)
            goto done;
    }
    result = Py_BuildValue("(OO{s:d,s:d,s:O,s:L})", group_of, group_time, "makespan_s", r.makespan_s,
                           "lower_bound_s", r.lower_bound_s, "exact", r.exact ? Py_True : Py_False, "iterations",
                           (long long)r.iterations);
done:
    Py_XDECREF(cost);
    Py_XDECREF(fixed);
    Py_XDECREF(tokens);
    Py_XDECREF(cap);
    Py_XDECREF(group_of);
    Py_XDECREF(group_time);
    return result;
}

/* pipeline_schedule(forward_s [P], backward_s [P], send_s [P - 1] or None, micro_batches) -> ({step_s, work_s,
 *   bubble_s, bottleneck}, idle_s [P], in_flight int32 [P]): hexiseq_pipeline_schedule. */
static PyObject *core_pipeline_schedule(PyObject *module, PyObject *args) {
    PyObject *f_obj, *b_obj, *s_obj;
    int micro_batches;
    if (!PyArg_ParseTuple(args, "OOOi:pipeline_schedule", &f_obj, &b_obj, &s_obj, &micro_batches))
        return NULL;
    PyObject *result = NULL;
    PyArrayObject *f = NULL, *b = NULL, *send = NULL, *idle = NULL, *in_flight = NULL;
    f = (PyArrayObject *)PyArray_FROMANY(f_obj, NPY_DOUBLE, 1, 1, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!f) {
        invalid(module, "forward_s must be a list of numbers, one per stage");
        goto done;
    }
    npy_intp P = PyArray_DIM(f, 0);
    if (P < 1 || P > INT32_MAX) {
        invalid(module, "a pipeline must have 1 to 2^31 - 1 stages, got %zd", (Py_ssize_t)P);
        goto done;
    }
    if (!(b = as_array(b_obj, NPY_DOUBLE, P, "backward_s")))
        goto done;
    if (s_obj != Py_None && !(send = as_array(s_obj, NPY_DOUBLE, P - 1, "send_s")))
        goto done;
    idle = (PyArrayObject *)PyArray_SimpleNew(1, &P, NPY_DOUBLE);
    in_flight = (PyArrayObject *)PyArray_SimpleNew(1, &P, NPY_INT32);
    if (!idle || !in_flight)
        goto done;
    hexiseq_pipeline p = {(int32_t)P, (int32_t)micro_batches, (const double *)PyArray_DATA(f),
                          (const double *)PyArray_DATA(b), send ? (const double *)PyArray_DATA(send) : NULL};
    hexiseq_pipeline_timing t;
    hexiseq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = hexiseq_pipeline_schedule(&p, (double *)PyArray_DATA(idle), (int32_t *)PyArray_DATA(in_flight), &t);
    Py_END_ALLOW_THREADS
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    result = Py_BuildValue("({s:d,s:d,s:d,s:i}OO)", "step_s", t.step_s, "work_s", t.work_s, "bubble_s", t.bubble_s,
                           "bottleneck", (int)t.bottleneck, idle, in_flight);
done:
    Py_XDECREF(f);
    Py_XDECREF(b);
    Py_XDECREF(send);
    Py_XDECREF(idle);
    Py_XDECREF(in_flight);
    return result;
}

/* pipeline_split(layers, fixed_s [P], layer_s [P], most_layers [P] or None) -> (layers int32 [P], max_stage_s):
 *   hexiseq_pipeline_split. */
static PyObject *core_pipeline_split(PyObject *module, PyObject *args) {
    PyObject *fixed_obj, *per_obj, *most_obj;
    int layers;
    if (!PyArg_ParseTuple(args, "iOOO:pipeline_split", &layers, &fixed_obj, &per_obj, &most_obj))
        return NULL;
    PyObject *result = NULL;
    PyArrayObject *fixed = NULL, *per = NULL, *most = NULL, *out = NULL;
    fixed = (PyArrayObject *)PyArray_FROMANY(fixed_obj, NPY_DOUBLE, 1, 1, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!fixed) {
        invalid(module, "fixed_s must be a list of numbers, one per stage");
        goto done;
    }
    npy_intp P = PyArray_DIM(fixed, 0);
    if (P < 1 || P > INT32_MAX) {
        invalid(module, "a pipeline must have 1 to 2^31 - 1 stages, got %zd", (Py_ssize_t)P);
        goto done;
    }
    if (!(per = as_array(per_obj, NPY_DOUBLE, P, "layer_s")))
        goto done;
    if (most_obj != Py_None && !(most = as_array(most_obj, NPY_INT32, P, "most_layers")))
        goto done;
    if (!(out = (PyArrayObject *)PyArray_SimpleNew(1, &P, NPY_INT32)))
        goto done;
    double max_stage_s = 0.0;
    hexiseq_status s = hexiseq_pipeline_split((int32_t)P, (int32_t)layers, (const double *)PyArray_DATA(fixed),
                                              (const double *)PyArray_DATA(per),
                                              most ? (const int32_t *)PyArray_DATA(most) : NULL,
                                              (int32_t *)PyArray_DATA(out), &max_stage_s);
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    result = Py_BuildValue("(Od)", out, max_stage_s);
done:
    Py_XDECREF(fixed);
    Py_XDECREF(per);
    Py_XDECREF(most);
    Py_XDECREF(out);
    return result;
}

PyMethodDef core_plan_methods[] = {
    {"gpu_catalog", core_gpu_catalog, METH_NOARGS, "The built-in GPU catalog, a list of dicts."},
    {"gpu_find", core_gpu_find, METH_O, "Canonical catalog name of a GPU model name or alias."},
    {"gpu_from_device_name", core_gpu_from_device_name, METH_O,
     "Catalog name of a device as its driver names it (CUDA's device name), or None."},
    {"check_cluster", core_check_cluster, METH_VARARGS, "Validate a cluster description; returns its device count."},
    {"int_range", core_int_range, METH_O, "(lo, hi) the core accepts for a named integer input."},
    {"rebalance", core_rebalance, METH_VARARGS, "A layout's sequence split re-optimised for new documents."},
    {"layout_spans", core_layout_spans, METH_VARARGS, "(front_start, front_len, back_start, back_len) of each group."},
    {"model_params", core_model_params, METH_O, "Parameter count of a model tuple."},
    {"curve_at", core_curve_at, METH_VARARGS, "A measured curve at a size, read as the cost model reads it."},
    {"evaluate", core_evaluate, METH_VARARGS, "Score a layout: (per-device dict, plan dict)."},
    {"memory_tokens_bound", core_memory_tokens_bound, METH_VARARGS,
     "The longest sequence any layout could fit in memory (a necessary condition), or None."},
    {"plan_strategy", core_plan_strategy, METH_VARARGS, "Best layout of a strategy, as a dict of arrays, and what the search did."},
    {"batch_assign", core_batch_assign, METH_VARARGS, "Sequences of a batch to groups, minimising the makespan."},
    {"pipeline_schedule", core_pipeline_schedule, METH_VARARGS, "The 1F1B schedule's timing over unequal stages."},
    {"pipeline_split", core_pipeline_split, METH_VARARGS, "Layers split over stages, the slowest stage fastest."},
    {NULL, NULL, 0, NULL},
};

int core_plan_exec(PyObject *module) {
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    return core_enums_exec(module);
}
