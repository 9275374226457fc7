/* Layouts: storage, the positions each group owns (spans), and the kv heads a range of query heads needs. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

hexiseq_status hexiseq_layout_alloc(int32_t n_groups, int32_t n_devices, hexiseq_layout *out) {
    hexiseq_clear_error();
    if (!out)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "out must not be NULL");
    memset(out, 0, sizeof *out);
    if (n_groups < 1 || n_devices < 1 || n_groups > n_devices || n_devices > HEXISEQ_MAX_DEVICES)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "layout sizes must satisfy 1 <= n_groups <= n_devices <= %d, got %d groups, %d devices",
                            HEXISEQ_MAX_DEVICES, n_groups, n_devices);
    out->n_groups = n_groups;
    out->n_devices = n_devices;
    out->group_size = calloc((size_t)n_groups, sizeof *out->group_size);
    out->group_seq = calloc((size_t)n_groups, sizeof *out->group_seq);
    out->device = calloc((size_t)n_devices, sizeof *out->device);
    out->tokens = calloc((size_t)n_devices, sizeof *out->tokens);
    out->head_lo = calloc((size_t)n_devices, sizeof *out->head_lo);
    out->head_count = calloc((size_t)n_devices, sizeof *out->head_count);
    if (!out->group_size || !out->group_seq || !out->device || !out->tokens || !out->head_lo || !out->head_count) {
        hexiseq_layout_free(out);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate a layout of %d devices", n_devices);
    }
    return HEXISEQ_OK;
}

void hexiseq_layout_free(hexiseq_layout *l) {
    if (!l)
        return;
    free(l->group_size);
    free(l->group_seq);
    free(l->device);
    free(l->tokens);
    free(l->head_lo);
    free(l->head_count);
    memset(l, 0, sizeof *l);
}

void hexiseq_layout_copy(hexiseq_layout *dst, const hexiseq_layout *src) {
    memcpy(dst->group_size, src->group_size, (size_t)src->n_groups * sizeof *src->group_size);
    memcpy(dst->group_seq, src->group_seq, (size_t)src->n_groups * sizeof *src->group_seq);
    memcpy(dst->device, src->device, (size_t)src->n_devices * sizeof *src->device);
    memcpy(dst->tokens, src->tokens, (size_t)src->n_devices * sizeof *src->tokens);
    memcpy(dst->head_lo, src->head_lo, (size_t)src->n_devices * sizeof *src->head_lo);
    memcpy(dst->head_count, src->head_count, (size_t)src->n_devices * sizeof *src->head_count);
    dst->chunking = src->chunking;
}

hexiseq_status hexiseq_layout_spans(const hexiseq_layout *l, hexiseq_group_span *spans) {
    hexiseq_clear_error();
    if (!l || !spans || !l->group_seq)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "layout and spans must not be NULL");
    if (l->chunking != HEXISEQ_CHUNK_ZIGZAG && l->chunking != HEXISEQ_CHUNK_CONTIGUOUS)
        return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "chunking must be 0 (zigzag) or 1 (contiguous), got %d", l->chunking);
    int64_t total = 0;
    for (int32_t g = 0; g < l->n_groups; ++g) {
        if (l->group_seq[g] < 0 || l->group_seq[g] > HEXISEQ_MAX_SEQ_LEN - total)
            return hexiseq_fail(HEXISEQ_ERR_LAYOUT, "group_seq[%d] must be >= 0 with a total <= %lld, got %lld", g,
                                (long long)HEXISEQ_MAX_SEQ_LEN, (long long)l->group_seq[g]);
        total += l->group_seq[g];
    }
    int64_t front = 0, back_end = total;
    for (int32_t g = 0; g < l->n_groups; ++g) {
        int64_t b = l->chunking == HEXISEQ_CHUNK_CONTIGUOUS ? 0 : l->group_seq[g] / 2, a = l->group_seq[g] - b;
        spans[g].front_start = front;
        spans[g].front_len = a;
        spans[g].back_start = l->chunking == HEXISEQ_CHUNK_CONTIGUOUS ? front + a : back_end - b;
        spans[g].back_len = b;
        front += a;
        back_end -= b;
    }
    return HEXISEQ_OK;
}

/* kv heads a device needs for query heads [lo, lo + count). */
void hexiseq_kv_range(const hexiseq_model *m, int32_t lo, int32_t count, int32_t *kv_lo, int32_t *kv_count) {
    if (count == 0) {
        *kv_lo = 0;
        *kv_count = 0;
        return;
    }
    int32_t per = m->heads / m->kv_heads;
    *kv_lo = lo / per;
    *kv_count = (lo + count - 1) / per - *kv_lo + 1;
}
