/* Attention over DLPack tensors, CPU and CUDA: attention_{forward,backward,merge}[_cuda].
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
 * Shape/dtype/overlap validation lives in csrc/attention/tensor_view.c; this file only moves objects across. The CUDA
 * kernels are reached through their entry table (cuda.c). */
#include "binding.h"

#include <stdint.h>
#include <string.h>

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
    int index;          /* an int64 index tensor of 1 to ndim dimensions (q_doc), not float data */
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
    const int read_only = (flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    hexiseq_status s =
        arg->index ? hexiseq_tensor_view_index_from_dl_on(t, read_only, arg->name, arg->ndim, arg->layout, cuda, arg->view)
                   : hexiseq_tensor_view_from_dl_on(t, read_only, arg->name, arg->ndim, arg->layout, cuda, arg->view);
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

#define DL_QKV "[batch, seq, heads, head_dim]"
#define DL_LSE "[batch, heads, seq]"
#define DL_DOC "[batch, seq_q] (or [seq_q])"

static int check_positions(PyObject *module, long long q_pos0, long long k_pos0) {
    if (q_pos0 < 0 || k_pos0 < 0) {
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_INVALID], "%s must be >= 0, got %lld", q_pos0 < 0 ? "q_pos0" : "k_pos0",
                     q_pos0 < 0 ? q_pos0 : k_pos0);
        return -1;
    }
    return 0;
}

typedef enum { ATTN_FORWARD, ATTN_BACKWARD, ATTN_MERGE } attn_kind;

/* One parsed call: which kernel, on which device, and what the tensors do not carry. */
typedef struct {
    attn_kind kind;
    int cuda;
    int causal, accumulate; /* forward and backward only, like the positions and the scale */
    long long q_pos0, k_pos0;
    double scale;
    long long window_left, window_right; /* -1: no bound on that side */
    double softcap;                      /* 0: none */
    unsigned long long stream; /* a cudaStream_t as an integer (CUDA calls) */
    union {
        hexiseq_attn_views attn;
        hexiseq_attn_merge_views merge;
    } views; /* filled by the import: the dl_arg of each tensor points into it */
} attn_call;

typedef union {
    hexiseq_attn_params attn;
    hexiseq_attn_merge_params merge;
} attn_params;

/* The kernel of a call: on the CPU, or on CUDA through the entry table `cu`. Runs without the GIL. */
static hexiseq_status attn_launch(const attn_call *c, const hexiseq_cuda_entries *cu, const attn_params *p) {
    void *stream = (void *)(uintptr_t)c->stream;
    switch (c->kind) {
    case ATTN_FORWARD: return cu ? cu->attn_forward(&p->attn, stream) : hexiseq_attn_forward_cpu(&p->attn);
    case ATTN_BACKWARD: return cu ? cu->attn_backward(&p->attn, stream) : hexiseq_attn_backward_cpu(&p->attn);
    case ATTN_MERGE: return cu ? cu->attn_merge(&p->merge, stream) : hexiseq_attn_merge_cpu(&p->merge);
    }
    return hexiseq_fail(HEXISEQ_ERR_INTERNAL, "attention call of unknown kind %d", (int)c->kind);
}

/* What every attention call does once its arguments are parsed: load the CUDA kernels (CUDA calls), check the
 * positions (forward and backward), import the tensors a[0 .. n) (their views land in c->views), build the
 * kernel's params, run it with the GIL released, release every import exactly once. Returns None or NULL with an
 * exception set. */
static PyObject *run_attention(PyObject *module, const dl_arg *a, int n, attn_call *c) {
    const hexiseq_cuda_entries *cu = NULL;
    if (c->cuda && !(cu = core_cuda_entries(module)))
        return NULL;
    if (c->kind != ATTN_MERGE && check_positions(module, c->q_pos0, c->k_pos0) < 0)
        return NULL;
    enum { MAX_TENSORS = 10 }; /* the backward's q, k, v, out, lse, dout, dq, dk, dv, q_doc */
    dl_held held[MAX_TENSORS];
    if (n > MAX_TENSORS) {
        PyErr_Format(PyExc_SystemError, "run_attention: %d tensors, at most %d", n, (int)MAX_TENSORS);
        return NULL;
    }
    memset(held, 0, sizeof held);
    PyObject *ret = NULL;
    if (dl_import_all(module, a, n, c->cuda, held) < 0)
        goto done;
    attn_params p;
    memset(&p, 0, sizeof p);
    int empty = 0;
    hexiseq_status s;
    if (c->kind == ATTN_MERGE) {
        s = hexiseq_attn_merge_params_from_views(&c->views.merge, &p.merge, &empty);
    } else {
        s = hexiseq_attn_params_from_views(&c->views.attn, c->kind == ATTN_BACKWARD, &p.attn, &empty);
        p.attn.causal = c->causal;
        p.attn.q_pos0 = c->q_pos0;
        p.attn.k_pos0 = c->k_pos0;
        p.attn.scale = c->scale;
        p.attn.accumulate = c->kind == ATTN_BACKWARD ? c->accumulate : 0;
        p.attn.window = c->window_left != -1 || c->window_right != -1; /* a bad bound reaches the check as it is */
        p.attn.window_left = c->window_left;
        p.attn.window_right = c->window_right;
        p.attn.softcap = c->softcap;
    }
    if (s != HEXISEQ_OK) {
        raise_status(module, s);
        goto done;
    }
    if (!empty) {
        Py_BEGIN_ALLOW_THREADS
        s = attn_launch(c, cu, &p);
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

/* attention_forward(q, k, v, out, lse, causal, q_pos0, k_pos0, scale[, q_doc[, window_left, window_right, softcap]])
 * -> None; writes out and lse. q_doc: the document mask's int64 starts (csrc/attention/attention.h), [batch, seq_q] or
 * [seq_q]; None or absent: none. window_left, window_right: the sliding window's bounds, -1 (the default) for none;
 * softcap: logit soft-capping, 0 (the default) for none.
 * attention_forward_cuda(..., scale, stream): the same on CUDA tensors, enqueued on the cudaStream_t `stream`. */
static PyObject *attention_forward_impl(PyObject *module, PyObject *args, int cuda) {
    PyObject *q, *k, *v, *o, *lse, *doc = Py_None;
    attn_call c;
    memset(&c, 0, sizeof c);
    c.kind = ATTN_FORWARD;
    c.cuda = cuda;
    c.window_left = c.window_right = -1;
    if (cuda ? !PyArg_ParseTuple(args, "OOOOOpLLdK|OLLd:attention_forward_cuda", &q, &k, &v, &o, &lse, &c.causal,
                                 &c.q_pos0, &c.k_pos0, &c.scale, &c.stream, &doc, &c.window_left, &c.window_right,
                                 &c.softcap)
             : !PyArg_ParseTuple(args, "OOOOOpLLd|OLLd:attention_forward", &q, &k, &v, &o, &lse, &c.causal, &c.q_pos0,
                                 &c.k_pos0, &c.scale, &doc, &c.window_left, &c.window_right, &c.softcap))
        return NULL;
    hexiseq_attn_views *views = &c.views.attn;
    const dl_arg a[] = {
        {q, "q", 4, DL_QKV, 0, &views->q, 0},     {k, "k", 4, DL_QKV, 0, &views->k, 0},
        {v, "v", 4, DL_QKV, 0, &views->v, 0},     {o, "out", 4, DL_QKV, 1, &views->o, 0},
        {lse, "lse", 3, DL_LSE, 1, &views->lse, 0}, {doc, "q_doc", 2, DL_DOC, 0, &views->q_doc, 1},
    };
    /* q_doc is optional and last: None leaves it out (its view stays ndim 0: no document mask) */
    return run_attention(module, a, (int)(sizeof a / sizeof a[0]) - (doc == Py_None), &c);
}

/* attention_backward(q, k, v, out, lse, dout, dq, dk, dv, causal, q_pos0, k_pos0, scale, accumulate[, q_doc[,
 * window_left, window_right, softcap]]) -> None;
 * writes (or adds into) dq, dk, dv. attention_backward_cuda(..., accumulate, stream): the same on CUDA tensors. */
static PyObject *attention_backward_impl(PyObject *module, PyObject *args, int cuda) {
    PyObject *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv, *doc = Py_None;
    attn_call c;
    memset(&c, 0, sizeof c);
    c.kind = ATTN_BACKWARD;
    c.cuda = cuda;
    c.window_left = c.window_right = -1;
    if (cuda ? !PyArg_ParseTuple(args, "OOOOOOOOOpLLdpK|OLLd:attention_backward_cuda", &q, &k, &v, &o, &lse, &dout,
                                 &dq, &dk, &dv, &c.causal, &c.q_pos0, &c.k_pos0, &c.scale, &c.accumulate, &c.stream,
                                 &doc, &c.window_left, &c.window_right, &c.softcap)
             : !PyArg_ParseTuple(args, "OOOOOOOOOpLLdp|OLLd:attention_backward", &q, &k, &v, &o, &lse, &dout, &dq,
                                 &dk, &dv, &c.causal, &c.q_pos0, &c.k_pos0, &c.scale, &c.accumulate, &doc,
                                 &c.window_left, &c.window_right, &c.softcap))
        return NULL;
    hexiseq_attn_views *views = &c.views.attn;
    const dl_arg a[] = {
        {q, "q", 4, DL_QKV, 0, &views->q, 0},         {k, "k", 4, DL_QKV, 0, &views->k, 0},
        {v, "v", 4, DL_QKV, 0, &views->v, 0},         {o, "out", 4, DL_QKV, 0, &views->o, 0},
        {lse, "lse", 3, DL_LSE, 0, &views->lse, 0},   {dout, "dout", 4, DL_QKV, 0, &views->do_, 0},
        {dq, "dq", 4, DL_QKV, 1, &views->dq, 0},      {dk, "dk", 4, DL_QKV, 1, &views->dk, 0},
        {dv, "dv", 4, DL_QKV, 1, &views->dv, 0},      {doc, "q_doc", 2, DL_DOC, 0, &views->q_doc, 1},
    };
    return run_attention(module, a, (int)(sizeof a / sizeof a[0]) - (doc == Py_None), &c);
}

/* attention_merge(out_acc, lse_acc, out_part, lse_part) -> None; updates out_acc and lse_acc in place.
 * attention_merge_cuda(..., lse_part, stream): the same on CUDA tensors. */
static PyObject *attention_merge_impl(PyObject *module, PyObject *args, int cuda) {
    PyObject *oa, *la, *op, *lp;
    attn_call c;
    memset(&c, 0, sizeof c);
    c.kind = ATTN_MERGE;
    c.cuda = cuda;
    if (cuda ? !PyArg_ParseTuple(args, "OOOOK:attention_merge_cuda", &oa, &la, &op, &lp, &c.stream)
             : !PyArg_ParseTuple(args, "OOOO:attention_merge", &oa, &la, &op, &lp))
        return NULL;
    hexiseq_attn_merge_views *views = &c.views.merge;
    const dl_arg a[] = {
        {oa, "out_acc", 4, DL_QKV, 1, &views->o_acc},   {la, "lse_acc", 3, DL_LSE, 1, &views->lse_acc},
        {op, "out_part", 4, DL_QKV, 0, &views->o_part}, {lp, "lse_part", 3, DL_LSE, 0, &views->lse_part},
    };
    return run_attention(module, a, (int)(sizeof a / sizeof a[0]), &c);
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

PyMethodDef core_attention_methods[] = {
    {"attention_forward", core_attention_forward, METH_VARARGS,
     "attention_forward(q, k, v, out, lse, causal, q_pos0, k_pos0, scale[, q_doc]): CPU forward over DLPack tensors."},
    {"attention_backward", core_attention_backward, METH_VARARGS,
     "attention_backward(q, k, v, out, lse, dout, dq, dk, dv, causal, q_pos0, k_pos0, scale, accumulate[, q_doc]): "
     "CPU backward over DLPack tensors."},
    {"attention_merge", core_attention_merge, METH_VARARGS,
     "attention_merge(out_acc, lse_acc, out_part, lse_part): fold a partial (out, lse) into an accumulator."},
    {"attention_forward_cuda", core_attention_forward_cuda, METH_VARARGS,
     "attention_forward_cuda(q, k, v, out, lse, causal, q_pos0, k_pos0, scale, stream[, q_doc]): CUDA forward over "
     "DLPack CUDA tensors, enqueued on the cudaStream_t `stream` (an int; 0 = legacy default stream)."},
    {"attention_backward_cuda", core_attention_backward_cuda, METH_VARARGS,
     "attention_backward_cuda(q, k, v, out, lse, dout, dq, dk, dv, causal, q_pos0, k_pos0, scale, "
     "accumulate, stream[, q_doc]): CUDA backward over DLPack CUDA tensors, enqueued on `stream`."},
    {"attention_merge_cuda", core_attention_merge_cuda, METH_VARARGS,
     "attention_merge_cuda(out_acc, lse_acc, out_part, lse_part, stream): CUDA merge, enqueued on `stream`."},
    {NULL, NULL, 0, NULL},
};
