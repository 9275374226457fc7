/* Validated strided views of DLPack tensors, and their binding into the attention kernels' params structs. */
#ifndef HEXISEQ_TENSOR_VIEW_H
#define HEXISEQ_TENSOR_VIEW_H

#include <stdint.h>

#include "attention.h"
#include "dlpack.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HEXISEQ_VIEW_MAX_DIM 4

/* dtype of an index view (hexiseq_tensor_view_index_from_dl_on): int64, which no kernel takes as data, so the
 * code lies outside hexiseq_dtype. */
#define HEXISEQ_VIEW_INT64 64

/* One tensor argument as the kernels see it. Plain data: it owns nothing and outlives nothing;
 * the DLPack managed tensor it came from must stay alive while the view is used. */
typedef struct {
    char *data;                          /* address of element [0, ...] = DLTensor.data + byte_offset */
    int64_t shape[HEXISEQ_VIEW_MAX_DIM]; /* [ndim]; unused entries 1 */
    int64_t stride[HEXISEQ_VIEW_MAX_DIM]; /* [ndim] in elements; unused entries 0 */
    int64_t lo_bytes;    /* byte offset from data of the lowest addressed element (<= 0 with negative strides) */
    int64_t hi_bytes;    /* byte offset from data one past the highest addressed byte; lo == hi when empty */
    int64_t numel;       /* product of shape */
    int32_t ndim;
    int32_t dtype;       /* hexiseq_dtype */
    int32_t elem_bytes;  /* 8, 4 or 2 */
    int32_t writable;    /* 0 when the producer flagged the tensor read-only */
    int32_t device_type; /* DLDeviceType of the memory: kDLCPU, kDLCUDAHost, or kDLCUDA (CUDA views only) */
    int32_t device_id;   /* DLDevice.device_id */
    const char *name;    /* argument name used in error messages ("q", "out", ...); static storage */
} hexiseq_tensor_view;

/* Build a view of `t`, which must be `ndim`-D, on a CPU-readable device (kDLCPU, kDLCUDAHost) and of
 * dtype float64, float32, float16 or bfloat16 with one lane. strides == NULL means C-contiguous.
 * `read_only` is the producer's DLPACK_FLAG_BITMASK_READ_ONLY (0 for legacy capsules).
 * `layout` names the dimensions for messages, e.g. "[batch, seq, heads, head_dim]".
 * Failures: HEXISEQ_ERR_NULL (t or out NULL, NULL data with elements), HEXISEQ_ERR_UNSUPPORTED (device,
 * dtype), HEXISEQ_ERR_INVALID (ndim, negative sizes, misaligned data, strides past +-2^60 elements). */
hexiseq_status hexiseq_tensor_view_from_dl(const DLTensor *t, int read_only, const char *name, int32_t ndim,
                                           const char *layout, hexiseq_tensor_view *out);

/* As hexiseq_tensor_view_from_dl, for the kernels of one device kind: cuda == 0 takes CPU-readable memory
 * (kDLCPU, kDLCUDAHost) exactly as above; cuda != 0 takes CUDA device memory (kDLCUDA) only, for the CUDA
 * launchers of kernels/launch.h. Every other check is the same. */
hexiseq_status hexiseq_tensor_view_from_dl_on(const DLTensor *t, int read_only, const char *name, int32_t ndim,
                                              const char *layout, int cuda, hexiseq_tensor_view *out);

/* As hexiseq_tensor_view_from_dl_on for an int64 index tensor (the document starts q_doc) of 1 to max_ndim
 * dimensions: the view's ndim is the tensor's, its dtype HEXISEQ_VIEW_INT64; other dtypes are HEXISEQ_ERR_INVALID. */
hexiseq_status hexiseq_tensor_view_index_from_dl_on(const DLTensor *t, int read_only, const char *name,
                                                    int32_t max_ndim, const char *layout, int cuda,
                                                    hexiseq_tensor_view *out);

/* 1 when the byte ranges [data + lo, data + hi) of two non-empty views intersect (a conservative test:
 * two interleaved views of one buffer count as overlapping). */
int hexiseq_tensor_view_ranges_overlap(const hexiseq_tensor_view *a, const hexiseq_tensor_view *b);

/* 1 when two different index tuples of `v` may address the same element (e.g. a broadcast view with a
 * zero stride). Conservative: sorts dimensions by |stride| and asks each to step past all smaller ones. */
int hexiseq_tensor_view_self_overlaps(const hexiseq_tensor_view *v);

/* The tensors of one attention call. q, k, v: [batch, seq, heads, head_dim] inputs; o, lse: forward
 * outputs / backward inputs ([batch, seq_q, heads, head_dim] and [batch, heads, seq_q]); do_: backward
 * input; dq, dk, dv: backward outputs; q_doc: the document mask's starts (attention.h), if any. */
typedef struct {
    hexiseq_tensor_view q, k, v, o, lse, do_, dq, dk, dv;
    hexiseq_tensor_view q_doc; /* optional document starts, [batch, seq_q] or [seq_q] int64; ndim 0 when absent */
} hexiseq_attn_views;

/* Check that the views of a forward (backward != 0: backward) call agree and fill the tensor fields of
 * *p (pointers, strides, batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, and q_doc with its strides when
 * v->q_doc is present: [seq_q] gets batch stride 0); the caller sets causal,
 * q_pos0, k_pos0, scale and accumulate. Checks: shapes as documented above (k and v alike, heads a
 * multiple of kv_heads), one dtype for every 4-D tensor, lse float64 for float64 data and float32
 * otherwise, 1 <= head_dim <= HEXISEQ_ATTN_MAX_HEAD_DIM, outputs writable, not self-overlapping, and not
 * overlapping any input or each other. *empty is set to 1 when batch, seq_q, seq_k or heads is 0: the
 * kernel must not be called, and outputs that still have elements (o, lse, dq when seq_k == 0; dk, dv
 * when seq_q == 0) are the caller's to fill.
 * Failures: HEXISEQ_ERR_INVALID naming the argument, HEXISEQ_ERR_UNSUPPORTED for the head dim. */
hexiseq_status hexiseq_attn_params_from_views(const hexiseq_attn_views *v, int backward, hexiseq_attn_params *p,
                                              int *empty);

/* The tensors of one merge: o_acc [batch, seq, heads, head_dim] and lse_acc [batch, heads, seq] are
 * updated in place from o_part, lse_part of the same shapes. */
typedef struct {
    hexiseq_tensor_view o_acc, lse_acc, o_part, lse_part;
} hexiseq_attn_merge_views;

/* As hexiseq_attn_params_from_views for a merge: fills every field of *m. The two sides may differ in
 * dtype; each lse is float64 when its side is float64 and float32 otherwise. */
hexiseq_status hexiseq_attn_merge_params_from_views(const hexiseq_attn_merge_views *v, hexiseq_attn_merge_params *m,
                                                    int *empty);

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_TENSOR_VIEW_H */
