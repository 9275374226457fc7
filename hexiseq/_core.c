/* The CPython binding of the HexiSeq C core: argument parsing, NumPy arrays in and out, status codes to
 * exceptions. It holds no algorithm; everything it calls is declared in csrc/hexiseq.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include "hexiseq.h"

#ifdef HEXISEQ_WITH_CUDA
#include <dlfcn.h> /* the CUDA kernels are a separate library, opened on first use (see cuda_load) */
#endif

#define MAX_NODES 65536
#define HEXISEQ_MAX_DEVICES_BINDING 65536 /* the core rejects larger clusters by itself */

/* ------------------------------------------------------------------ module state and errors */

typedef struct {
    PyObject *errors[HEXISEQ_STATUS_COUNT]; /* exception class per hexiseq_status, [0] unused */
    PyObject *type_error; /* hexiseq.errors.ArgumentTypeError: an argument of the wrong kind */
} core_state;

static core_state *get_state(PyObject *module) { return (core_state *)PyModule_GetState(module); }

/* Raise the exception class mapped to `status` with the core's last-error text; returns NULL. */
static PyObject *raise_status(PyObject *module, hexiseq_status status) {
    core_state *st = get_state(module);
    PyObject *cls = (status > 0 && status < HEXISEQ_STATUS_COUNT) ? st->errors[status] : NULL;
    const char *detail = hexiseq_last_error();
    PyErr_SetString(cls ? cls : PyExc_RuntimeError, detail[0] ? detail : hexiseq_status_string(status));
    return NULL;
}

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

/* Per-device descriptions from None or a list of n entries, each None or (memory_gib, gemm, attn, attn_causal)
 * with curves as above. Returns a PyMem block (NULL with *none set when not given) or NULL on error. */
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
        PyObject *item = PyList_GET_ITEM(obj, i), *g, *a, *ac;
        if (item == Py_None)
            continue;
        if (!PyArg_ParseTuple(item, "dOOO;devices entries are (memory_gib, gemm, attn, attn_causal)", &dd[i].memory_gib,
                              &g, &a, &ac) ||
            parse_curve(module, g, i, "gemm_tflops", &dd[i].gemm) < 0 ||
            parse_curve(module, a, i, "attn_tflops", &dd[i].attn) < 0 ||
            parse_curve(module, ac, i, "attn_causal_tflops", &dd[i].attn_causal) < 0) {
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
        if (!PyArg_ParseTuple(PyList_GET_ITEM(nodes, i), "sOddddd;nodes entries are (gpu, count, intra_gbps, memory_gib, peak_tflops, gemm_eff, attn_eff)",
                              &d->gpu, &count, &d->intra_gbps, &d->memory_gib, &d->peak_tflops, &d->gemm_eff,
                              &d->attn_eff) ||
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

/* A model from (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, dtype_bytes, gated_mlp). */
static int parse_model(PyObject *module, PyObject *obj, hexiseq_model *m) {
    static const char *names[9] = {"model.layers", "model.hidden", "model.heads", "model.kv_heads", "model.head_dim",
                                   "model.ffn", "model.vocab", "model.dtype_bytes", "model.gated_mlp"};
    int32_t *dst[9] = {&m->layers, &m->hidden, &m->heads, &m->kv_heads, &m->head_dim, &m->ffn, &m->vocab,
                       &m->dtype_bytes, &m->gated_mlp};
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "model is (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, dtype_bytes, gated_mlp)");
        return 0;
    }
    for (int i = 0; i < 9; ++i)
        if (!int32_arg(module, PyTuple_GET_ITEM(obj, i), names[i], names[i], dst[i]))
            return 0;
    return 1;
}

/* A training setting from (sequences, checkpointing, sharding, reserved_gib, state_shares). */
static int parse_training(PyObject *module, PyObject *obj, hexiseq_training *t) {
    static const char *names[4] = {"training.sequences", "training.checkpointing", "training.sharding",
                                   "training.state_shares"};
    int32_t *dst[4] = {&t->sequences, &t->checkpointing, &t->sharding, &t->state_shares};
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 5) {
        PyErr_SetString(PyExc_TypeError, "training is (sequences, checkpointing, sharding, reserved_gib, state_shares)");
        return 0;
    }
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

static PyObject *layout_to_dict(const hexiseq_layout *l) {
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N}",
                         "group_size", new_array(NPY_INT32, l->n_groups, l->group_size, sizeof(int32_t)),
                         "group_seq", new_array(NPY_INT64, l->n_groups, l->group_seq, sizeof(int64_t)),
                         "device", new_array(NPY_INT32, l->n_devices, l->device, sizeof(int32_t)),
                         "tokens", new_array(NPY_INT64, l->n_devices, l->tokens, sizeof(int64_t)),
                         "head_lo", new_array(NPY_INT32, l->n_devices, l->head_lo, sizeof(int32_t)),
                         "head_count", new_array(NPY_INT32, l->n_devices, l->head_count, sizeof(int32_t)));
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
    static const struct {
        const char *name;
        size_t offset;
    } cols[] = {
        {"gemm_s", offsetof(hexiseq_device_cost, gemm_s)},
        {"layer_gemm_s", offsetof(hexiseq_device_cost, layer_gemm_s)},
        {"attn_s", offsetof(hexiseq_device_cost, attn_s)},
        {"a2a_s", offsetof(hexiseq_device_cost, a2a_s)},
        {"ring_exposed_s", offsetof(hexiseq_device_cost, ring_exposed_s)},
        {"busy_s", offsetof(hexiseq_device_cost, busy_s)},
        {"mem_states_gib", offsetof(hexiseq_device_cost, mem_states_gib)},
        {"mem_act_gib", offsetof(hexiseq_device_cost, mem_act_gib)},
        {"mem_attn_gib", offsetof(hexiseq_device_cost, mem_attn_gib)},
        {"mem_ring_gib", offsetof(hexiseq_device_cost, mem_ring_gib)},
        {"mem_total_gib", offsetof(hexiseq_device_cost, mem_total_gib)},
        {"mem_cap_gib", offsetof(hexiseq_device_cost, mem_cap_gib)},
        {"state_share", offsetof(hexiseq_device_cost, state_share)},
        {"ring_send_bytes", offsetof(hexiseq_device_cost, ring_send_bytes)},
        {"ring_recv_bytes", offsetof(hexiseq_device_cost, ring_recv_bytes)},
        {"a2a_send_bytes", offsetof(hexiseq_device_cost, a2a_send_bytes)},
        {"a2a_recv_bytes", offsetof(hexiseq_device_cost, a2a_recv_bytes)},
    };
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    for (size_t c = 0; c < sizeof cols / sizeof cols[0]; ++c) {
        PyObject *arr = PyArray_SimpleNew(1, &n, NPY_DOUBLE);
        if (!arr) {
            Py_DECREF(out);
            return NULL;
        }
        double *dst = PyArray_DATA((PyArrayObject *)arr);
        for (npy_intp i = 0; i < n; ++i)
            dst[i] = *(const double *)((const char *)&dc[i] + cols[c].offset);
        int rc = PyDict_SetItemString(out, cols[c].name, arr);
        Py_DECREF(arr);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    static const struct {
        const char *name;
        size_t offset;
    } ints[] = {
        {"kv_lo", offsetof(hexiseq_device_cost, kv_lo)},
        {"kv_count", offsetof(hexiseq_device_cost, kv_count)},
        {"first_lo", offsetof(hexiseq_device_cost, first_lo)},
        {"first_count", offsetof(hexiseq_device_cost, first_count)},
    };
    for (size_t c = 0; c < sizeof ints / sizeof ints[0]; ++c) {
        PyObject *arr = PyArray_SimpleNew(1, &n, NPY_INT32);
        if (!arr) {
            Py_DECREF(out);
            return NULL;
        }
        int32_t *dst = PyArray_DATA((PyArrayObject *)arr);
        for (npy_intp i = 0; i < n; ++i)
            dst[i] = *(const int32_t *)((const char *)&dc[i] + ints[c].offset);
        int rc = PyDict_SetItemString(out, ints[c].name, arr);
        Py_DECREF(arr);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* ------------------------------------------------------------------ functions */

static PyObject *core_build_info(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
#ifdef _OPENMP
    PyObject *openmp = Py_True;
#else
    PyObject *openmp = Py_False;
#endif
#ifdef HEXISEQ_WITH_CUDA
    PyObject *cuda = Py_True;
    int runtime = HEXISEQ_CUDA_RUNTIME;
#else
    PyObject *cuda = Py_False;
    int runtime = 0;
#endif
#if defined(__clang__)
    const char *compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
    const char *compiler = "gcc " __VERSION__;
#else
    const char *compiler = "unknown";
#endif
    return Py_BuildValue("{s:s,s:O,s:i,s:s,s:O}", "version", HEXISEQ_VERSION, "cuda", cuda, "cuda_runtime", runtime,
                         "compiler", compiler, "openmp", openmp);
}

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
        PyObject *item = aliases ? Py_BuildValue("{s:s,s:d,s:d,s:d,s:d,s:d,s:s,s:N}", "name", g.name, "peak_tflops",
                                                 g.peak_tflops, "memory_gib", g.memory_gib, "hbm_gbps", g.hbm_gbps,
                                                 "gemm_eff", g.gemm_eff, "attn_eff", g.attn_eff, "source", g.source,
                                                 "aliases", aliases)
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

/* layout_spans(group_seq) -> (front_start, front_len, back_start, back_len), int64 arrays by group: the
 * positions each group owns under the balanced causal layout (hexiseq_layout_spans, the rule the cost model
 * prices with). group_seq: a 1-D array of int64. */
static PyObject *core_layout_spans(PyObject *module, PyObject *arg) {
    PyArrayObject *seq = (PyArrayObject *)PyArray_FROMANY(arg, NPY_INT64, 1, 1, NPY_ARRAY_IN_ARRAY);
    if (!seq)
        return NULL;
    npy_intp n = PyArray_DIM(seq, 0);
    hexiseq_layout l;
    memset(&l, 0, sizeof l);
    l.n_groups = (int32_t)n;
    l.group_seq = (int64_t *)PyArray_DATA(seq);
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

/* evaluate(nodes, inter_gbps, bandwidth, latency, devices, model, training, seq_len, causal, layout_dict)
 *   -> (per_device dict of arrays, plan dict) */
static PyObject *core_evaluate(PyObject *module, PyObject *args) {
    PyObject *nodes, *bw, *lat, *dev, *model_obj, *train_obj, *layout_obj;
    double inter;
    long long seq_len;
    int causal;
    if (!PyArg_ParseTuple(args, "OdOOOOOLpO!:evaluate", &nodes, &inter, &bw, &lat, &dev, &model_obj, &train_obj,
                          &seq_len, &causal, &PyDict_Type, &layout_obj))
        return NULL;
    hexiseq_model m;
    hexiseq_training t;
    if (!parse_model(module, model_obj, &m) || !parse_training(module, train_obj, &t))
        return NULL;

    static const char *keys[6] = {"group_size", "group_seq", "device", "tokens", "head_lo", "head_count"};
    static const int types[6] = {NPY_INT32, NPY_INT64, NPY_INT32, NPY_INT64, NPY_INT32, NPY_INT32};
    PyArrayObject *arr[6] = {NULL};
    PyObject *result = NULL;
    hexiseq_cluster *c = NULL;
    hexiseq_device_cost *per = NULL;
    for (int i = 0; i < 6; ++i) {
        PyObject *item = PyDict_GetItemString(layout_obj, keys[i]);
        if (!item) {
            PyErr_Format(PyExc_KeyError, "layout is missing '%s'", keys[i]);
            goto done;
        }
        arr[i] = as_array(item, types[i], -1, keys[i]);
        if (!arr[i])
            goto done;
    }
    npy_intp n_groups = PyArray_SIZE(arr[0]), n_dev = PyArray_SIZE(arr[2]);
    if (PyArray_SIZE(arr[1]) != n_groups) {
        PyErr_Format(PyExc_ValueError, "group_seq must have one entry per group (%zd), got %zd", (Py_ssize_t)n_groups,
                     (Py_ssize_t)PyArray_SIZE(arr[1]));
        goto done;
    }
    for (int i = 3; i < 6; ++i)
        if (PyArray_SIZE(arr[i]) != n_dev) {
            PyErr_Format(PyExc_ValueError, "%s must have one entry per device (%zd), got %zd", keys[i], (Py_ssize_t)n_dev,
                         (Py_ssize_t)PyArray_SIZE(arr[i]));
            goto done;
        }
    if (n_dev > INT32_MAX || n_groups > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "layout is too large");
        goto done;
    }
    c = make_cluster(module, nodes, inter, bw, lat, dev);
    if (!c)
        goto done;
    hexiseq_layout l = {(int32_t)n_groups, (int32_t)n_dev, PyArray_DATA(arr[0]), PyArray_DATA(arr[1]),
                        PyArray_DATA(arr[2]), PyArray_DATA(arr[3]), PyArray_DATA(arr[4]), PyArray_DATA(arr[5])};
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
 *               [, time_limit_s]) -> (layout dict, info dict {stopped_early, evaluations, elapsed_s})
 * time_limit_s <= 0: no limit. A signal handler that raises (Ctrl-C) ends the call with its exception. */
static PyObject *core_plan_strategy(PyObject *module, PyObject *args) {
    PyObject *nodes, *bw, *lat, *dev, *model_obj, *train_obj;
    double inter, time_limit_s = 0.0;
    long long seq_len;
    int causal, strategy;
    if (!PyArg_ParseTuple(args, "OdOOOOOLpi|d:plan_strategy", &nodes, &inter, &bw, &lat, &dev, &model_obj, &train_obj,
                          &seq_len, &causal, &strategy, &time_limit_s))
        return NULL;
    hexiseq_model m;
    hexiseq_training t;
    if (!parse_model(module, model_obj, &m) || !parse_training(module, train_obj, &t))
        return NULL;
    hexiseq_cluster *c = make_cluster(module, nodes, inter, bw, lat, dev);
    if (!c)
        return NULL;
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

/* ================================================================== BEGIN attention over DLPack
 * Tensors arrive as objects implementing __dlpack__ (torch.Tensor, numpy.ndarray, ...). Protocol, per the
 * DLPack Python specification (python_spec.rst, DLPack 1.0):
 *   1. call obj.__dlpack__(max_version=(1, 0)); on TypeError (a producer predating versioning) call
 *      obj.__dlpack__() instead;
 *   2. accept a capsule named "dltensor_versioned" (DLManagedTensorVersioned) or "dltensor" (legacy
 *      DLManagedTensor); rename it "used_dltensor_versioned" / "used_dltensor" at once, which moves
 *      ownership to us: the producer's capsule destructor then does nothing;
 *   3. a versioned tensor whose major version is not 1 is released (deleter) and refused unread;
 *   4. outputs must not carry the READ_ONLY or IS_COPIED flags (a write would fail or be lost);
 *   5. views are built over the producer's memory (no copies), the kernel runs with the GIL released,
 *      and every consumed managed tensor's deleter is called exactly once afterwards, on success or error.
 * Shape/dtype/overlap validation lives in csrc/tensor_view.c; this section only moves objects across. */
#include "dlpack.h"
#include "tensor_view.h"

/* One consumed export; at most one of the two pointers is set, both NULL once released. */
typedef struct {
    DLManagedTensor *legacy;
    DLManagedTensorVersioned *versioned;
} dl_held;

static void dl_release(dl_held *h) {
    DLManagedTensorVersioned *mv = h->versioned;
    DLManagedTensor *ml = h->legacy;
    h->versioned = NULL;
    h->legacy = NULL;
    if (mv && mv->deleter)
        mv->deleter(mv);
    if (ml && ml->deleter)
        ml->deleter(ml);
}

/* Release all, keeping any pending exception: deleters may run Python code (NumPy's drops a reference). */
static void dl_release_all(dl_held *held, int n) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (int i = 0; i < n; ++i)
        dl_release(&held[i]);
    PyErr_Restore(type, value, tb);
}

/* Re-raise the pending exception as the same type with "<name>.__dlpack__() failed: " in front, chained. */
static void dl_prefix_error(const char *name) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value == NULL) {
        PyErr_Restore(type, value, tb);
        return;
    }
    if (tb)
        PyException_SetTraceback(value, tb);
    PyErr_Format(type, "%s.__dlpack__() failed: %S", name, value);
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (v2)
        PyException_SetCause(v2, value); /* steals value */
    else
        Py_DECREF(value);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyErr_Restore(t2, v2, tb2);
}

/* One tensor argument of a call. */
typedef struct {
    PyObject *obj;
    const char *name;   /* "q", "out", ... */
    int32_t ndim;
    const char *layout; /* "[batch, seq, heads, head_dim]" */
    int output;         /* written in place */
    hexiseq_tensor_view *view;
} dl_arg;

/* Steps 1-4 of the protocol for one argument; fills *held and *arg->view. Returns 0, or -1 with an
 * exception set (anything already in *held is still owned by the caller, who releases it). */
static int dl_import(PyObject *module, const dl_arg *arg, int cuda, dl_held *held) {
    core_state *st = get_state(module);
    PyObject *meth = PyObject_GetAttrString(arg->obj, "__dlpack__");
    if (!meth) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(st->type_error,
                         "%s must be a tensor implementing __dlpack__ (torch.Tensor, numpy.ndarray), got %.200s",
                         arg->name, Py_TYPE(arg->obj)->tp_name);
        }
        return -1;
    }
    PyObject *cap = NULL;
    PyObject *empty = PyTuple_New(0);
    PyObject *kwargs = Py_BuildValue("{s:(ii)}", "max_version", (int)HEXISEQ_DLPACK_MAJOR_VERSION,
                                     (int)HEXISEQ_DLPACK_MINOR_VERSION);
    if (empty && kwargs) {
        cap = PyObject_Call(meth, empty, kwargs);
        if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) { /* producer without max_version */
            PyErr_Clear();
            cap = PyObject_CallNoArgs(meth);
        }
        if (!cap)
            dl_prefix_error(arg->name);
    }
    Py_XDECREF(empty);
    Py_XDECREF(kwargs);
    Py_DECREF(meth);
    if (!cap)
        return -1;

    const DLTensor *t;
    uint64_t flags = 0;
    if (PyCapsule_IsValid(cap, HEXISEQ_DLPACK_CAPSULE_VERSIONED)) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, HEXISEQ_DLPACK_CAPSULE_VERSIONED);
        if (!m || PyCapsule_SetName(cap, HEXISEQ_DLPACK_CAPSULE_VERSIONED_USED) < 0) {
            Py_DECREF(cap);
            return -1;
        }
        Py_DECREF(cap); /* renamed: its destructor no longer touches m */
        held->versioned = m;
        if (m->version.major != HEXISEQ_DLPACK_MAJOR_VERSION) {
            unsigned major = m->version.major, minor = m->version.minor;
            dl_release(held); /* the spec: call the deleter, read nothing else */
            PyErr_Format(st->errors[HEXISEQ_ERR_UNSUPPORTED],
                         "%s: DLPack version %u.%u is not supported; this build reads major version %u", arg->name,
                         major, minor, HEXISEQ_DLPACK_MAJOR_VERSION);
            return -1;
        }
        flags = m->flags;
        t = &m->dl_tensor;
    } else if (PyCapsule_IsValid(cap, HEXISEQ_DLPACK_CAPSULE_LEGACY)) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, HEXISEQ_DLPACK_CAPSULE_LEGACY);
        if (!m || PyCapsule_SetName(cap, HEXISEQ_DLPACK_CAPSULE_LEGACY_USED) < 0) {
            Py_DECREF(cap);
            return -1;
        }
        Py_DECREF(cap);
        held->legacy = m;
        t = &m->dl_tensor;
    } else {
        const char *cname = PyCapsule_CheckExact(cap) ? PyCapsule_GetName(cap) : NULL;
        PyErr_Clear();
        PyErr_Format(st->type_error,
                     "%s.__dlpack__() must return a PyCapsule named 'dltensor_versioned' or 'dltensor', got %.100s%s%s%s",
                     arg->name, Py_TYPE(cap)->tp_name, cname ? " named '" : "", cname ? cname : "",
                     cname ? "' (already consumed?)" : "");
        Py_DECREF(cap);
        return -1;
    }
    if (arg->output && (flags & DLPACK_FLAG_BITMASK_IS_COPIED)) {
        PyErr_Format(st->errors[HEXISEQ_ERR_INVALID],
                     "%s was exported as a copy (DLPack IS_COPIED flag); the result is written in place and "
                     "would be lost, so pass a tensor that exports its own memory",
                     arg->name);
        return -1;
    }
    hexiseq_status s = hexiseq_tensor_view_from_dl_on(t, (flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0, arg->name,
                                                      arg->ndim, arg->layout, cuda, arg->view);
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        return -1;
    }
    return 0;
}

/* cuda: the CUDA path (kDLCUDA views, all on one device) instead of the CPU one. */
static int dl_import_all(PyObject *module, const dl_arg *args, int n, int cuda, dl_held *held) {
    for (int i = 0; i < n; ++i)
        if (dl_import(module, &args[i], cuda, &held[i]) < 0)
            return -1;
    for (int i = 1; cuda && i < n; ++i)
        if (args[i].view->device_id != args[0].view->device_id) {
            PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_INVALID],
                         "%s is on cuda:%d but %s is on cuda:%d; all tensors of a call must be on one device",
                         args[i].name, (int)args[i].view->device_id, args[0].name, (int)args[0].view->device_id);
            return -1;
        }
    return 0;
}

/* The CUDA launchers live in a separate shared library, libhexiseq_cuda.so beside this module, opened the first
 * time a CUDA tensor arrives. A process that never touches CUDA never loads the CUDA runtime: linked into this
 * module, its static teardown at interpreter exit raced with the threads of torch.distributed and now and then
 * aborted the process. The library carries its own copy of the status helpers, so its error text is read
 * through its own hexiseq_last_error. `stream` is a cudaStream_t as an integer. */
#ifdef HEXISEQ_WITH_CUDA
#define DL_HAVE_CUDA 1
typedef hexiseq_status (*cuda_attn_fn)(const hexiseq_attn_params *, void *);
typedef hexiseq_status (*cuda_merge_fn)(const hexiseq_attn_merge_params *, void *);
typedef hexiseq_status (*cuda_info_fn)(int *, int *);
typedef const char *(*cuda_error_fn)(void);

static struct {
    void *handle;
    cuda_attn_fn forward, backward;
    cuda_merge_fn merge;
    cuda_info_fn info;
    cuda_error_fn last_error;
} cuda_lib;

/* Open the library once (called with the GIL held, so no race). 0 on success, else an exception is set. */
static int cuda_load(PyObject *module) {
    if (cuda_lib.handle)
        return 0;
    PyObject *file = PyModule_GetFilenameObject(module);
    if (!file)
        return -1;
    const char *so = PyUnicode_AsUTF8(file);
    if (!so) {
        Py_DECREF(file);
        return -1;
    }
    const char *slash = strrchr(so, '/');
    size_t dir = slash ? (size_t)(slash - so + 1) : 0;
    static const char name[] = "libhexiseq_cuda.so";
    char *path = PyMem_Malloc(dir + sizeof name);
    if (!path) {
        Py_DECREF(file);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(path, so, dir);
    memcpy(path + dir, name, sizeof name);
    Py_DECREF(file);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_UNSUPPORTED], "cannot load the CUDA kernels (%s): %s", path,
                     dlerror());
        PyMem_Free(path);
        return -1;
    }
    PyMem_Free(path);
    cuda_lib.forward = (cuda_attn_fn)dlsym(h, "hexiseq_attn_forward_cuda");
    cuda_lib.backward = (cuda_attn_fn)dlsym(h, "hexiseq_attn_backward_cuda");
    cuda_lib.merge = (cuda_merge_fn)dlsym(h, "hexiseq_attn_merge_cuda");
    cuda_lib.info = (cuda_info_fn)dlsym(h, "hexiseq_cuda_runtime_info");
    cuda_lib.last_error = (cuda_error_fn)dlsym(h, "hexiseq_last_error");
    if (!cuda_lib.forward || !cuda_lib.backward || !cuda_lib.merge || !cuda_lib.info || !cuda_lib.last_error) {
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_INTERNAL], "the CUDA kernels library lacks a launcher: %s",
                     dlerror());
        dlclose(h);
        memset(&cuda_lib, 0, sizeof cuda_lib);
        return -1;
    }
    cuda_lib.handle = h;
    return 0;
}

/* Copy the library's error text into ours so raise_status reports it. */
static hexiseq_status cuda_status(hexiseq_status s) {
    return s == HEXISEQ_OK ? s : hexiseq_fail(s, "%s", cuda_lib.last_error());
}
static hexiseq_status hexiseq_attn_forward_cuda(const hexiseq_attn_params *p, void *stream) {
    return cuda_status(cuda_lib.forward(p, stream));
}
static hexiseq_status hexiseq_attn_backward_cuda(const hexiseq_attn_params *p, void *stream) {
    return cuda_status(cuda_lib.backward(p, stream));
}
static hexiseq_status hexiseq_attn_merge_cuda(const hexiseq_attn_merge_params *m, void *stream) {
    return cuda_status(cuda_lib.merge(m, stream));
}
#else
#define DL_HAVE_CUDA 0
static int cuda_load(PyObject *module) {
    (void)module;
    return 0;
}
static hexiseq_status hexiseq_attn_forward_cuda(const hexiseq_attn_params *p, void *stream) {
    (void)p;
    (void)stream;
    return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED, "this hexiseq was built without CUDA kernels");
}
static hexiseq_status hexiseq_attn_backward_cuda(const hexiseq_attn_params *p, void *stream) {
    return hexiseq_attn_forward_cuda(p, stream);
}
static hexiseq_status hexiseq_attn_merge_cuda(const hexiseq_attn_merge_params *m, void *stream) {
    (void)m;
    (void)stream;
    return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED, "this hexiseq was built without CUDA kernels");
}
#endif

/* cuda_device_count() -> devices the CUDA runtime sees (0 without a driver or GPU); loads the CUDA kernels. */
static PyObject *core_cuda_device_count(PyObject *module, PyObject *Py_UNUSED(ignored)) {
#ifdef HEXISEQ_WITH_CUDA
    if (cuda_load(module) < 0)
        return NULL;
    int runtime = 0, devices = 0;
    hexiseq_status s = cuda_lib.info(&runtime, &devices);
    if (s != HEXISEQ_OK)
        return raise_status(module, cuda_status(s));
    return PyLong_FromLong(devices);
#else
    (void)module;
    return PyLong_FromLong(0);
#endif
}

static int dl_require_cuda_build(PyObject *module) {
    if (DL_HAVE_CUDA)
        return cuda_load(module);
    PyErr_SetString(get_state(module)->errors[HEXISEQ_ERR_UNSUPPORTED],
                    "this hexiseq was built without CUDA kernels (nvcc not found or HEXISEQ_CUDA=0 at build time); "
                    "reinstall with nvcc on PATH or move the tensors to the CPU");
    return -1;
}

#define DL_QKV "[batch, seq, heads, head_dim]"
#define DL_LSE "[batch, heads, seq]"

static int check_positions(PyObject *module, long long q_pos0, long long k_pos0) {
    if (q_pos0 < 0 || k_pos0 < 0) {
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_INVALID], "%s must be >= 0, got %lld", q_pos0 < 0 ? "q_pos0" : "k_pos0",
                     q_pos0 < 0 ? q_pos0 : k_pos0);
        return -1;
    }
    return 0;
}

/* The part forward and backward share once their arguments are parsed: import the tensors a[0 .. n) (their
 * views land in *views), build the params, run the CPU or CUDA kernel with the GIL released, release every
 * import exactly once. Returns None or NULL with an exception set. */
typedef struct {
    int causal, accumulate;
    long long q_pos0, k_pos0;
    double scale;
    unsigned long long stream;
} attn_call;

static PyObject *run_attention(PyObject *module, const dl_arg *a, int n, hexiseq_attn_views *views, int cuda,
                               int backward, const attn_call *c) {
    if (cuda && dl_require_cuda_build(module) < 0)
        return NULL;
    if (check_positions(module, c->q_pos0, c->k_pos0) < 0)
        return NULL;
    enum { MAX_TENSORS = 9 }; /* the backward's q, k, v, out, lse, dout, dq, dk, dv */
    dl_held held[MAX_TENSORS];
    if (n > MAX_TENSORS) {
        PyErr_Format(PyExc_SystemError, "run_attention: %d tensors, at most %d", n, (int)MAX_TENSORS);
        return NULL;
    }
    memset(held, 0, sizeof held);
    PyObject *ret = NULL;
    if (dl_import_all(module, a, n, cuda, held) < 0)
        goto done;
    hexiseq_attn_params p;
    int empty = 0;
    hexiseq_status s = hexiseq_attn_params_from_views(views, backward, &p, &empty);
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    p.causal = c->causal;
    p.q_pos0 = c->q_pos0;
    p.k_pos0 = c->k_pos0;
    p.scale = c->scale;
    p.accumulate = backward ? c->accumulate : 0;
    if (!empty) {
        void *stream = (void *)(uintptr_t)c->stream;
        Py_BEGIN_ALLOW_THREADS
        if (backward)
            s = cuda ? hexiseq_attn_backward_cuda(&p, stream) : hexiseq_attn_backward_cpu(&p);
        else
            s = cuda ? hexiseq_attn_forward_cuda(&p, stream) : hexiseq_attn_forward_cpu(&p);
        Py_END_ALLOW_THREADS
        if (s != HEXISEQ_OK) {
            raise_status(module, s);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    dl_release_all(held, n);
    return ret;
}

/* attention_forward(q, k, v, out, lse, causal, q_pos0, k_pos0, scale) -> None; writes out and lse.
 * attention_forward_cuda(..., scale, stream): the same on CUDA tensors, enqueued on the cudaStream_t `stream`. */
static PyObject *attention_forward_impl(PyObject *module, PyObject *args, int cuda) {
    PyObject *q, *k, *v, *o, *lse;
    attn_call c = {0, 0, 0, 0, 0.0, 0};
    if (cuda ? !PyArg_ParseTuple(args, "OOOOOpLLdK:attention_forward_cuda", &q, &k, &v, &o, &lse, &c.causal,
                                 &c.q_pos0, &c.k_pos0, &c.scale, &c.stream)
             : !PyArg_ParseTuple(args, "OOOOOpLLd:attention_forward", &q, &k, &v, &o, &lse, &c.causal, &c.q_pos0,
                                 &c.k_pos0, &c.scale))
        return NULL;
    hexiseq_attn_views views;
    memset(&views, 0, sizeof views);
    const dl_arg a[] = {
        {q, "q", 4, DL_QKV, 0, &views.q},     {k, "k", 4, DL_QKV, 0, &views.k},
        {v, "v", 4, DL_QKV, 0, &views.v},     {o, "out", 4, DL_QKV, 1, &views.o},
        {lse, "lse", 3, DL_LSE, 1, &views.lse},
    };
    return run_attention(module, a, (int)(sizeof a / sizeof a[0]), &views, cuda, 0, &c);
}

/* attention_backward(q, k, v, out, lse, dout, dq, dk, dv, causal, q_pos0, k_pos0, scale, accumulate) -> None;
 * writes (or adds into) dq, dk, dv. attention_backward_cuda(..., accumulate, stream): the same on CUDA tensors. */
static PyObject *attention_backward_impl(PyObject *module, PyObject *args, int cuda) {
    PyObject *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv;
    attn_call c = {0, 0, 0, 0, 0.0, 0};
    if (cuda ? !PyArg_ParseTuple(args, "OOOOOOOOOpLLdpK:attention_backward_cuda", &q, &k, &v, &o, &lse, &dout, &dq,
                                 &dk, &dv, &c.causal, &c.q_pos0, &c.k_pos0, &c.scale, &c.accumulate, &c.stream)
             : !PyArg_ParseTuple(args, "OOOOOOOOOpLLdp:attention_backward", &q, &k, &v, &o, &lse, &dout, &dq, &dk,
                                 &dv, &c.causal, &c.q_pos0, &c.k_pos0, &c.scale, &c.accumulate))
        return NULL;
    hexiseq_attn_views views;
    memset(&views, 0, sizeof views);
    const dl_arg a[] = {
        {q, "q", 4, DL_QKV, 0, &views.q},         {k, "k", 4, DL_QKV, 0, &views.k},
        {v, "v", 4, DL_QKV, 0, &views.v},         {o, "out", 4, DL_QKV, 0, &views.o},
        {lse, "lse", 3, DL_LSE, 0, &views.lse},   {dout, "dout", 4, DL_QKV, 0, &views.do_},
        {dq, "dq", 4, DL_QKV, 1, &views.dq},      {dk, "dk", 4, DL_QKV, 1, &views.dk},
        {dv, "dv", 4, DL_QKV, 1, &views.dv},
    };
    return run_attention(module, a, (int)(sizeof a / sizeof a[0]), &views, cuda, 1, &c);
}

/* attention_merge(out_acc, lse_acc, out_part, lse_part) -> None; updates out_acc and lse_acc in place.
 * attention_merge_cuda(..., lse_part, stream): the same on CUDA tensors. */
static PyObject *attention_merge_impl(PyObject *module, PyObject *args, int cuda) {
    PyObject *oa, *la, *op, *lp;
    unsigned long long stream = 0;
    if (cuda ? !PyArg_ParseTuple(args, "OOOOK:attention_merge_cuda", &oa, &la, &op, &lp, &stream)
             : !PyArg_ParseTuple(args, "OOOO:attention_merge", &oa, &la, &op, &lp))
        return NULL;
    if (cuda && dl_require_cuda_build(module) < 0)
        return NULL;
    hexiseq_attn_merge_views views;
    memset(&views, 0, sizeof views);
    const dl_arg a[] = {
        {oa, "out_acc", 4, DL_QKV, 1, &views.o_acc},   {la, "lse_acc", 3, DL_LSE, 1, &views.lse_acc},
        {op, "out_part", 4, DL_QKV, 0, &views.o_part}, {lp, "lse_part", 3, DL_LSE, 0, &views.lse_part},
    };
    enum { N = sizeof a / sizeof a[0] };
    dl_held held[N];
    memset(held, 0, sizeof held);
    PyObject *ret = NULL;
    if (dl_import_all(module, a, N, cuda, held) < 0)
        goto done;
    hexiseq_attn_merge_params m;
    int empty = 0;
    hexiseq_status s = hexiseq_attn_merge_params_from_views(&views, &m, &empty);
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    if (!empty) {
        Py_BEGIN_ALLOW_THREADS s = cuda ? hexiseq_attn_merge_cuda(&m, (void *)(uintptr_t)stream)
                                        : hexiseq_attn_merge_cpu(&m);
        Py_END_ALLOW_THREADS
        if (s != HEXISEQ_OK) {
            raise_status(module, s);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    dl_release_all(held, N);
    return ret;
}

static PyObject *core_attention_forward(PyObject *module, PyObject *args) {
    return attention_forward_impl(module, args, 0);
}
static PyObject *core_attention_backward(PyObject *module, PyObject *args) {
    return attention_backward_impl(module, args, 0);
}
static PyObject *core_attention_merge(PyObject *module, PyObject *args) {
    return attention_merge_impl(module, args, 0);
}
static PyObject *core_attention_forward_cuda(PyObject *module, PyObject *args) {
    return attention_forward_impl(module, args, 1);
}
static PyObject *core_attention_backward_cuda(PyObject *module, PyObject *args) {
    return attention_backward_impl(module, args, 1);
}
static PyObject *core_attention_merge_cuda(PyObject *module, PyObject *args) {
    return attention_merge_impl(module, args, 1);
}

#define DLPACK_ATTENTION_METHODS                                                                                  \
    {"attention_forward", core_attention_forward, METH_VARARGS,                                                  \
     "attention_forward(q, k, v, out, lse, causal, q_pos0, k_pos0, scale): CPU forward over DLPack tensors."},   \
        {"attention_backward", core_attention_backward, METH_VARARGS,                                             \
         "attention_backward(q, k, v, out, lse, dout, dq, dk, dv, causal, q_pos0, k_pos0, scale, accumulate): "  \
         "CPU backward over DLPack tensors."},                                                                     \
        {"attention_merge", core_attention_merge, METH_VARARGS,                                                   \
         "attention_merge(out_acc, lse_acc, out_part, lse_part): fold a partial (out, lse) into an accumulator."},  \
        {"attention_forward_cuda", core_attention_forward_cuda, METH_VARARGS,                                     \
         "attention_forward_cuda(q, k, v, out, lse, causal, q_pos0, k_pos0, scale, stream): CUDA forward over "   \
         "DLPack CUDA tensors, enqueued on the cudaStream_t `stream` (an int; 0 = legacy default stream)."},      \
        {"attention_backward_cuda", core_attention_backward_cuda, METH_VARARGS,                                   \
         "attention_backward_cuda(q, k, v, out, lse, dout, dq, dk, dv, causal, q_pos0, k_pos0, scale, "           \
         "accumulate, stream): CUDA backward over DLPack CUDA tensors, enqueued on `stream`."},                    \
        {"attention_merge_cuda", core_attention_merge_cuda, METH_VARARGS,                                         \
         "attention_merge_cuda(out_acc, lse_acc, out_part, lse_part, stream): CUDA merge, enqueued on `stream`."},
/* ================================================================== END attention over DLPack */

/* ------------------------------------------------------------------ module */

static PyMethodDef core_methods[] = {
    {"build_info", core_build_info, METH_NOARGS, "What this extension was built with."},
    {"cuda_device_count", core_cuda_device_count, METH_NOARGS, "CUDA devices visible (loads the CUDA kernels)."},
    {"gpu_catalog", core_gpu_catalog, METH_NOARGS, "The built-in GPU catalog, a list of dicts."},
    {"gpu_find", core_gpu_find, METH_O, "Canonical catalog name of a GPU model name or alias."},
    {"check_cluster", core_check_cluster, METH_VARARGS, "Validate a cluster description; returns its device count."},
    {"int_range", core_int_range, METH_O, "(lo, hi) the core accepts for a named integer input."},
    {"layout_spans", core_layout_spans, METH_O, "(front_start, front_len, back_start, back_len) of each group."},
    {"model_params", core_model_params, METH_O, "Parameter count of a model tuple."},
    {"evaluate", core_evaluate, METH_VARARGS, "Score a layout: (per-device dict, plan dict)."},
    {"plan_strategy", core_plan_strategy, METH_VARARGS, "Best layout of a strategy, as a dict of arrays, and what the search did."},
    DLPACK_ATTENTION_METHODS /* the DLPack attention section above */
    {NULL, NULL, 0, NULL},
};

static int core_exec(PyObject *module) {
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    core_state *st = get_state(module);
    PyObject *errors = PyImport_ImportModule("hexiseq.errors");
    if (!errors)
        return -1;
    static const struct {
        hexiseq_status status;
        const char *name;
    } map[] = {
        {HEXISEQ_ERR_NULL, "InternalError"},      {HEXISEQ_ERR_INVALID, "InvalidArgumentError"},
        {HEXISEQ_ERR_UNKNOWN_GPU, "UnknownGPUError"}, {HEXISEQ_ERR_LAYOUT, "LayoutError"},
        {HEXISEQ_ERR_MEMORY, "MemoryFitError"},   {HEXISEQ_ERR_NOMEM, "InternalError"},
        {HEXISEQ_ERR_UNSUPPORTED, "UnsupportedError"}, {HEXISEQ_ERR_CUDA, "CudaError"},
        {HEXISEQ_ERR_INTERNAL, "InternalError"},
        /* a cancelled plan raises the pending KeyboardInterrupt before it gets here: reaching it is a bug */
        {HEXISEQ_ERR_CANCELLED, "InternalError"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; ++i) {
        st->errors[map[i].status] = PyObject_GetAttrString(errors, map[i].name);
        if (!st->errors[map[i].status]) {
            Py_DECREF(errors);
            return -1;
        }
    }
    st->type_error = PyObject_GetAttrString(errors, "ArgumentTypeError");
    Py_DECREF(errors);
    if (!st->type_error)
        return -1;
    if (PyModule_AddStringConstant(module, "VERSION", HEXISEQ_VERSION) < 0)
        return -1;
    /* The core's enum values by name, so Python never restates them: STRATEGIES by hexiseq_strategy_name,
     * SHARDINGS by the names hexiseq.Sharding uses. */
    PyObject *strategies = PyDict_New(), *shardings = PyDict_New();
    int bad = !strategies || !shardings;
    for (int i = 0; !bad && i < HEXISEQ_STRATEGY_COUNT; ++i) {
        PyObject *v = PyLong_FromLong(i);
        bad = !v || PyDict_SetItemString(strategies, hexiseq_strategy_name((hexiseq_strategy)i), v) < 0;
        Py_XDECREF(v);
    }
    static const struct {
        const char *name;
        int value;
    } shard_names[] = {{"full", HEXISEQ_SHARD_FULL}, {"grad_opt", HEXISEQ_SHARD_GRAD_OPT},
                       {"opt", HEXISEQ_SHARD_OPT}, {"none", HEXISEQ_SHARD_NONE}};
    for (size_t i = 0; !bad && i < sizeof shard_names / sizeof shard_names[0]; ++i) {
        PyObject *v = PyLong_FromLong(shard_names[i].value);
        bad = !v || PyDict_SetItemString(shardings, shard_names[i].name, v) < 0;
        Py_XDECREF(v);
    }
    if (bad) {
        Py_XDECREF(strategies);
        Py_XDECREF(shardings);
        return -1;
    }
    if (PyModule_AddObject(module, "STRATEGIES", strategies) < 0) { /* steals the reference on success */
        Py_DECREF(strategies);
        Py_DECREF(shardings);
        return -1;
    }
    if (PyModule_AddObject(module, "SHARDINGS", shardings) < 0) {
        Py_DECREF(shardings);
        return -1;
    }
    return 0;
}

static int core_traverse(PyObject *module, visitproc visit, void *arg) {
    core_state *st = get_state(module);
    for (int i = 0; i < HEXISEQ_STATUS_COUNT; ++i)
        Py_VISIT(st->errors[i]);
    Py_VISIT(st->type_error);
    return 0;
}

static int core_clear(PyObject *module) {
    core_state *st = get_state(module);
    for (int i = 0; i < HEXISEQ_STATUS_COUNT; ++i)
        Py_CLEAR(st->errors[i]);
    Py_CLEAR(st->type_error);
    return 0;
}

static void core_free(void *module) { core_clear((PyObject *)module); }

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "hexiseq._core", "Binding of the HexiSeq C core.", sizeof(core_state), core_methods,
    core_slots, core_traverse, core_clear, core_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
