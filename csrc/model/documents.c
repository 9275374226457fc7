/* Packed documents: the document-causal mask's visible pairs between two position ranges, for the cost
 * model. A query at position q sees the keys of its own document from the document's start up to q. For
 * queries [q0, q1) and keys [k0, k1) only documents meeting both ranges contribute; every document strictly
 * between the first and the last of those lies inside both ranges and adds its whole triangle, which the
 * prefix sums give at once. So a count costs two binary searches and two triangle clips: O(log n). */
#include <stdlib.h>

#include "internal.h"
#include "status.h"

hexiseq_status hexiseq_documents_init(const int64_t *lengths, int64_t n, hexiseq_documents *out) {
    hexiseq_clear_error();
    if (!out || (!lengths && n > 0))
        return hexiseq_fail(HEXISEQ_ERR_NULL, "lengths and out must not be NULL");
    out->n = 0;
    out->end = NULL;
    out->tri = NULL;
    out->tri_len = NULL;
    if (n < 1 || n > HEXISEQ_MAX_SEQ_LEN)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "documents must hold 1 to %lld lengths, got %lld",
                            (long long)HEXISEQ_MAX_SEQ_LEN, (long long)n);
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (lengths[i] < 1 || lengths[i] > HEXISEQ_MAX_SEQ_LEN - total)
            return hexiseq_fail(HEXISEQ_ERR_INVALID,
                                "documents[%lld] must be >= 1 with a total <= %lld, got %lld", (long long)i,
                                (long long)HEXISEQ_MAX_SEQ_LEN, (long long)lengths[i]);
        total += lengths[i];
    }
    out->end = malloc((size_t)n * sizeof *out->end);
    out->tri = malloc(((size_t)n + 1) * sizeof *out->tri);
    out->tri_len = malloc(((size_t)n + 1) * sizeof *out->tri_len);
    if (!out->end || !out->tri || !out->tri_len) {
        hexiseq_documents_free(out);
        return hexiseq_fail(HEXISEQ_ERR_NOMEM, "cannot allocate %lld documents", (long long)n);
    }
    int64_t pos = 0;
    out->tri[0] = 0;
    out->tri_len[0] = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        pos += lengths[i];
        out->end[i] = pos;
        int64_t t = lengths[i] * (lengths[i] + 1) / 2;
        out->tri[i + 1] = out->tri[i] + t; /* <= total^2 / 2 < 2^60 */
        out->tri_len[i + 1] = out->tri_len[i] + (double)t * (double)lengths[i];
    }
    out->n = n;
    return HEXISEQ_OK;
}

void hexiseq_documents_free(hexiseq_documents *docs) {
    if (!docs)
        return;
    free(docs->end);
    free(docs->tri);
    free(docs->tri_len);
    docs->end = NULL;
    docs->tri = NULL;
    docs->tri_len = NULL;
    docs->n = 0;
}

/* The causal mask alone (no documents): what visible_pairs counts inside each document. */
int64_t hexiseq_causal_pairs(int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
    int64_t len_k = k1 - k0, pairs = 0;
    if (len_k <= 0 || q1 <= q0)
        return 0;
    /* queries inside the key range see (q - k0 + 1) keys */
    int64_t a = q0 > k0 ? q0 : k0, b = q1 < k1 ? q1 : k1;
    if (a < b) {
        int64_t n = b - a;
        pairs += n * (a - k0 + 1) + n * (n - 1) / 2;
    }
    /* queries past the key range see all of it */
    int64_t c = q0 > k1 ? q0 : k1;
    if (c < q1)
        pairs += (q1 - c) * len_k;
    return pairs;
}

/* The document holding position p (p < end[n - 1]): the first with end > p. */
static int64_t doc_of(const hexiseq_documents *d, int64_t p) {
    int64_t lo = 0, hi = d->n - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (d->end[mid] > p)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* The causal pairs less those with k <= q - window, which are the causal pairs of the queries moved window
 * positions back. */
int64_t hexiseq_window_pairs(int64_t q0, int64_t q1, int64_t k0, int64_t k1, int64_t window) {
    return hexiseq_causal_pairs(q0, q1, k0, k1) - hexiseq_causal_pairs(q0 - window, q1 - window, k0, k1);
}

/* Causal pairs of [q0, q1) x [k0, k1), both clipped to document i. */
static int64_t in_doc(const hexiseq_documents *d, int64_t i, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
    int64_t start = i ? d->end[i - 1] : 0, end = d->end[i];
    return hexiseq_causal_pairs(q0 > start ? q0 : start, q1 < end ? q1 : end, k0 > start ? k0 : start,
                                k1 < end ? k1 : end);
}

int64_t hexiseq_visible_pairs(const hexiseq_documents *d, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
    if (!d || d->n == 0)
        return hexiseq_causal_pairs(q0, q1, k0, k1);
    int64_t S = d->end[d->n - 1];
    q0 = q0 > 0 ? q0 : 0;
    k0 = k0 > 0 ? k0 : 0;
    q1 = q1 < S ? q1 : S;
    k1 = k1 < S ? k1 : S;
    if (q1 <= q0 || k1 <= k0 || k0 >= q1) /* empty, or every key after every query */
        return 0;
    /* keys ending before the queries start: only the document holding both k1 - 1 and q0, if one does */
    if (k1 <= q0) {
        int64_t i = doc_of(d, q0);
        return (i ? d->end[i - 1] : 0) < k1 ? in_doc(d, i, q0, q1, k0, k1) : 0;
    }
    /* overlapping ranges: a document with a visible pair meets the overlap [max(q0, k0), min(q1, k1)), so
     * the documents from a (holding its first position) to b (its last) are all that count; in_doc clips
     * a and b to their own bounds, and the ones strictly between lie inside both ranges */
    int64_t a = doc_of(d, q0 > k0 ? q0 : k0), b = doc_of(d, (q1 < k1 ? q1 : k1) - 1);
    if (a == b)
        return in_doc(d, a, q0, q1, k0, k1);
    int64_t pairs = in_doc(d, a, q0, q1, k0, k1) + in_doc(d, b, q0, q1, k0, k1);
    pairs += d->tri[b] - d->tri[a + 1];
    return pairs;
}

void hexiseq_document_pieces(const hexiseq_documents *d, int64_t p0, int64_t p1, double *pairs, double *pairs_len) {
    if (!d || d->n == 0)
        return;
    int64_t S = d->end[d->n - 1];
    p0 = p0 > 0 ? p0 : 0;
    p1 = p1 < S ? p1 : S;
    if (p1 <= p0)
        return;
    int64_t a = doc_of(d, p0), b = doc_of(d, p1 - 1);
    for (int64_t i = a; i <= b; i += (b > a ? b - a : 1)) { /* the two end pieces, clipped */
        int64_t s0 = i ? d->end[i - 1] : 0, e0 = d->end[i];
        double len = (double)((e0 < p1 ? e0 : p1) - (s0 > p0 ? s0 : p0)), t = len * (len + 1.0) / 2.0;
        *pairs += t;
        *pairs_len += t * len;
    }
    if (b > a + 1) { /* the documents strictly between, whole */
        *pairs += (double)(d->tri[b] - d->tri[a + 1]);
        *pairs_len += d->tri_len[b] - d->tri_len[a + 1];
    }
}
