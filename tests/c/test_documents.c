/* Packed documents in the cost model and the scheduler: visible pairs of the document-causal mask against a
 * brute force count, the ring steps of a layout summing to the mask's pairs under both chunkings, one
 * document equal to no documents bit for bit, the refusals, and the scheduler choosing a layout at least as
 * fast (predicted) as the one it picks for the same batch taken as one causal document. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#include "check.h"

static uint64_t rng = 88172645463325252ull;
static int64_t rand_below(int64_t n) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (int64_t)(rng % (uint64_t)n);
}

/* Visible pairs by brute force: query q sees key k iff start(q) <= k <= q (start from a per-position table). */
static int64_t brute(const int64_t *start, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
    int64_t n = 0;
    for (int64_t q = q0; q < q1; ++q)
        for (int64_t k = k0; k < k1; ++k)
            n += start[q] <= k && k <= q;
    return n;
}

/* Random lengths summing to S: mostly short, some length 1, now and then a long one. */
static int64_t random_docs(int64_t S, int64_t *len) {
    int64_t n = 0, left = S;
    while (left > 0) {
        int64_t pick = rand_below(10) == 0 ? 1 + rand_below(S / 2 + 1) : 1 + rand_below(12);
        len[n] = pick < left ? pick : left;
        left -= len[n++];
    }
    return n;
}

static void test_pairs_brute(void) {
    enum { S = 97 };
    int64_t len[S], start[S];
    for (int trial = 0; trial < 60; ++trial) {
        int64_t n = trial == 0 ? 1 : trial == 1 ? S : random_docs(S, len);
        if (trial == 0)
            len[0] = S;
        if (trial == 1)
            for (int64_t i = 0; i < S; ++i)
                len[i] = 1;
        hexiseq_documents d;
        EXPECT(hexiseq_documents_init(len, n, &d) == HEXISEQ_OK, "init: %s", hexiseq_last_error());
        for (int64_t i = 0, p = 0; i < n; ++i)
            for (int64_t j = 0; j < len[i]; ++j)
                start[p + j] = p, (j == len[i] - 1 ? p += len[i] : 0);
        int bad = 0;
        for (int r = 0; r < 300 && !bad; ++r) {
            int64_t q0 = rand_below(S + 1), q1 = q0 + rand_below(S + 1 - q0);
            int64_t k0 = rand_below(S + 1), k1 = k0 + rand_below(S + 1 - k0);
            int64_t want = brute(start, q0, q1, k0, k1), got = hexiseq_visible_pairs(&d, q0, q1, k0, k1);
            if (got != want) {
                EXPECT(0, "trial %d: pairs [%lld,%lld)x[%lld,%lld) = %lld, brute force %lld", trial, (long long)q0,
                       (long long)q1, (long long)k0, (long long)k1, (long long)got, (long long)want);
                bad = 1;
            }
        }
        EXPECT(!bad, "trial %d", trial);
        EXPECT(hexiseq_visible_pairs(&d, 0, S, 0, S) == d.tri[d.n], "whole sequence = sum of triangles");
        hexiseq_documents_free(&d);
    }
    /* one document is plain causal */
    int64_t one = 1000;
    hexiseq_documents d;
    EXPECT(hexiseq_documents_init(&one, 1, &d) == HEXISEQ_OK, "init");
    EXPECT(hexiseq_visible_pairs(&d, 300, 700, 100, 500) == hexiseq_causal_pairs(300, 700, 100, 500), "one doc");
    EXPECT(hexiseq_visible_pairs(NULL, 300, 700, 100, 500) == hexiseq_causal_pairs(300, 700, 100, 500), "none");
    hexiseq_documents_free(&d);
}

static void test_init_refusals(void) {
    hexiseq_documents d;
    int64_t bad[3] = {4, 0, 5};
    EXPECT(hexiseq_documents_init(bad, 3, &d) == HEXISEQ_ERR_INVALID, "zero length");
    EXPECT(strstr(hexiseq_last_error(), "documents[1]") != NULL, "names the entry: %s", hexiseq_last_error());
    EXPECT(hexiseq_documents_init(bad, 0, &d) == HEXISEQ_ERR_INVALID, "no documents");
    int64_t huge[2] = {INT64_C(1) << 29, (INT64_C(1) << 29) + 1};
    EXPECT(hexiseq_documents_init(huge, 2, &d) == HEXISEQ_ERR_INVALID, "too long in total");
    EXPECT(hexiseq_documents_init(NULL, 2, &d) == HEXISEQ_ERR_NULL, "NULL lengths");
}

/* n alike devices; flat: measured curves of one point each, so that every kernel size runs at one rate;
 * doc_rate > 0: a flat packed-document curve at that rate too. */
static hexiseq_cluster *alike_cluster_doc(int32_t n, int flat, double doc_rate) {
    hexiseq_node_desc node = {"A100-80G", n, 300.0, 0, 0, 0, 0, 0};
    hexiseq_device_desc dev[8];
    memset(dev, 0, sizeof dev);
    for (int32_t i = 0; i < n && i < 8; ++i) {
        dev[i].gemm = (hexiseq_rate_curve){1, {1024}, {200.0}};
        dev[i].attn = (hexiseq_rate_curve){1, {1024}, {150.0}};
        dev[i].attn_causal = (hexiseq_rate_curve){1, {1024}, {150.0}};
        if (doc_rate > 0)
            dev[i].attn_document = (hexiseq_rate_curve){1, {256}, {doc_rate}};
    }
    hexiseq_cluster_options opt = {dev, NULL};
    hexiseq_cluster *c = NULL;
    hexiseq_status st = hexiseq_cluster_create_ex(1, &node, 25.0, NULL, flat ? &opt : NULL, &c);
    return st == HEXISEQ_OK ? c : NULL;
}
static hexiseq_cluster *alike_cluster_ex(int32_t n, int flat) { return alike_cluster_doc(n, flat, 0.0); }
static hexiseq_cluster *alike_cluster(int32_t n) { return alike_cluster_ex(n, 0); }

static const hexiseq_model MODEL = {2, 512, 8, 8, 64, 2048, 1000, 2, 1, 0, 0, 0, 0};

/* A ring of n single devices, unequal S_g (all heads each). */
static void ring_layout(int32_t n, const int64_t *seq, int32_t chunking, hexiseq_layout *l) {
    hexiseq_layout_alloc(n, n, l);
    l->chunking = chunking;
    for (int32_t g = 0; g < n; ++g) {
        l->group_size[g] = 1;
        l->group_seq[g] = seq[g];
        l->device[g] = g;
        l->tokens[g] = seq[g];
        l->head_lo[g] = 0;
        l->head_count[g] = MODEL.heads;
    }
}

/* With flat measured curves attention time is pairs / one rate, so the devices' attention times add up to the
 * whole mask's pairs times one constant. Both chunkings, random documents. */
static void test_steps_cover_the_mask(void) {
    enum { N = 5, SG = 640 };
    hexiseq_cluster *c = alike_cluster_ex(N, 1);
    EXPECT(c != NULL, "cluster");
    if (!c)
        return;
    int64_t seq[N], S = (int64_t)N * SG;
    for (int g = 0; g < N; ++g)
        seq[g] = SG;
    int64_t *len = malloc((size_t)S * sizeof *len);
    hexiseq_training t;
    hexiseq_training_default(&t);
    hexiseq_device_cost per[N], ref[N];
    hexiseq_plan_cost pc, rc;
    for (int32_t chunking = 0; chunking < 2; ++chunking) {
        hexiseq_layout l;
        ring_layout(N, seq, chunking, &l);
        t.documents = NULL;
        EXPECT(hexiseq_evaluate(c, &MODEL, &t, S, 1, &l, ref, &rc) == HEXISEQ_OK, "no documents: %s",
               hexiseq_last_error());
        double ref_sum = 0;
        for (int r = 0; r < N; ++r)
            ref_sum += ref[r].attn_s;
        double causal_pairs = (double)S * (S + 1) / 2;
        for (int trial = 0; trial < 6; ++trial) {
            int64_t n = random_docs(S, len);
            if (trial == 0) { /* one document: the same figures, bit for bit */
                n = 1;
                len[0] = S;
            }
            hexiseq_documents d;
            hexiseq_documents_init(len, n, &d);
            t.documents = &d;
            EXPECT(hexiseq_evaluate(c, &MODEL, &t, S, 1, &l, per, &pc) == HEXISEQ_OK, "documents: %s",
                   hexiseq_last_error());
            double sum = 0;
            for (int r = 0; r < N; ++r)
                sum += per[r].attn_s;
            double want = ref_sum * (double)d.tri[d.n] / causal_pairs;
            EXPECT(fabs(sum - want) <= 1e-12 * want, "chunking %d trial %d: attention %.15g, mask pairs give %.15g",
                   chunking, trial, sum, want);
            if (trial == 0) {
                EXPECT(memcmp(per, ref, sizeof per) == 0 && pc.step_time_s == rc.step_time_s,
                       "one document equals no documents bit for bit (chunking %d)", chunking);
            } else {
                EXPECT(pc.lower_bound_s < rc.lower_bound_s, "fewer pairs, lower bound");
                EXPECT(pc.gemm_phase_s == rc.gemm_phase_s, "token-parallel work does not see documents");
            }
            hexiseq_documents_free(&d);
        }
        hexiseq_layout_free(&l);
    }
    /* spans: contiguous chunks have no back chunk and follow the ring order */
    hexiseq_layout l;
    const int64_t uneven[N] = {100, 300, 50, 150, 400};
    ring_layout(N, uneven, HEXISEQ_CHUNK_CONTIGUOUS, &l);
    hexiseq_group_span sp[N];
    EXPECT(hexiseq_layout_spans(&l, sp) == HEXISEQ_OK, "spans");
    for (int g = 0, at = 0; g < N; at += (int)uneven[g], ++g)
        EXPECT(sp[g].front_start == at && sp[g].front_len == uneven[g] && sp[g].back_len == 0 &&
                   sp[g].back_start == at + uneven[g],
               "contiguous span of group %d", g);
    l.chunking = 2;
    EXPECT(hexiseq_layout_spans(&l, sp) == HEXISEQ_ERR_LAYOUT, "unknown chunking refused");
    hexiseq_layout_free(&l);
    free(len);
    hexiseq_cluster_destroy(c);
}

/* The pieces' pair-weighted length against a brute force, and its effect: at the same pairs, short documents
 * run at a shorter block's rate than long ones. */
static void test_document_length(void) {
    enum { S = 300 };
    int64_t len[S];
    for (int trial = 0; trial < 40; ++trial) {
        int64_t n = random_docs(S, len);
        hexiseq_documents d;
        hexiseq_documents_init(len, n, &d);
        int64_t p0 = rand_below(S), p1 = p0 + 1 + rand_below(S - p0);
        double w = 0, wl = 0, bw = 0, bwl = 0;
        hexiseq_document_pieces(&d, p0, p1, &w, &wl);
        for (int64_t i = 0, at = 0; i < n; at += len[i++]) {
            int64_t a = at > p0 ? at : p0, b = at + len[i] < p1 ? at + len[i] : p1;
            if (b > a) {
                double l = (double)(b - a);
                bw += l * (l + 1) / 2;
                bwl += l * (l + 1) / 2 * l;
            }
        }
        EXPECT(w == bw && fabs(wl - bwl) <= 1e-12 * bwl, "trial %d [%lld,%lld): %g %g vs %g %g", trial, (long long)p0,
               (long long)p1, w, wl, bw, bwl);
        hexiseq_documents_free(&d);
    }
    /* one group, catalog rates (a rate that grows with the block): documents of 64 tokens against documents
     * of 1024, compared per visible pair */
    hexiseq_cluster *c = alike_cluster(1);
    const int64_t seq[1] = {4096};
    hexiseq_layout l;
    ring_layout(1, seq, HEXISEQ_CHUNK_ZIGZAG, &l);
    hexiseq_training t;
    hexiseq_training_default(&t);
    hexiseq_device_cost per[1];
    hexiseq_plan_cost pc;
    double per_pair[2];
    for (int k = 0; k < 2; ++k) {
        int64_t each = k ? 1024 : 64, many[64];
        for (int i = 0; i < 4096 / each; ++i)
            many[i] = each;
        hexiseq_documents d;
        hexiseq_documents_init(many, 4096 / each, &d);
        t.documents = &d;
        EXPECT(hexiseq_evaluate(c, &MODEL, &t, 4096, 1, &l, per, &pc) == HEXISEQ_OK, "evaluate");
        per_pair[k] = per[0].attn_s / (double)d.tri[d.n];
        hexiseq_documents_free(&d);
    }
    EXPECT(per_pair[0] > 1.5 * per_pair[1], "short documents cost more per pair: %g vs %g s", per_pair[0], per_pair[1]);
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

static void test_refusals(void) {
    hexiseq_cluster *c = alike_cluster(2);
    const int64_t seq[2] = {64, 64};
    hexiseq_layout l;
    ring_layout(2, seq, HEXISEQ_CHUNK_ZIGZAG, &l);
    int64_t len[2] = {60, 60};
    hexiseq_documents d;
    hexiseq_documents_init(len, 2, &d);
    hexiseq_training t;
    hexiseq_training_default(&t);
    t.documents = &d;
    hexiseq_device_cost per[2];
    hexiseq_plan_cost pc;
    EXPECT(hexiseq_evaluate(c, &MODEL, &t, 128, 1, &l, per, &pc) == HEXISEQ_ERR_INVALID, "sum != seq_len");
    EXPECT(strstr(hexiseq_last_error(), "seq_len=128") && strstr(hexiseq_last_error(), "120"), "message: %s",
           hexiseq_last_error());
    hexiseq_layout out;
    hexiseq_plan_cost cost;
    EXPECT(hexiseq_plan_strategy(c, &MODEL, &t, 128, 1, HEXISEQ_STRATEGY_HEXISEQ, &out, &cost) == HEXISEQ_ERR_INVALID,
           "planner refuses a wrong sum");
    hexiseq_documents_free(&d);
    len[0] = len[1] = 64;
    hexiseq_documents_init(len, 2, &d);
    EXPECT(hexiseq_evaluate(c, &MODEL, &t, 128, 0, &l, per, &pc) == HEXISEQ_ERR_INVALID, "non-causal refused");
    EXPECT(strstr(hexiseq_last_error(), "causal") != NULL, "message: %s", hexiseq_last_error());
    hexiseq_documents_free(&d);
    hexiseq_layout_free(&l);
    hexiseq_cluster_destroy(c);
}

/* Mixed cluster, a batch of many short documents: the plan made for the documents is predicted at least as
 * fast under them as the plan made for one causal document; and a batch of one long document plans the
 * zigzag. */
static void test_scheduler(void) {
    hexiseq_node_desc nodes[2] = {{"H100-SXM", 4, 450.0, 0, 0, 0, 0, 0}, {"L40S", 4, 32.0, 0, 0, 0, 0, 0}};
    hexiseq_cluster *c = NULL;
    EXPECT(hexiseq_cluster_create(2, nodes, 25.0, NULL, &c) == HEXISEQ_OK, "cluster: %s", hexiseq_last_error());
    const hexiseq_model m = {8, 4096, 32, 8, 128, 11008, 32000, 2, 1, 0, 0, 0, 0};
    const int64_t S = 131072;
    int64_t *len = malloc((size_t)S * sizeof *len);
    int64_t n = 0;
    for (int64_t left = S; left > 0; left -= len[n++])
        len[n] = left < 1000 + (n % 7) * 300 ? left : 1000 + (n % 7) * 300;
    hexiseq_documents d;
    hexiseq_documents_init(len, n, &d);
    hexiseq_training t;
    hexiseq_training_default(&t);
    t.checkpointing = 1;
    hexiseq_layout plain, aware;
    hexiseq_plan_cost pc, ac, pd;
    EXPECT(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &plain, &pc) == HEXISEQ_OK, "plain: %s",
           hexiseq_last_error());
    EXPECT(plain.chunking == HEXISEQ_CHUNK_ZIGZAG, "one causal document plans zigzag chunks");
    t.documents = &d;
    EXPECT(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &aware, &ac) == HEXISEQ_OK, "aware: %s",
           hexiseq_last_error());
    hexiseq_device_cost per[8];
    EXPECT(hexiseq_evaluate(c, &m, &t, S, 1, &plain, per, &pd) == HEXISEQ_OK, "plain under documents");
    EXPECT(ac.step_time_s <= pd.step_time_s * (1 + 1e-12), "aware %.6g s, one-document plan under documents %.6g s",
           ac.step_time_s, pd.step_time_s);
    EXPECT(ac.step_time_s < pc.step_time_s, "documents have fewer pairs than one causal document");
    /* a time limit that ends the search inside the one-document plan still gives a plan */
    hexiseq_plan_options opt = {1e-9, NULL, NULL};
    hexiseq_plan_info info;
    hexiseq_layout quick;
    hexiseq_plan_cost qc;
    EXPECT(hexiseq_plan_strategy_ex(c, &m, &t, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &opt, &quick, &qc, &info) == HEXISEQ_OK,
           "time-limited plan: %s", hexiseq_last_error());
    EXPECT(info.stopped_early && qc.fits, "stopped early with a plan that fits");
    hexiseq_layout_free(&quick);
    printf("%lld documents: aware plan %.4f s (%s chunks), plan for one document %.4f s under them (%.3fx)\n",
           (long long)n, ac.step_time_s, aware.chunking ? "contiguous" : "zigzag", pd.step_time_s,
           pd.step_time_s / ac.step_time_s);
    hexiseq_layout_free(&plain);
    hexiseq_layout_free(&aware);
    hexiseq_documents_free(&d);
    free(len);
    hexiseq_cluster_destroy(c);
}

/* Re-balancing keeps the structure (groups, members, heads, order), re-splits the sequence for new documents,
 * and is never predicted slower than the layout it starts from. */
static void test_rebalance(void) {
    hexiseq_node_desc nodes[2] = {{"H100-SXM", 4, 450.0, 0, 0, 0, 0, 0}, {"L40S", 4, 32.0, 0, 0, 0, 0, 0}};
    hexiseq_cluster *c = NULL;
    hexiseq_cluster_create(2, nodes, 25.0, NULL, &c);
    const hexiseq_model m = {8, 4096, 32, 8, 128, 11008, 32000, 2, 1, 0, 0, 0, 0};
    const int64_t S = 65536;
    int64_t *len = malloc((size_t)S * sizeof *len);
    hexiseq_training t;
    hexiseq_training_default(&t);
    t.checkpointing = 1;
    hexiseq_layout base, re, full;
    hexiseq_plan_cost bc, rc, fc, kept;
    hexiseq_device_cost per[8];
    /* the structure of the plan for one causal document (two groups, a ring between the nodes) */
    EXPECT(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &base, &bc) == HEXISEQ_OK, "base");
    EXPECT(base.n_groups > 1, "a ring to re-balance: %d groups", base.n_groups);
    int gained = 0;
    for (int trial = 0; trial < 3; ++trial) {
        hexiseq_documents d[1];
        int64_t n = 0;
        for (int64_t left = S; left > 0; left -= len[n++]) { /* short, long, mixed */
            int64_t want = trial == 0 ? 300 + rand_below(500) : trial == 1 ? 8000 + rand_below(9000)
                                                                           : (n ? 200 : S / 2); /* front-heavy */
            len[n] = left < want ? left : want;
        }
        hexiseq_documents_init(len, n, &d[0]);
        t.documents = &d[0];
        EXPECT(hexiseq_evaluate(c, &m, &t, S, 1, &base, per, &kept) == HEXISEQ_OK, "base under documents");
        EXPECT(hexiseq_rebalance(c, &m, &t, S, 1, &base, &re, &rc) == HEXISEQ_OK, "rebalance: %s", hexiseq_last_error());
        EXPECT(hexiseq_plan_strategy(c, &m, &t, S, 1, HEXISEQ_STRATEGY_HEXISEQ, &full, &fc) == HEXISEQ_OK, "full");
        EXPECT(re.n_groups == base.n_groups, "same groups");
        int same = 1;
        for (int32_t r = 0; r < base.n_devices; ++r)
            same &= re.device[r] == base.device[r] && re.head_lo[r] == base.head_lo[r] &&
                    re.head_count[r] == base.head_count[r];
        EXPECT(same, "same members, order and heads");
        EXPECT(rc.step_time_s <= kept.step_time_s, "rebalanced %.5g s, kept %.5g s", rc.step_time_s, kept.step_time_s);
        gained += rc.step_time_s < kept.step_time_s * 0.99;
        printf("rebalance, %lld documents: kept %.4f s, rebalanced %.4f s (%s), full re-plan %.4f s\n", (long long)n,
               kept.step_time_s, rc.step_time_s, re.chunking ? "contiguous" : "zigzag", fc.step_time_s);
        hexiseq_layout_free(&re);
        hexiseq_layout_free(&full);
        hexiseq_documents_free(&d[0]);
    }
    EXPECT(gained > 0, "re-balancing gains on some batch");
    /* another sequence length: the layout cannot be kept, only re-split */
    t.documents = NULL;
    EXPECT(hexiseq_rebalance(c, &m, &t, S / 2 + 7, 1, &base, &re, &rc) == HEXISEQ_OK, "new length: %s",
           hexiseq_last_error());
    int64_t sum = 0;
    for (int32_t g = 0; g < re.n_groups; ++g)
        sum += re.group_seq[g];
    EXPECT(sum == S / 2 + 7, "split of the new length: %lld", (long long)sum);
    hexiseq_layout_free(&re);
    base.group_size[0] += 1;
    EXPECT(hexiseq_rebalance(c, &m, &t, S, 1, &base, &re, &rc) == HEXISEQ_ERR_LAYOUT, "bad group sizes refused");
    hexiseq_layout_free(&base);
    free(len);
    hexiseq_cluster_destroy(c);
}

/* A measured packed-document curve prices the pairs of documents shorter than the block at its rate (flat curves:
 * attention time is pairs / rate, so a third of the rate is three times the time), and changes nothing for one
 * document as long as the sequence, nor without documents. */
static void test_document_curve(void) {
    enum { N = 3, SG = 640 };
    hexiseq_cluster *plain = alike_cluster_ex(N, 1), *doc = alike_cluster_doc(N, 1, 50.0);
    EXPECT(plain != NULL && doc != NULL, "clusters");
    if (!plain || !doc)
        return;
    int64_t seq[N], S = (int64_t)N * SG;
    for (int g = 0; g < N; ++g)
        seq[g] = SG;
    hexiseq_training t;
    hexiseq_training_default(&t);
    hexiseq_device_cost a[N], b[N];
    hexiseq_plan_cost pa, pb;
    for (int32_t chunking = 0; chunking < 2; ++chunking) {
        hexiseq_layout l;
        ring_layout(N, seq, chunking, &l);
        t.documents = NULL;
        EXPECT(hexiseq_evaluate(plain, &MODEL, &t, S, 1, &l, a, &pa) == HEXISEQ_OK &&
                   hexiseq_evaluate(doc, &MODEL, &t, S, 1, &l, b, &pb) == HEXISEQ_OK,
               "no documents: %s", hexiseq_last_error());
        EXPECT(memcmp(a, b, sizeof a) == 0 && pa.step_time_s == pb.step_time_s,
               "without documents the curve changes nothing (chunking %d)", chunking);
        int64_t shorts[S / 16], one[1] = {S};
        for (int i = 0; i < S / 16; ++i)
            shorts[i] = 16;
        hexiseq_documents d;
        for (int k = 0; k < 2; ++k) {
            hexiseq_documents_init(k ? one : shorts, k ? 1 : S / 16, &d);
            t.documents = &d;
            EXPECT(hexiseq_evaluate(plain, &MODEL, &t, S, 1, &l, a, &pa) == HEXISEQ_OK &&
                       hexiseq_evaluate(doc, &MODEL, &t, S, 1, &l, b, &pb) == HEXISEQ_OK,
                   "documents: %s", hexiseq_last_error());
            for (int r = 0; r < N; ++r) {
                double want = k ? a[r].attn_s : a[r].attn_s * 3.0; /* 150 / 50 */
                EXPECT(fabs(b[r].attn_s - want) <= 1e-12 * want, "chunking %d %s, device %d: %.15g s, want %.15g",
                       chunking, k ? "one document" : "16-token documents", r, b[r].attn_s, want);
            }
            EXPECT(pb.lower_bound_s <= pb.step_time_s, "the lower bound holds");
            hexiseq_documents_free(&d);
        }
        hexiseq_layout_free(&l);
    }
    hexiseq_cluster_destroy(plain);
    hexiseq_cluster_destroy(doc);
}

int main(void) {
    test_pairs_brute();
    test_init_refusals();
    test_steps_cover_the_mask();
    test_document_length();
    test_document_curve();
    test_refusals();
    test_scheduler();
    test_rebalance();
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
