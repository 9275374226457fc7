/* Validation of the attention params structs: one set of rules and messages for the CPU and the CUDA kernels.
 * Compiled into the extension only; the CUDA kernels library reaches this copy through the host table it is handed
 * when loaded (hexiseq_cuda_host, kernels/launch.h). */
#include <math.h>
#include <stdint.h>

#include "attention.h"

/* Largest element offset we allow, so that byte offsets (x8) also fit in int64. */
#define HX_MAX_OFFSET (INT64_MAX / 8)
/* Positions up to 2^62 keep every position difference inside int64. */
#define HX_MAX_POS ((int64_t)1 << 62)

static hexiseq_status check_dtype(const char *field, int32_t dtype) {
    if (dtype < HEXISEQ_DTYPE_F64 || dtype > HEXISEQ_DTYPE_BF16)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must be a hexiseq_dtype (0..3), got %lld", field,
                            (long long)dtype);
    return HEXISEQ_OK;
}

static hexiseq_status check_head_dim(const char *field, int32_t head_dim) {
    if (head_dim < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must be >= 1, got %lld", field, (long long)head_dim);
    if (head_dim > HEXISEQ_ATTN_MAX_HEAD_DIM)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED, "%s must be <= %d, got %lld", field,
                            HEXISEQ_ATTN_MAX_HEAD_DIM, (long long)head_dim);
    return HEXISEQ_OK;
}

static hexiseq_status check_positive(const char *field, int64_t value) {
    if (value < 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s must be >= 1, got %lld", field, (long long)value);
    return HEXISEQ_OK;
}

/* sizes[i] >= 1. The farthest element, sum |stride_i| * (size_i - 1), must fit HX_MAX_OFFSET. */
static hexiseq_status check_extent(const char *field, const int64_t *stride, const int64_t *size, int ndim) {
    int64_t extent = 0;
    for (int i = 0; i < ndim; ++i) {
        if (stride[i] == INT64_MIN || (stride[i] < 0 ? -stride[i] : stride[i]) > HX_MAX_OFFSET)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "%s_stride[%d] must be within +-2^60, got %lld", field, i,
                                (long long)stride[i]);
        int64_t s = stride[i] < 0 ? -stride[i] : stride[i];
        int64_t n = size[i] - 1;
        if (n > 0 && s > (HX_MAX_OFFSET - extent) / n)
            return hexiseq_fail(HEXISEQ_ERR_INVALID,
                                "%s_stride[%d] = %lld with size %lld overflows the 2^60 element offset range",
                                field, i, (long long)stride[i], (long long)size[i]);
        extent += s * n;
    }
    return HEXISEQ_OK;
}

static hexiseq_status check_pointer(const char *field, const void *ptr) {
    if (ptr == NULL)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "%s must not be NULL", field);
    return HEXISEQ_OK;
}

/* The document mask's layout: causal, and q_doc's strides in range. Its values are checked apart
 * (hexiseq_attn_check_doc_values): they can be read only where q_doc lies in host memory. */
static hexiseq_status check_documents(const hexiseq_attn_params *p) {
    if (p->causal != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID,
                            "q_doc (a document mask) needs causal = 1, got causal = %lld: keys are visible from "
                            "their document's start up to the query's own position",
                            (long long)p->causal);
    const int64_t dsize[2] = {p->batch, p->seq_q};
    return check_extent("q_doc", p->q_doc_stride, dsize, 2);
}

/* The sliding window's flag and bounds (see hexiseq_attn_params). */
static hexiseq_status check_window(const hexiseq_attn_params *p) {
    if (p->window != 0 && p->window != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "window must be 0 or 1, got %lld", (long long)p->window);
    if (!p->window)
        return HEXISEQ_OK;
    if (p->window_left < -1 || p->window_left > HX_MAX_POS)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "window_left must be -1 (none) or in [0, 2^62], got %lld",
                            (long long)p->window_left);
    if (p->window_right < -1 || p->window_right > HX_MAX_POS)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "window_right must be -1 (none) or in [0, 2^62], got %lld",
                            (long long)p->window_right);
    if (p->causal && p->window_right > 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID,
                            "window_right = %lld with causal = 1: the causal mask already hides every later key; "
                            "pass -1 or 0",
                            (long long)p->window_right);
    return HEXISEQ_OK;
}

/* Every start inside [0, q_pos0 + i] (the kernels skip key tiles from the starts, so a start past its own row would
 * read as "sees nothing" and one before 0 is no position). One pass over batch * seq_q values: small next to the
 * kernels' batch * seq_q * seq_k work. */
hexiseq_status hexiseq_attn_check_doc_values(const hexiseq_attn_params *p) {
    if (p->q_doc == NULL)
        return HEXISEQ_OK;
    for (int64_t b = 0; b < p->batch; ++b)
        for (int64_t i = 0; i < p->seq_q; ++i) {
            const int64_t start = p->q_doc[b * p->q_doc_stride[0] + i * p->q_doc_stride[1]];
            if (start < 0 || start > p->q_pos0 + i)
                return hexiseq_fail(HEXISEQ_ERR_INVALID,
                                    "q_doc[%lld, %lld] = %lld must be in [0, q_pos0 + %lld = %lld]: a query's "
                                    "document starts at or before its own position",
                                    (long long)b, (long long)i, (long long)start, (long long)i,
                                    (long long)(p->q_pos0 + i));
        }
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_attn_check_params(const hexiseq_attn_params *p, int backward) {
    if (p == NULL)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "params must not be NULL");
    HEXISEQ_CHECK(check_pointer("q", p->q));
    HEXISEQ_CHECK(check_pointer("k", p->k));
    HEXISEQ_CHECK(check_pointer("v", p->v));
    HEXISEQ_CHECK(check_pointer("o", p->o));
    HEXISEQ_CHECK(check_pointer("lse", p->lse));
    if (backward) {
        HEXISEQ_CHECK(check_pointer("do_", p->do_));
        HEXISEQ_CHECK(check_pointer("dq", p->dq));
        HEXISEQ_CHECK(check_pointer("dk", p->dk));
        HEXISEQ_CHECK(check_pointer("dv", p->dv));
    }
    HEXISEQ_CHECK(check_dtype("dtype", p->dtype));
    HEXISEQ_CHECK(check_positive("batch", p->batch));
    HEXISEQ_CHECK(check_positive("seq_q", p->seq_q));
    HEXISEQ_CHECK(check_positive("seq_k", p->seq_k));
    HEXISEQ_CHECK(check_positive("heads", p->heads));
    HEXISEQ_CHECK(check_positive("kv_heads", p->kv_heads));
    if (p->heads % p->kv_heads != 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "heads must be a multiple of kv_heads = %lld, got %lld",
                            (long long)p->kv_heads, (long long)p->heads);
    HEXISEQ_CHECK(check_head_dim("head_dim", p->head_dim));
    if (p->causal != 0 && p->causal != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "causal must be 0 or 1, got %lld", (long long)p->causal);
    if (backward && p->accumulate != 0 && p->accumulate != 1)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "accumulate must be 0 or 1, got %lld", (long long)p->accumulate);
    /* > 0: the CUDA forward takes each row's max on unscaled scores, the max of the scaled ones only then */
    if (!isfinite(p->scale) || !(p->scale > 0))
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "scale must be finite and > 0, got %g", p->scale);
    if (p->q_pos0 < 0 || p->q_pos0 > HX_MAX_POS - p->seq_q)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "q_pos0 must be in [0, 2^62 - seq_q], got %lld",
                            (long long)p->q_pos0);
    if (p->k_pos0 < 0 || p->k_pos0 > HX_MAX_POS - p->seq_k)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "k_pos0 must be in [0, 2^62 - seq_k], got %lld",
                            (long long)p->k_pos0);
    /* Task counts and per-head row counts are products of these; keep them inside int64. */
    if (p->batch > INT64_MAX / p->heads / p->seq_q || p->batch > INT64_MAX / p->heads / p->seq_k)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "batch * heads * seq overflows int64, batch = %lld",
                            (long long)p->batch);

    const int64_t qsize[4] = {p->batch, p->seq_q, p->heads, p->head_dim};
    const int64_t ksize[4] = {p->batch, p->seq_k, p->kv_heads, p->head_dim};
    const int64_t lsize[3] = {p->batch, p->heads, p->seq_q};
    HEXISEQ_CHECK(check_extent("q", p->q_stride, qsize, 4));
    HEXISEQ_CHECK(check_extent("k", p->k_stride, ksize, 4));
    HEXISEQ_CHECK(check_extent("v", p->v_stride, ksize, 4));
    HEXISEQ_CHECK(check_extent("o", p->o_stride, qsize, 4));
    HEXISEQ_CHECK(check_extent("lse", p->lse_stride, lsize, 3));
    if (backward) {
        HEXISEQ_CHECK(check_extent("do", p->do_stride, qsize, 4));
        HEXISEQ_CHECK(check_extent("dq", p->dq_stride, qsize, 4));
        HEXISEQ_CHECK(check_extent("dk", p->dk_stride, ksize, 4));
        HEXISEQ_CHECK(check_extent("dv", p->dv_stride, ksize, 4));
    }
    if (p->q_doc != NULL)
        HEXISEQ_CHECK(check_documents(p));
    HEXISEQ_CHECK(check_window(p));
    if (!isfinite(p->softcap) || p->softcap < 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "softcap must be finite and >= 0 (0: no soft-capping), got %g",
                            p->softcap);
    return HEXISEQ_OK;
}

hexiseq_status hexiseq_attn_check_merge(const hexiseq_attn_merge_params *m) {
    if (m == NULL)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "merge params must not be NULL");
    HEXISEQ_CHECK(check_pointer("o_acc", m->o_acc));
    HEXISEQ_CHECK(check_pointer("lse_acc", m->lse_acc));
    HEXISEQ_CHECK(check_pointer("o_part", m->o_part));
    HEXISEQ_CHECK(check_pointer("lse_part", m->lse_part));
    HEXISEQ_CHECK(check_dtype("acc_dtype", m->acc_dtype));
    HEXISEQ_CHECK(check_dtype("part_dtype", m->part_dtype));
    HEXISEQ_CHECK(check_positive("batch", m->batch));
    HEXISEQ_CHECK(check_positive("seq", m->seq));
    HEXISEQ_CHECK(check_positive("heads", m->heads));
    HEXISEQ_CHECK(check_head_dim("head_dim", m->head_dim));
    if (m->batch > INT64_MAX / m->heads / m->seq)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "batch * heads * seq overflows int64, batch = %lld",
                            (long long)m->batch);
    const int64_t osize[4] = {m->batch, m->seq, m->heads, m->head_dim};
    const int64_t lsize[3] = {m->batch, m->heads, m->seq};
    HEXISEQ_CHECK(check_extent("o_acc", m->o_acc_stride, osize, 4));
    HEXISEQ_CHECK(check_extent("o_part", m->o_part_stride, osize, 4));
    HEXISEQ_CHECK(check_extent("lse_acc", m->lse_acc_stride, lsize, 3));
    HEXISEQ_CHECK(check_extent("lse_part", m->lse_part_stride, lsize, 3));
    return HEXISEQ_OK;
}

