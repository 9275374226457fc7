/* Parameters and CPU entry points of the attention kernel family: forward, backward, and the (O, LSE) merge. */
#ifndef HEXISEQ_ATTENTION_H
#define HEXISEQ_ATTENTION_H

#include <stdint.h>

#include "half.h" /* fp16 / bf16 conversions: callers that fill or read half tensors need them too */
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of q, k, v, o, do_, dq, dk, dv. Half types are stored as their uint16_t bit patterns.
 * Fixed values: they cross the C ABI (Python binding, CUDA launchers). */
typedef enum {
    HEXISEQ_DTYPE_F64 = 0,
    HEXISEQ_DTYPE_F32 = 1,
    HEXISEQ_DTYPE_F16 = 2,  /* IEEE 754 binary16 */
    HEXISEQ_DTYPE_BF16 = 3  /* bfloat16: the top 16 bits of a binary32 */
} hexiseq_dtype;

/* Largest head_dim any kernel of the family accepts. */
#define HEXISEQ_ATTN_MAX_HEAD_DIM 256

/* Index of each dimension in the stride arrays of [batch, seq, heads, head_dim] tensors. */
#define HEXISEQ_ATTN_DIM_BATCH 0
#define HEXISEQ_ATTN_DIM_SEQ 1
#define HEXISEQ_ATTN_DIM_HEAD 2
#define HEXISEQ_ATTN_DIM_HEAD_DIM 3
/* Index of each dimension in lse_stride: lse is [batch, heads, seq_q]. */
#define HEXISEQ_ATTN_LSE_DIM_BATCH 0
#define HEXISEQ_ATTN_LSE_DIM_HEAD 1
#define HEXISEQ_ATTN_LSE_DIM_SEQ 2

/* One attention call (forward or backward) on one block of queries against one block of keys.
 *
 * O = softmax(scale * Q K^T + mask) V per (batch, query head); query head h reads kv head
 * h / (heads / kv_heads) (GQA; MQA when kv_heads == 1). Query row i sits at absolute position
 * q_pos0 + i, key row j at k_pos0 + j; with causal != 0, key j is visible to query i iff
 * k_pos0 + j <= q_pos0 + i. A query row that sees no key is "fully masked": O = 0, LSE = -inf,
 * and it contributes nothing to any gradient.
 *
 * Document mask (packed sequences): with q_doc != NULL, q_doc[b, i] is the absolute position at which
 * the document of query row i starts, 0 <= q_doc[b, i] <= q_pos0 + i, and key j is visible to query i
 * iff q_doc[b, i] <= k_pos0 + j <= q_pos0 + i. It needs causal = 1. Being in absolute positions, it
 * holds for any block of queries against any block of keys (ring steps, zigzag chunks). Served by the
 * CPU and the CUDA kernels; only the CPU entry points check the values (on CUDA q_doc is device memory, see
 * kernels/launch.h).
 *
 * Strides are in elements (not bytes), may be any value (views, heads-major layouts, negative)
 * as long as every addressed element lies inside the caller's buffer. Outputs must not overlap inputs.
 * LSE (natural log of the row sum of exp(scale * scores)) is double when dtype is F64, float otherwise.
 * Fields not used by a call (the gradients in the forward) are ignored and may be NULL/zero. */
typedef struct hexiseq_attn_params {
    const void *q;   /* [batch, seq_q, heads, head_dim] */
    const void *k;   /* [batch, seq_k, kv_heads, head_dim] */
    const void *v;   /* [batch, seq_k, kv_heads, head_dim] */
    void *o;         /* [batch, seq_q, heads, head_dim]: forward output, backward input */
    void *lse;       /* [batch, heads, seq_q] (double or float, see above): forward output, backward input */
    const void *do_; /* [batch, seq_q, heads, head_dim]: gradient of o, backward input */
    void *dq;        /* [batch, seq_q, heads, head_dim]: backward output */
    void *dk;        /* [batch, seq_k, kv_heads, head_dim]: backward output */
    void *dv;        /* [batch, seq_k, kv_heads, head_dim]: backward output */

    int64_t q_stride[4]; /* [batch, seq, head, head_dim] element strides of q; same order below */
    int64_t k_stride[4];
    int64_t v_stride[4];
    int64_t o_stride[4];
    int64_t do_stride[4];
    int64_t dq_stride[4];
    int64_t dk_stride[4];
    int64_t dv_stride[4];
    int64_t lse_stride[3]; /* [batch, head, seq] */

    int64_t batch;
    int64_t seq_q;    /* rows of this query block */
    int64_t seq_k;    /* rows of this key/value block */
    int64_t q_pos0;   /* absolute position of query row 0, >= 0 */
    int64_t k_pos0;   /* absolute position of key row 0, >= 0 */
    const int64_t *q_doc;    /* [batch, seq_q] document start of each query row, or NULL: no document mask */
    int64_t q_doc_stride[2]; /* [batch, seq] element strides of q_doc; 0 repeats a row (one layout per batch) */
    double scale;     /* softmax scale, usually 1/sqrt(head_dim); finite and > 0 */
    int32_t heads;    /* query heads A */
    int32_t kv_heads; /* key/value heads A_kv; heads % kv_heads == 0 */
    int32_t head_dim; /* d, 1..HEXISEQ_ATTN_MAX_HEAD_DIM */
    int32_t causal;   /* 0 or 1 */
    int32_t dtype;    /* hexiseq_dtype; a fixed-width int, not the enum, so the layout is ABI-stable */
    int32_t accumulate; /* backward only: 0 overwrites dq, dk, dv; 1 adds into them (ring steps summing pieces) */

    /* Sliding window (window = 1), on top of the causal and document masks: key j is visible to query i only if
     *   window_left  < 0  or  (q_pos0 + i) - (k_pos0 + j) <= window_left,   and
     *   window_right < 0  or  (k_pos0 + j) - (q_pos0 + i) <= window_right
     * (FlashAttention's window_size; a Hugging Face sliding_window of W tokens is window_left = W - 1). Each bound is
     * -1 (none) or in [0, 2^62]; with causal = 1, window_right must be -1 or 0. window = 0, as in a zeroed struct:
     * no window, the two bounds are ignored. */
    int64_t window_left;
    int64_t window_right;
    /* Logit soft-capping (Gemma 2): with softcap > 0 each score x = scale * q.k becomes softcap * tanh(x / softcap)
     * before the softmax, and LSE is that of the capped scores; 0: none. Finite and >= 0. */
    double softcap;
    int32_t window;   /* 0 or 1, see window_left */
    int32_t reserved; /* 0 */
} hexiseq_attn_params;

/* The one mask form the kernels implement: the window's and the causal mask's bounds rewritten, in place, so that
 * every call is either unwindowed, or causal with a left window only. A key is visible iff
 *   max(document start, qpos - window_left) <= kpos <= qpos
 * so the window's left bound is a per-row lower bound like the document start, and the kernels need one code path
 * for both. How: a right bound R (window_right, or, for a non-causal call, the distance to the block's last key)
 * becomes the causal diagonal shifted R positions later (q_pos0 + R), and the left bound grows by R. Positions only
 * decide visibility, never values, so the shift changes nothing else. Bounds that reach past the whole block are
 * dropped first (which also keeps the sums inside int64). Call after hexiseq_attn_check_params. */
static inline void hexiseq_attn_canonical_mask(hexiseq_attn_params *p) {
    if (!p->window)
        return;
    const int64_t q_last = p->q_pos0 + p->seq_q - 1, k_last = p->k_pos0 + p->seq_k - 1;
    int64_t left = p->window_left, right = p->causal ? 0 : p->window_right;
    if (left >= 0 && left >= q_last - p->k_pos0) /* every key at or before its query is inside the window */
        left = -1;
    const int64_t reach = k_last > p->q_pos0 ? k_last - p->q_pos0 : 0; /* the farthest any key lies ahead */
    if (right < 0 || right > reach)
        right = reach;
    p->q_pos0 += right;
    p->window_left = left >= 0 ? left + right : -1;
    p->window_right = -1;
    p->causal = 1;
    p->window = p->window_left >= 0;
}

/* Fold one partial result (o_part, lse_part) into an accumulator (o_acc, lse_acc), in place:
 *   lse_new = logaddexp(lse_acc, lse_part)
 *   o_acc   = exp(lse_acc - lse_new) * o_acc + exp(lse_part - lse_new) * o_part
 * It has its own struct because its operands are two (O, LSE) pairs and no Q/K/V; reusing
 * hexiseq_attn_params would give its fields a second meaning. The two sides may have different
 * dtypes, so a float accumulator can take bf16/f16 partials without rounding between ring steps.
 * Each LSE is double when its side's dtype is F64, float otherwise. The merge is computed in double.
 * A row whose lse_part is -inf leaves the accumulator row bit-for-bit unchanged; a row whose lse_acc
 * is -inf takes the partial (rounded to acc_dtype). o_acc must not overlap o_part. */
typedef struct hexiseq_attn_merge_params {
    void *o_acc;          /* [batch, seq, heads, head_dim] in acc_dtype, updated */
    void *lse_acc;        /* [batch, heads, seq], updated */
    const void *o_part;   /* [batch, seq, heads, head_dim] in part_dtype */
    const void *lse_part; /* [batch, heads, seq] */

    int64_t o_acc_stride[4];  /* [batch, seq, head, head_dim] */
    int64_t o_part_stride[4]; /* [batch, seq, head, head_dim] */
    int64_t lse_acc_stride[3];  /* [batch, head, seq] */
    int64_t lse_part_stride[3]; /* [batch, head, seq] */

    int64_t batch;
    int64_t seq;
    int32_t heads;
    int32_t head_dim;   /* 1..HEXISEQ_ATTN_MAX_HEAD_DIM */
    int32_t acc_dtype;  /* hexiseq_dtype */
    int32_t part_dtype; /* hexiseq_dtype */
} hexiseq_attn_merge_params;

/* Forward: writes p->o and p->lse. Tiled online softmax; memory O(tile * head_dim) per thread. */
HEXISEQ_API hexiseq_status hexiseq_attn_forward_cpu(const hexiseq_attn_params *p);

/* Backward: from q, k, v, o, lse, do_ writes (or adds into, see accumulate) dq, dk, dv.
 * o and lse are taken as given, never recomputed: with the globally merged o and lse of a ring,
 * the dq of each key block sum to the dq of the whole sequence and each block's dk, dv are that
 * block's slice of the whole gradient. D = rowsum(do_ * o) is computed inside. */
HEXISEQ_API hexiseq_status hexiseq_attn_backward_cpu(const hexiseq_attn_params *p);

/* Merge (see hexiseq_attn_merge_params). */
HEXISEQ_API hexiseq_status hexiseq_attn_merge_cpu(const hexiseq_attn_merge_params *m);

/* Check a params struct before launching (CPU or CUDA): pointers, sizes, dtype, positions, and that every
 * addressed element stays within +-2^60 elements; with q_doc, causal and q_doc's layout, not its values (it may be
 * device memory). backward: also do_, dq, dk, dv and accumulate. Internal. */
hexiseq_status hexiseq_attn_check_params(const hexiseq_attn_params *p, int backward);
/* With q_doc (host memory), every start in [0, q_pos0 + i]. The CPU entry points call it after
 * hexiseq_attn_check_params; the CUDA launchers cannot (q_doc is device memory there). Internal. */
hexiseq_status hexiseq_attn_check_doc_values(const hexiseq_attn_params *p);
hexiseq_status hexiseq_attn_check_merge(const hexiseq_attn_merge_params *m);

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_ATTENTION_H */
