/* DLPack tensors to validated strided views, and views to the attention kernels' params structs. */
#include "tensor_view.h"

#include <stdio.h>
#include <string.h>

/* Strides and offsets are kept within +-2^60 elements so that every byte offset (x 8) fits int64. */
#define TV_MAX_ELEMS (INT64_C(1) << 60)

static const char *device_name(int32_t type) {
    switch (type) {
    case kDLCPU: return "kDLCPU";
    case kDLCUDA: return "kDLCUDA";
    case kDLCUDAHost: return "kDLCUDAHost";
    case kDLOpenCL: return "kDLOpenCL";
    case kDLVulkan: return "kDLVulkan";
    case kDLMetal: return "kDLMetal";
    case kDLVPI: return "kDLVPI";
    case kDLROCM: return "kDLROCM";
    case kDLROCMHost: return "kDLROCMHost";
    case kDLExtDev: return "kDLExtDev";
    case kDLCUDAManaged: return "kDLCUDAManaged";
    case kDLOneAPI: return "kDLOneAPI";
    case kDLWebGPU: return "kDLWebGPU";
    case kDLHexagon: return "kDLHexagon";
    case kDLMAIA: return "kDLMAIA";
    }
    return "unknown device type";
}

/* "float32", "bfloat16", "int64", "float16x4", ... into buf. */
static const char *dtype_name(DLDataType t, char *buf, size_t size) {
    const char *base;
    switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLOpaqueHandle: base = "handle"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLComplex: base = "complex"; break;
    case kDLBool: base = "bool"; break;
    default: base = "code"; break;
    }
    if (t.lanes == 1)
        snprintf(buf, size, "%s%u", base, (unsigned)t.bits);
    else
        snprintf(buf, size, "%s%ux%u", base, (unsigned)t.bits, (unsigned)t.lanes);
    return buf;
}

static const char *hx_dtype_name(int32_t dtype) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: return "float64";
    case HEXISEQ_DTYPE_F32: return "float32";
    case HEXISEQ_DTYPE_F16: return "float16";
    case HEXISEQ_DTYPE_BF16: return "bfloat16";
    case HEXISEQ_VIEW_INT64: return "int64";
    }
    return "?";
}

/* "[2, 97, 8, 64]" into buf. */
static const char *shape_text(const hexiseq_tensor_view *v, char *buf, size_t size) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, size - n, "[");
    for (int32_t i = 0; i < v->ndim && n < size; ++i)
        n += (size_t)snprintf(buf + n, size - n, i ? ", %lld" : "%lld", (long long)v->shape[i]);
    if (n < size)
        snprintf(buf + n, size - n, "]");
    return buf;
}

/* The float views (index == 0: exactly ndim dimensions, a hexiseq_dtype) and the int64 index views (index != 0:
 * 1..ndim dimensions, HEXISEQ_VIEW_INT64), one set of device, shape, stride and alignment rules. */
static hexiseq_status view_from_dl(const DLTensor *t, int read_only, const char *name, int32_t ndim, const char *layout,
                                   int cuda, int index, hexiseq_tensor_view *out);

hexiseq_status hexiseq_tensor_view_from_dl(const DLTensor *t, int read_only, const char *name, int32_t ndim,
                                           const char *layout, hexiseq_tensor_view *out) {
    return view_from_dl(t, read_only, name, ndim, layout, 0, 0, out);
}

hexiseq_status hexiseq_tensor_view_from_dl_on(const DLTensor *t, int read_only, const char *name, int32_t ndim,
                                              const char *layout, int cuda, hexiseq_tensor_view *out) {
    return view_from_dl(t, read_only, name, ndim, layout, cuda, 0, out);
}

hexiseq_status hexiseq_tensor_view_index_from_dl_on(const DLTensor *t, int read_only, const char *name,
                                                    int32_t max_ndim, const char *layout, int cuda,
                                                    hexiseq_tensor_view *out) {
    return view_from_dl(t, read_only, name, max_ndim, layout, cuda, 1, out);
}

static hexiseq_status view_from_dl(const DLTensor *t, int read_only, const char *name, int32_t ndim, const char *layout,
                                   int cuda, int index, hexiseq_tensor_view *out) {
    if (name == NULL)
        name = "tensor";
    if (layout == NULL)
        layout = "";
    if (t == NULL || out == NULL)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "%s: the DLTensor and the view must not be NULL", name);
    if (ndim < 1 || ndim > HEXISEQ_VIEW_MAX_DIM)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s: views have 1..%d dimensions, asked for %d", name,
                            HEXISEQ_VIEW_MAX_DIM, (int)ndim);
    memset(out, 0, sizeof *out);
    out->name = name;
    for (int i = 0; i < HEXISEQ_VIEW_MAX_DIM; ++i)
        out->shape[i] = 1;

    const int32_t dev = (int32_t)t->device.device_type;
    if (!cuda && dev != kDLCPU && dev != kDLCUDAHost)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "%s is on device %s:%d; the CPU kernels take CPU-readable memory (kDLCPU or kDLCUDAHost), "
                            "and CUDA tensors are served only through the CUDA path (torch CUDA tensors in hexiseq.ops)",
                            name, device_name(dev), (int)t->device.device_id);
    if (cuda && dev != kDLCUDA)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "%s is on device %s:%d; the CUDA kernels take CUDA device memory (kDLCUDA)", name,
                            device_name(dev), (int)t->device.device_id);
    out->device_type = dev;
    out->device_id = (int32_t)t->device.device_id;

    char dbuf[32];
    int32_t dtype, eb;
    if (index) {
        if (t->dtype.lanes != 1 || t->dtype.code != kDLInt || t->dtype.bits != 64)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must have dtype int64, got %s", name,
                                dtype_name(t->dtype, dbuf, sizeof dbuf));
        dtype = HEXISEQ_VIEW_INT64;
        eb = 8;
    } else if (t->dtype.lanes == 1 && t->dtype.code == kDLFloat && t->dtype.bits == 64) {
        dtype = HEXISEQ_DTYPE_F64;
        eb = 8;
    } else if (t->dtype.lanes == 1 && t->dtype.code == kDLFloat && t->dtype.bits == 32) {
        dtype = HEXISEQ_DTYPE_F32;
        eb = 4;
    } else if (t->dtype.lanes == 1 && t->dtype.code == kDLFloat && t->dtype.bits == 16) {
        dtype = HEXISEQ_DTYPE_F16;
        eb = 2;
    } else if (t->dtype.lanes == 1 && t->dtype.code == kDLBfloat && t->dtype.bits == 16) {
        dtype = HEXISEQ_DTYPE_BF16;
        eb = 2;
    } else {
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "%s must have dtype float64, float32, float16 or bfloat16, got %s", name,
                            dtype_name(t->dtype, dbuf, sizeof dbuf));
    }

    if (index && (t->ndim < 1 || t->ndim > ndim))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must be 1-D to %d-D %s, got %d-D", name, (int)ndim, layout,
                            (int)t->ndim);
    if (index)
        ndim = t->ndim;
    if (t->ndim != ndim)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must be %d-D %s, got %d-D", name, (int)ndim, layout,
                            (int)t->ndim);
    if (t->shape == NULL)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s: DLTensor.shape is NULL for a %d-D tensor", name, (int)ndim);

    int64_t numel = 1;
    for (int32_t i = 0; i < ndim; ++i) {
        if (t->shape[i] < 0 || t->shape[i] > TV_MAX_ELEMS)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s.shape[%d] must be in [0, 2^60], got %lld", name, (int)i,
                                (long long)t->shape[i]);
        out->shape[i] = t->shape[i];
        if (numel != 0 && t->shape[i] != 0 && numel > TV_MAX_ELEMS / t->shape[i])
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s has more than 2^60 elements", name);
        numel *= t->shape[i];
    }

    if (t->strides == NULL) { /* compact row-major */
        int64_t s = 1;
        for (int32_t i = ndim - 1; i >= 0; --i) {
            out->stride[i] = s;
            s *= t->shape[i] > 0 ? t->shape[i] : 1;
        }
    } else {
        for (int32_t i = 0; i < ndim; ++i) {
            if (t->strides[i] < -TV_MAX_ELEMS || t->strides[i] > TV_MAX_ELEMS)
                return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s.strides[%d] must be within +-2^60 elements, got %lld",
                                    name, (int)i, (long long)t->strides[i]);
            out->stride[i] = t->strides[i];
        }
    }

    /* Extent of the addressed elements, in elements relative to element 0. */
    int64_t lo = 0, hi = 0;
    if (numel > 0) {
        for (int32_t i = 0; i < ndim; ++i) {
            const int64_t n = out->shape[i] - 1;
            const int64_t s = out->stride[i] < 0 ? -out->stride[i] : out->stride[i];
            if (n > 0 && s > (TV_MAX_ELEMS - (hi - lo)) / n)
                return hexiseq_fail(HEXISEQ_ERR_INVALID,
                                    "%s.strides[%d] = %lld with shape[%d] = %lld spans more than 2^60 elements", name,
                                    (int)i, (long long)out->stride[i], (int)i, (long long)out->shape[i]);
            if (out->stride[i] < 0)
                lo -= s * n;
            else
                hi += s * n;
        }
        out->lo_bytes = lo * eb;
        out->hi_bytes = (hi + 1) * eb;
    }

    if (t->byte_offset > (uint64_t)TV_MAX_ELEMS)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s.byte_offset must be < 2^60, got %llu", name,
                            (unsigned long long)t->byte_offset);
    if (t->data == NULL && numel > 0)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "%s has %lld elements but a NULL data pointer", name, (long long)numel);
    char *data = t->data ? (char *)t->data + t->byte_offset : NULL;
    if (numel > 0 && (uintptr_t)data % (uintptr_t)eb != 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s data address %p is not aligned to its %d-byte %s elements", name,
                            (void *)data, (int)eb, hx_dtype_name(dtype));

    out->data = data;
    out->numel = numel;
    out->ndim = ndim;
    out->dtype = dtype;
    out->elem_bytes = eb;
    out->writable = read_only ? 0 : 1;
    return HEXISEQ_OK;
}

int hexiseq_tensor_view_ranges_overlap(const hexiseq_tensor_view *a, const hexiseq_tensor_view *b) {
    if (a->numel == 0 || b->numel == 0)
        return 0;
    const uintptr_t a_lo = (uintptr_t)(a->data + a->lo_bytes), a_hi = (uintptr_t)(a->data + a->hi_bytes);
    const uintptr_t b_lo = (uintptr_t)(b->data + b->lo_bytes), b_hi = (uintptr_t)(b->data + b->hi_bytes);
    return a_lo < b_hi && b_lo < a_hi;
}

int hexiseq_tensor_view_self_overlaps(const hexiseq_tensor_view *v) {
    if (v->numel <= 1)
        return 0;
    int64_t s[HEXISEQ_VIEW_MAX_DIM], n[HEXISEQ_VIEW_MAX_DIM];
    int m = 0;
    for (int32_t i = 0; i < v->ndim; ++i) {
        if (v->shape[i] == 1)
            continue; /* a size-1 dimension never steps */
        s[m] = v->stride[i] < 0 ? -v->stride[i] : v->stride[i];
        n[m] = v->shape[i];
        ++m;
    }
    for (int i = 1; i < m; ++i) /* insertion sort by |stride| */
        for (int j = i; j > 0 && s[j - 1] > s[j]; --j) {
            int64_t t = s[j];
            s[j] = s[j - 1];
            s[j - 1] = t;
            t = n[j];
            n[j] = n[j - 1];
            n[j - 1] = t;
        }
    int64_t reach = 0; /* farthest offset reachable with the smaller dimensions */
    for (int i = 0; i < m; ++i) {
        if (s[i] <= reach)
            return 1;
        reach += s[i] * (n[i] - 1); /* bounded by the 2^60 extent check of the view */
    }
    return 0;
}

/* --------------------------------------------------------------------------------------------- */
/* Attention binding */

static hexiseq_status expect_shape(const hexiseq_tensor_view *v, const int64_t *want, const char *layout,
                                   const char *like) {
    for (int32_t i = 0; i < v->ndim; ++i)
        if (v->shape[i] != want[i]) {
            char got[128], exp[128];
            hexiseq_tensor_view w = *v;
            memcpy(w.shape, want, (size_t)v->ndim * sizeof *want);
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must have shape %s = %s (%s), got %s", v->name, layout,
                                shape_text(&w, exp, sizeof exp), like, shape_text(v, got, sizeof got));
        }
    return HEXISEQ_OK;
}

static hexiseq_status expect_dtype(const hexiseq_tensor_view *v, int32_t dtype, const char *why) {
    if (v->dtype != dtype)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must have dtype %s (%s), got %s", v->name, hx_dtype_name(dtype),
                            why, hx_dtype_name(v->dtype));
    return HEXISEQ_OK;
}

/* An output: writable, no element twice, disjoint from every view in others[0..n). */
static hexiseq_status expect_output(const hexiseq_tensor_view *o, const hexiseq_tensor_view *const *others, int n) {
    if (!o->writable)
        return hexiseq_fail(HEXISEQ_ERR_INVALID,
                            "%s is read-only (its producer exported it with the DLPack read-only flag); the result "
                            "is written into it in place, so it must be writable",
                            o->name);
    if (hexiseq_tensor_view_self_overlaps(o))
        return hexiseq_fail(HEXISEQ_ERR_INVALID,
                            "%s addresses some elements more than once (a broadcast or expanded view?); an output "
                            "needs one memory location per element",
                            o->name);
    for (int i = 0; i < n; ++i)
        if (hexiseq_tensor_view_ranges_overlap(o, others[i]))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s overlaps the memory of %s; outputs must not share memory "
                                "with inputs or other outputs", o->name, others[i]->name);
    return HEXISEQ_OK;
}

static hexiseq_status expect_int32(const char *what, int64_t value) {
    if (value > INT32_MAX)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must be < 2^31, got %lld", what, (long long)value);
    return HEXISEQ_OK;
}

static void copy_stride(int64_t *dst, const hexiseq_tensor_view *v) {
    memcpy(dst, v->stride, (size_t)v->ndim * sizeof *dst);
}

#define QKV_LAYOUT "[batch, seq, heads, head_dim]"
#define Q_LAYOUT "[batch, seq_q, heads, head_dim]"
#define K_LAYOUT "[batch, seq_k, kv_heads, head_dim]"
#define LSE_LAYOUT "[batch, heads, seq_q]"

hexiseq_status hexiseq_attn_params_from_views(const hexiseq_attn_views *v, int backward, hexiseq_attn_params *p,
                                              int *empty) {
    if (v == NULL || p == NULL || empty == NULL)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "views, params and empty must not be NULL");
    const hexiseq_tensor_view *q = &v->q, *k = &v->k;
    if (q->ndim != 4 || k->ndim != 4 || v->v.ndim != 4 || v->o.ndim != 4 || v->lse.ndim != 3 ||
        (backward && (v->do_.ndim != 4 || v->dq.ndim != 4 || v->dk.ndim != 4 || v->dv.ndim != 4)))
        return hexiseq_fail(HEXISEQ_ERR_INTERNAL, "attention views were not built with 4-D (3-D lse) layouts");

    const int64_t B = q->shape[0], Sq = q->shape[1], H = q->shape[2], D = q->shape[3];
    const int64_t Sk = k->shape[1], Hkv = k->shape[2];
    char got[128];
    if (k->shape[0] != B || k->shape[3] != D)
        return hexiseq_fail(HEXISEQ_ERR_INVALID,
                            "k must have shape " K_LAYOUT " with batch = %lld and head_dim = %lld as in q, got %s",
                            (long long)B, (long long)D, shape_text(k, got, sizeof got));
    HEXISEQ_CHECK(expect_shape(&v->v, k->shape, K_LAYOUT, "same as k"));
    const int64_t qshape[4] = {B, Sq, H, D};
    const int64_t lshape[3] = {B, H, Sq};
    HEXISEQ_CHECK(expect_shape(&v->o, qshape, Q_LAYOUT, "same as q"));
    HEXISEQ_CHECK(expect_shape(&v->lse, lshape, LSE_LAYOUT, "from q"));
    if (backward) {
        HEXISEQ_CHECK(expect_shape(&v->do_, qshape, Q_LAYOUT, "same as q"));
        HEXISEQ_CHECK(expect_shape(&v->dq, qshape, Q_LAYOUT, "same as q"));
        HEXISEQ_CHECK(expect_shape(&v->dk, k->shape, K_LAYOUT, "same as k"));
        HEXISEQ_CHECK(expect_shape(&v->dv, k->shape, K_LAYOUT, "same as k"));
    }
    if (H > 0 && (Hkv == 0 || H % Hkv != 0))
        return hexiseq_fail(HEXISEQ_ERR_INVALID,
                            "q heads (q.shape[2] = %lld) must be a multiple of the kv heads of k and v "
                            "(k.shape[2] = %lld)",
                            (long long)H, (long long)Hkv);
    if (D < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "head_dim (q.shape[3]) must be >= 1, got %lld", (long long)D);
    if (D > HEXISEQ_ATTN_MAX_HEAD_DIM)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED, "head_dim (q.shape[3]) must be at most %d, got %lld",
                            HEXISEQ_ATTN_MAX_HEAD_DIM, (long long)D);
    HEXISEQ_CHECK(expect_int32("heads (q.shape[2])", H));

    const int32_t dtype = q->dtype;
    HEXISEQ_CHECK(expect_dtype(k, dtype, "same as q"));
    HEXISEQ_CHECK(expect_dtype(&v->v, dtype, "same as q"));
    HEXISEQ_CHECK(expect_dtype(&v->o, dtype, "same as q"));
    HEXISEQ_CHECK(expect_dtype(&v->lse, dtype == HEXISEQ_DTYPE_F64 ? HEXISEQ_DTYPE_F64 : HEXISEQ_DTYPE_F32,
                               dtype == HEXISEQ_DTYPE_F64 ? "for float64 q" : "for non-float64 q"));
    if (backward) {
        HEXISEQ_CHECK(expect_dtype(&v->do_, dtype, "same as q"));
        HEXISEQ_CHECK(expect_dtype(&v->dq, dtype, "same as q"));
        HEXISEQ_CHECK(expect_dtype(&v->dk, dtype, "same as q"));
        HEXISEQ_CHECK(expect_dtype(&v->dv, dtype, "same as q"));
    }

    if (!backward) {
        const hexiseq_tensor_view *o_others[] = {q, k, &v->v, &v->lse};
        const hexiseq_tensor_view *l_others[] = {q, k, &v->v};
        HEXISEQ_CHECK(expect_output(&v->o, o_others, 4));
        HEXISEQ_CHECK(expect_output(&v->lse, l_others, 3));
    } else {
        const hexiseq_tensor_view *dq_others[] = {q, k, &v->v, &v->o, &v->lse, &v->do_, &v->dk, &v->dv};
        const hexiseq_tensor_view *dk_others[] = {q, k, &v->v, &v->o, &v->lse, &v->do_, &v->dq, &v->dv};
        const hexiseq_tensor_view *dv_others[] = {q, k, &v->v, &v->o, &v->lse, &v->do_, &v->dq, &v->dk};
        HEXISEQ_CHECK(expect_output(&v->dq, dq_others, 8));
        HEXISEQ_CHECK(expect_output(&v->dk, dk_others, 8));
        HEXISEQ_CHECK(expect_output(&v->dv, dv_others, 8));
    }
    /* q_doc is an input: no output may overlap it */
    const hexiseq_tensor_view *outs[] = {&v->o, &v->lse, &v->dq, &v->dk, &v->dv};
    for (int i = 0; i < (backward ? 5 : 2); ++i)
        if (v->q_doc.ndim != 0 && hexiseq_tensor_view_ranges_overlap(outs[i], &v->q_doc))
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s overlaps the memory of q_doc; outputs must not share memory "
                                "with inputs or other outputs", outs[i]->name);

    memset(p, 0, sizeof *p);
    p->q = q->data;
    p->k = k->data;
    p->v = v->v.data;
    p->o = v->o.data;
    p->lse = v->lse.data;
    copy_stride(p->q_stride, q);
    copy_stride(p->k_stride, k);
    copy_stride(p->v_stride, &v->v);
    copy_stride(p->o_stride, &v->o);
    copy_stride(p->lse_stride, &v->lse);
    if (backward) {
        p->do_ = v->do_.data;
        p->dq = v->dq.data;
        p->dk = v->dk.data;
        p->dv = v->dv.data;
        copy_stride(p->do_stride, &v->do_);
        copy_stride(p->dq_stride, &v->dq);
        copy_stride(p->dk_stride, &v->dk);
        copy_stride(p->dv_stride, &v->dv);
    }
    p->batch = B;
    p->seq_q = Sq;
    p->seq_k = Sk;
    p->heads = (int32_t)H;
    p->kv_heads = (int32_t)Hkv;
    p->head_dim = (int32_t)D;
    p->dtype = dtype;
    if (v->q_doc.ndim != 0) {
        const hexiseq_tensor_view *d = &v->q_doc;
        if (d->dtype != HEXISEQ_VIEW_INT64)
            return hexiseq_fail(HEXISEQ_ERR_INTERNAL, "q_doc was not built as an int64 index view");
        if (d->ndim == 2 ? d->shape[0] != B || d->shape[1] != Sq : d->shape[0] != Sq)
            return hexiseq_fail(HEXISEQ_ERR_INVALID,
                                "q_doc must have shape [batch, seq_q] = [%lld, %lld] or [seq_q] = [%lld] (one "
                                "layout for every batch row), got %s",
                                (long long)B, (long long)Sq, (long long)Sq, shape_text(d, got, sizeof got));
        p->q_doc = (const int64_t *)(const void *)d->data;
        /* [seq_q] repeats over the batch: stride 0 */
        p->q_doc_stride[0] = d->ndim == 2 ? d->stride[0] : 0;
        p->q_doc_stride[1] = d->stride[d->ndim - 1];
    }
    *empty = (B == 0 || Sq == 0 || Sk == 0 || H == 0);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_attn_merge_params_from_views(const hexiseq_attn_merge_views *v, hexiseq_attn_merge_params *m,
                                                    int *empty) {
    if (v == NULL || m == NULL || empty == NULL)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "views, params and empty must not be NULL");
    const hexiseq_tensor_view *oa = &v->o_acc, *la = &v->lse_acc, *op = &v->o_part, *lp = &v->lse_part;
    if (oa->ndim != 4 || op->ndim != 4 || la->ndim != 3 || lp->ndim != 3)
        return hexiseq_fail(HEXISEQ_ERR_INTERNAL, "merge views were not built with 4-D (3-D lse) layouts");
    const int64_t B = oa->shape[0], S = oa->shape[1], H = oa->shape[2], D = oa->shape[3];
    const int64_t lshape[3] = {B, H, S};
    HEXISEQ_CHECK(expect_shape(op, oa->shape, QKV_LAYOUT, "same as out_acc"));
    HEXISEQ_CHECK(expect_shape(la, lshape, "[batch, heads, seq]", "from out_acc"));
    HEXISEQ_CHECK(expect_shape(lp, lshape, "[batch, heads, seq]", "from out_acc"));
    if (D < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "head_dim (%s.shape[3]) must be >= 1, got %lld", oa->name,
                            (long long)D);
    if (D > HEXISEQ_ATTN_MAX_HEAD_DIM)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED, "head_dim (%s.shape[3]) must be at most %d, got %lld", oa->name,
                            HEXISEQ_ATTN_MAX_HEAD_DIM, (long long)D);
    HEXISEQ_CHECK(expect_int32("heads", H));
    HEXISEQ_CHECK(expect_dtype(la, oa->dtype == HEXISEQ_DTYPE_F64 ? HEXISEQ_DTYPE_F64 : HEXISEQ_DTYPE_F32,
                               oa->dtype == HEXISEQ_DTYPE_F64 ? "for float64 out_acc" : "for non-float64 out_acc"));
    HEXISEQ_CHECK(expect_dtype(lp, op->dtype == HEXISEQ_DTYPE_F64 ? HEXISEQ_DTYPE_F64 : HEXISEQ_DTYPE_F32,
                               op->dtype == HEXISEQ_DTYPE_F64 ? "for float64 out_part" : "for non-float64 out_part"));
    const hexiseq_tensor_view *oa_others[] = {op, lp, la};
    const hexiseq_tensor_view *la_others[] = {op, lp};
    HEXISEQ_CHECK(expect_output(oa, oa_others, 3));
    HEXISEQ_CHECK(expect_output(la, la_others, 2));

    memset(m, 0, sizeof *m);
    m->o_acc = oa->data;
    m->lse_acc = la->data;
    m->o_part = op->data;
    m->lse_part = lp->data;
    copy_stride(m->o_acc_stride, oa);
    copy_stride(m->o_part_stride, op);
    copy_stride(m->lse_acc_stride, la);
    copy_stride(m->lse_part_stride, lp);
    m->batch = B;
    m->seq = S;
    m->heads = (int32_t)H;
    m->head_dim = (int32_t)D;
    m->acc_dtype = oa->dtype;
    m->part_dtype = op->dtype;
    *empty = (B == 0 || S == 0 || H == 0);
    return HEXISEQ_OK;
}
