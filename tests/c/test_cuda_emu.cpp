// The CUDA attention kernels (kernels/forward.cu, backward.cu and their headers) run on the CPU emulator
// (tests/c/cuda_emu/emu.h) and checked against the CPU kernels (csrc/attention/attention_cpu.c) in float64 on the
// same rounded inputs.
//
// This tests the kernels' logic on machines without a GPU: tiling and tile tails, causal masking by absolute
// positions (every offset case, fully masked rows and blocks), GQA/MQA, padded head dims, the vector-load and
// element-by-element paths, strides (heads-major, strided head_dim, negative, misaligned), the online softmax
// and LSE, the backward's accumulators and dQ atomics, accumulate, the merge, the document mask, the sliding window and
// logit soft-capping (against a brute-force float64 reference, test_documents and test_window_softcap, in
// test_cuda_emu_masks.inc). Every case runs under four thread schedules (lockstep, run-ahead from either end,
// pseudo-random; see emu.h) and must give bit-identical outputs: a difference is a race between two barriers. What it
// cannot test: speed, hardware memory ordering,
// a misreading of the PTX fragment layouts shared by the kernels and the emulator, and anything only a GPU
// does (tests/test_cuda_ops.py, on a GPU).
//
// Error measure: max |x - ref| / max |ref| over a tensor (see rel_err). Tolerances, with u the unit roundoff
// of the storage type (bf16 2^-8, fp16 2^-11): the kernels keep P and dS in the storage type before the
// tensor-core products (as FlashAttention does), so each output carries that rounding (relative u/2 per term,
// partly averaging out) plus its own final rounding (u/2): the forward must be within 3u, the gradients (two
// rounded operands per product, and D = rowsum(dO O) taken from the rounded O) within 6u. LSE is fp32 from
// fp32 scores: within 1e-4 of max(1, |lse|). A masking off-by-one moves whole rows by O(1) and fails these by
// far; the observed errors are 0.5u to 1.5u.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <string>
#include <vector>

#include "attention.h"
#include "check.h"
#include "cuda_emu/emu.h"
#include "launch.h"

namespace {

uint64_t rng_state = 0x243f6a8885a308d3ull;
double urand() { // uniform in [-1, 1)
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1.0p-52 - 1.0;
}

uint16_t to_bits(int dtype, double x) {
    return dtype == HEXISEQ_DTYPE_F16 ? hexiseq_f32_to_f16((float)x) : hexiseq_f32_to_bf16((float)x);
}
double from_bits(int dtype, uint16_t b) {
    return dtype == HEXISEQ_DTYPE_F16 ? hexiseq_f16_to_f32(b) : hexiseq_bf16_to_f32(b);
}
double unit_roundoff(int dtype) { return dtype == HEXISEQ_DTYPE_F16 ? 0x1.0p-11 : 0x1.0p-8; }

// How a [B, S, H, D] tensor lies in memory. MIXED_K and MIXED_Q give each tensor its own layout (see for_role):
// the kernels decide per tensor whether 16-byte (and cp.async) loads are legal.
enum Layout { CONTIG, HEADS_MAJOR, COL_STRIDE2, NEG_SEQ, MISALIGNED, MIXED_K, MIXED_Q };
const char *layout_name(Layout l) {
    static const char *names[] = {"contig", "heads-major", "col-stride-2", "neg-seq", "misaligned", "mixed-k",
                                  "mixed-q"};
    return names[l];
}
enum Role { Q, K, V, DO, O, DQ, DK, DV };
Layout for_role(Layout l, Role r) {
    static const Layout mixed_k[] = {CONTIG, COL_STRIDE2, CONTIG, HEADS_MAJOR, NEG_SEQ, MISALIGNED, HEADS_MAJOR, CONTIG};
    static const Layout mixed_q[] = {MISALIGNED, HEADS_MAJOR, NEG_SEQ, COL_STRIDE2, CONTIG, CONTIG, NEG_SEQ, MISALIGNED};
    return l == MIXED_K ? mixed_k[r] : l == MIXED_Q ? mixed_q[r] : l;
}

// A 16-bit [B, S, H, D] tensor in some layout; `ref` holds its values (as stored) contiguously in float64.
struct Half4 {
    int dtype;
    int64_t n[4];
    int64_t st[4];
    int64_t off = 0;
    std::vector<uint16_t> mem;
    uint16_t *base() { return mem.data() + off; }
    int64_t at(int64_t b, int64_t s, int64_t h, int64_t c) const {
        return off + b * st[0] + s * st[1] + h * st[2] + c * st[3];
    }
    int64_t count() const { return n[0] * n[1] * n[2] * n[3]; }
    int64_t lin(int64_t b, int64_t s, int64_t h, int64_t c) const { return ((b * n[1] + s) * n[2] + h) * n[3] + c; }

    Half4(int dtype_, int64_t B, int64_t S, int64_t H, int64_t D, Layout layout) : dtype(dtype_), n{B, S, H, D} {
        int64_t total = B * S * H * D;
        switch (layout) {
        case HEADS_MAJOR: st[0] = H * S * D, st[1] = D, st[2] = S * D, st[3] = 1; break;
        case COL_STRIDE2: st[0] = 2 * S * H * D, st[1] = 2 * H * D, st[2] = 2 * D, st[3] = 2, total *= 2; break;
        case NEG_SEQ: st[0] = S * H * D, st[1] = -H * D, st[2] = D, st[3] = 1, off = (S - 1) * H * D; break;
        case MISALIGNED: st[0] = S * H * D, st[1] = H * D, st[2] = D, st[3] = 1, off = 1, total += 1; break;
        default: st[0] = S * H * D, st[1] = H * D, st[2] = D, st[3] = 1; break;
        }
        mem.assign((size_t)std::max<int64_t>(total, 1), to_bits(dtype, NAN)); // untouched elements are NaN
    }
    void fill_random(std::vector<double> &ref, double amp = 1.0) { // values amp * uniform[-1, 1), rounded
        ref.resize((size_t)count());
        for (int64_t b = 0; b < n[0]; ++b)
            for (int64_t s = 0; s < n[1]; ++s)
                for (int64_t h = 0; h < n[2]; ++h)
                    for (int64_t c = 0; c < n[3]; ++c) {
                        const uint16_t bits = to_bits(dtype, amp * urand());
                        mem[(size_t)at(b, s, h, c)] = bits;
                        ref[(size_t)lin(b, s, h, c)] = from_bits(dtype, bits);
                    }
    }
    std::vector<double> values() const {
        std::vector<double> out((size_t)count());
        for (int64_t b = 0; b < n[0]; ++b)
            for (int64_t s = 0; s < n[1]; ++s)
                for (int64_t h = 0; h < n[2]; ++h)
                    for (int64_t c = 0; c < n[3]; ++c)
                        out[(size_t)lin(b, s, h, c)] = from_bits(dtype, mem[(size_t)at(b, s, h, c)]);
        return out;
    }
};

void contiguous_strides(int64_t st[4], int64_t S, int64_t H, int64_t D) {
    st[3] = 1, st[2] = D, st[1] = H * D, st[0] = S * H * D;
}

// The eight [b, s, h, d] stride arrays of a params struct, in its field order.
void set_strides(hexiseq_attn_params &p, const int64_t *q, const int64_t *k, const int64_t *v, const int64_t *o,
                 const int64_t *dout, const int64_t *dq, const int64_t *dk, const int64_t *dv) {
    int64_t *dst[] = {p.q_stride, p.k_stride, p.v_stride, p.o_stride, p.do_stride, p.dq_stride, p.dk_stride, p.dv_stride};
    const int64_t *src[] = {q, k, v, o, dout, dq, dk, dv};
    for (int i = 0; i < 8; ++i)
        memcpy(dst[i], src[i], 4 * sizeof(int64_t));
}

// max |x - ref| / max(max |ref|, 1e-3); NaN anywhere gives +inf. The floor keeps tensors whose exact value
// is zero but whose float64 reference is not quite (one key: dS = P (dP - D) = 0 up to rounding) meaningful;
// the inputs are O(1), so 1e-3 is far below any real gradient. Exact zeros are checked separately.
double rel_err(const std::vector<double> &x, const std::vector<double> &ref) {
    double num = 0, den = 1e-3;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (std::isnan(x[i]))
            return INFINITY;
        num = std::max(num, fabs(x[i] - ref[i]));
        den = std::max(den, fabs(ref[i]));
    }
    return num / den;
}

struct Case {
    int dtype;
    int64_t batch, seq_q, seq_k;
    int heads, kv_heads, head_dim;
    int causal;
    int64_t q_pos0, k_pos0;
    Layout layout;
    int lse_transposed; // LSE stored [batch][seq][heads] instead of [batch][heads][seq]
    int accumulate;     // backward adds into preset gradients
    int docs = 0;       // document mask (Docs below); 0: none
    int window = 0;     // sliding window (hexiseq_attn_params): 1 with the bounds below (-1: none on that side)
    int64_t wl = -1, wr = -1;
    double cap = 0;     // logit soft-capping; 0: none
    double amp = 1;     // q and k drawn from amp * uniform[-1, 1): larger scores, so that soft-capping bites
};

// Document layouts of the document-masked cases, over absolute positions from 0 (each batch row its own draw).
enum Docs {
    DOCS_NONE = 0,
    DOCS_RANDOM,    // random lengths 1..40 (length-1 documents included)
    DOCS_ONES,      // every document one token: each query sees only its own key
    DOCS_TILE_EDGE, // boundaries at 64, 128, 160, 192, 320: tile edges of every kernel (16 to 128 rows or keys)
    DOCS_ONE,       // one document over everything: must equal the plain causal result bit for bit
    DOCS_NAN_SKIP,  // [0, 130), [130, 330), [330, ..): with NaN in the keys and values before 128 (see nan_keys)
    DOCS_LONG,      // random lengths 1..250: documents that reach from a query block back into an earlier key block
};
const char *docs_name(int d) {
    static const char *names[] = {"",           " docs-random",   " docs-ones", " docs-tile-edge",
                                  " docs-one", " docs-nan-skip", " docs-long"};
    return names[d];
}
// Key rows [0, nan_keys(c)) hold NaN: under DOCS_NAN_SKIP every query's document starts at or after 130 and the keys
// are at positions 0.., so those rows lie in key tiles (of 32 to 128 keys) that no query tile sees. They must be
// neither loaded into a product nor reach any output.
int64_t nan_keys(const Case &c) { return c.docs == DOCS_NAN_SKIP ? 128 : 0; }

// q_doc [batch][seq_q] of a case: the start of the document holding each query's absolute position.
std::vector<int64_t> document_starts(const Case &c) {
    std::vector<int64_t> out;
    if (c.docs == DOCS_NONE)
        return out;
    const int64_t end = c.q_pos0 + c.seq_q;
    for (int64_t b = 0; b < c.batch; ++b) {
        std::vector<int64_t> start_of((size_t)end);
        int64_t s = 0, len = 0;
        static const int64_t edges[] = {64, 128, 160, 192, 320}, nan_docs[] = {130, 330};
        for (int64_t x = 0; x < end; ++x) {
            bool cut = false;
            switch (c.docs) {
            case DOCS_RANDOM:
            case DOCS_LONG:
                if (x == s + len) {
                    cut = true;
                    const int64_t longest = c.docs == DOCS_LONG ? 250 : 40;
                    len = 1 + (int64_t)((urand() + 1) * 0.5 * (double)longest) % longest;
                }
                break;
            case DOCS_ONES: cut = true; break;
            case DOCS_TILE_EDGE: cut = std::find(std::begin(edges), std::end(edges), x) != std::end(edges); break;
            case DOCS_NAN_SKIP: cut = std::find(std::begin(nan_docs), std::end(nan_docs), x) != std::end(nan_docs); break;
            default: break;
            }
            if (cut)
                s = x;
            start_of[(size_t)x] = s;
        }
        for (int64_t i = 0; i < c.seq_q; ++i)
            out.push_back(start_of[(size_t)(c.q_pos0 + i)]);
    }
    return out;
}

std::string describe(const Case &c) {
    char buf[320], extra[96] = "";
    if (c.window)
        snprintf(extra, sizeof extra, " win(%lld,%lld)", (long long)c.wl, (long long)c.wr);
    if (c.cap > 0)
        snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " cap%g amp%g", c.cap, c.amp);
    snprintf(buf, sizeof buf, "%s B%lld Sq%lld Sk%lld H%d/%d d%d %s qp%lld kp%lld %s%s%s%s%s",
             c.dtype == HEXISEQ_DTYPE_F16 ? "f16" : "bf16", (long long)c.batch, (long long)c.seq_q,
             (long long)c.seq_k, c.heads, c.kv_heads, c.head_dim, c.causal ? "causal" : "full", (long long)c.q_pos0,
             (long long)c.k_pos0, layout_name(c.layout), c.lse_transposed ? " lse-T" : "",
             c.accumulate ? " acc" : "", docs_name(c.docs), extra);
    return buf;
}

// Everything one emulated run produces, as float64 (LSE as stored, in [batch][heads][seq] order).
struct Outputs {
    std::vector<double> o, lse, dq, dk, dv;
    std::vector<uint16_t> raw_o, raw_dq, raw_dk, raw_dv;
    std::vector<float> raw_lse;
};

struct Problem {
    Case c;
    Half4 q, k, v, dout;
    std::vector<double> rq, rk, rv, rdo, rg_q, rg_k, rg_v; // values; preset gradients for accumulate
    std::vector<int64_t> doc;                               // q_doc [batch][seq_q]; empty: no document mask
    bool use_doc = true; // false: run the emulated kernels without the mask (the one-document comparison)
    Problem(const Case &c_)
        : c(c_), q(c.dtype, c.batch, c.seq_q, c.heads, c.head_dim, for_role(c.layout, Q)),
          k(c.dtype, c.batch, c.seq_k, c.kv_heads, c.head_dim, for_role(c.layout, K)),
          v(c.dtype, c.batch, c.seq_k, c.kv_heads, c.head_dim, for_role(c.layout, V)),
          dout(c.dtype, c.batch, c.seq_q, c.heads, c.head_dim, for_role(c.layout, DO)), doc(document_starts(c)) {
        q.fill_random(rq, c.amp);
        k.fill_random(rk, c.amp);
        v.fill_random(rv);
        dout.fill_random(rdo);
        for (Half4 *t : {&k, &v})
            for (int64_t b = 0; b < c.batch; ++b)
                for (int64_t s = 0; s < nan_keys(c); ++s)
                    for (int64_t h = 0; h < c.kv_heads; ++h)
                        for (int64_t x = 0; x < c.head_dim; ++x) {
                            t->mem[(size_t)t->at(b, s, h, x)] = to_bits(c.dtype, NAN);
                            (t == &k ? rk : rv)[(size_t)t->lin(b, s, h, x)] = NAN;
                        }
    }

    // Brute-force float64 attention straight from the definitions (csrc/attention/attention.h), not from the kernels'
    // canonical form: key j visible to query i iff every mask the case has allows it, causal (k_pos0 + j <= q_pos0 + i),
    // document (doc[b, i] <= k_pos0 + j) and window ((q_pos0 + i) - (k_pos0 + j) <= wl, (k_pos0 + j) - (q_pos0 + i) <= wr,
    // each when >= 0); soft-capping turns each score x into cap tanh(x / cap). Only visible keys are read (NaN keys are
    // not). The backward is the exact gradient of that forward (D from the float64 O; dS times 1 - tanh^2 when capped).
    void reference_brute(Outputs &r) {
        const int64_t B = c.batch, Sq = c.seq_q, Sk = c.seq_k, H = c.heads, G = c.heads / c.kv_heads, Dh = c.head_dim;
        const int64_t nq = B * Sq * H * Dh, nk = B * Sk * c.kv_heads * Dh;
        r.o.assign((size_t)nq, 0), r.lse.assign((size_t)(B * H * Sq), -INFINITY);
        r.dq = c.accumulate ? rg_q : std::vector<double>((size_t)nq, 0.0);
        r.dk = c.accumulate ? rg_k : std::vector<double>((size_t)nk, 0.0);
        r.dv = c.accumulate ? rg_v : std::vector<double>((size_t)nk, 0.0);
        auto qi = [&](int64_t b, int64_t i, int64_t h, int64_t x) { return (size_t)(((b * Sq + i) * H + h) * Dh + x); };
        auto ki = [&](int64_t b, int64_t j, int64_t h, int64_t x) {
            return (size_t)(((b * Sk + j) * c.kv_heads + h / G) * Dh + x);
        };
        auto visible = [&](int64_t b, int64_t i, int64_t j) {
            const int64_t qp = c.q_pos0 + i, kp = c.k_pos0 + j;
            if (c.causal && kp > qp)
                return false;
            if (!doc.empty() && kp < doc[(size_t)(b * Sq + i)])
                return false;
            if (c.window && c.wl >= 0 && qp - kp > c.wl)
                return false;
            return !(c.window && c.wr >= 0 && kp - qp > c.wr);
        };
        std::vector<double> pr((size_t)Sk), th((size_t)Sk); // per visible key: score then p; tanh of the capped score
        std::vector<int64_t> keys;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t i = 0; i < Sq; ++i) {
                    keys.clear();
                    for (int64_t j = 0; j < Sk; ++j)
                        if (visible(b, i, j))
                            keys.push_back(j);
                    if (keys.empty())
                        continue; // sees nothing: O = 0, LSE = -inf, no gradient
                    double mx = -INFINITY;
                    for (int64_t j : keys) {
                        double dot = 0;
                        for (int64_t x = 0; x < Dh; ++x)
                            dot += rq[qi(b, i, h, x)] * rk[ki(b, j, h, x)];
                        double y = dot * scale();
                        if (c.cap > 0) {
                            th[(size_t)j] = tanh(y / c.cap);
                            y = c.cap * th[(size_t)j];
                        }
                        pr[(size_t)j] = y;
                        mx = std::max(mx, y);
                    }
                    double sum = 0;
                    for (int64_t j : keys)
                        sum += (pr[(size_t)j] = exp(pr[(size_t)j] - mx));
                    r.lse[(size_t)((b * H + h) * Sq + i)] = mx + log(sum);
                    double dd = 0; // D = rowsum(dO * O)
                    for (int64_t x = 0; x < Dh; ++x) {
                        double o = 0;
                        for (int64_t j : keys)
                            o += pr[(size_t)j] / sum * rv[ki(b, j, h, x)];
                        r.o[qi(b, i, h, x)] = o;
                        dd += o * rdo[qi(b, i, h, x)];
                    }
                    for (int64_t j : keys) {
                        const double pj = pr[(size_t)j] / sum;
                        double dp = 0;
                        for (int64_t x = 0; x < Dh; ++x)
                            dp += rdo[qi(b, i, h, x)] * rv[ki(b, j, h, x)];
                        double ds = pj * (dp - dd) * scale();
                        if (c.cap > 0)
                            ds *= 1 - th[(size_t)j] * th[(size_t)j];
                        for (int64_t x = 0; x < Dh; ++x) {
                            r.dv[ki(b, j, h, x)] += pj * rdo[qi(b, i, h, x)];
                            r.dq[qi(b, i, h, x)] += ds * rk[ki(b, j, h, x)];
                            r.dk[ki(b, j, h, x)] += ds * rq[qi(b, i, h, x)];
                        }
                    }
                }
    }

    // twice the usual 1/sqrt(d): peaked softmax rows, so a wrong max or rescale shows
    double scale() const { return 2.0 / sqrt((double)c.head_dim); }

    int64_t lse_at(int64_t b, int64_t h, int64_t s) const {
        return c.lse_transposed ? (b * c.seq_q + s) * c.heads + h : (b * c.heads + h) * c.seq_q + s;
    }
    void lse_strides(int64_t ls[3]) const {
        if (c.lse_transposed)
            ls[0] = c.seq_q * c.heads, ls[1] = 1, ls[2] = c.heads;
        else
            ls[0] = c.heads * c.seq_q, ls[1] = c.seq_q, ls[2] = 1;
    }

    hexiseq_attn_params base_params() const {
        hexiseq_attn_params p;
        memset(&p, 0, sizeof p);
        p.batch = c.batch, p.seq_q = c.seq_q, p.seq_k = c.seq_k, p.q_pos0 = c.q_pos0, p.k_pos0 = c.k_pos0;
        p.scale = scale(), p.heads = c.heads, p.kv_heads = c.kv_heads, p.head_dim = c.head_dim;
        p.causal = c.causal;
        p.window = c.window, p.window_left = c.wl, p.window_right = c.wr, p.softcap = c.cap;
        return p;
    }

    // float64 reference through the CPU kernels: O, LSE, and the gradients given dO (accumulate adds presets).
    void reference(Outputs &r) {
        const int64_t nq = c.batch * c.seq_q * c.heads * c.head_dim, nk = c.batch * c.seq_k * c.kv_heads * c.head_dim;
        r.o.assign((size_t)nq, 0);
        r.lse.assign((size_t)(c.batch * c.heads * c.seq_q), 0);
        hexiseq_attn_params p = base_params();
        p.dtype = HEXISEQ_DTYPE_F64;
        p.q = rq.data(), p.k = rk.data(), p.v = rv.data(), p.o = r.o.data(), p.lse = r.lse.data();
        int64_t qst[4], kst[4];
        contiguous_strides(qst, c.seq_q, c.heads, c.head_dim);
        contiguous_strides(kst, c.seq_k, c.kv_heads, c.head_dim);
        set_strides(p, qst, kst, kst, qst, qst, qst, kst, kst);
        p.lse_stride[0] = c.heads * c.seq_q, p.lse_stride[1] = c.seq_q, p.lse_stride[2] = 1;
        EXPECT(hexiseq_attn_forward_cpu(&p) == HEXISEQ_OK, "reference forward: %s", hexiseq_last_error());
        r.dq = c.accumulate ? rg_q : std::vector<double>((size_t)nq, 0.0);
        r.dk = c.accumulate ? rg_k : std::vector<double>((size_t)nk, 0.0);
        r.dv = c.accumulate ? rg_v : std::vector<double>((size_t)nk, 0.0);
        p.do_ = rdo.data(), p.dq = r.dq.data(), p.dk = r.dk.data(), p.dv = r.dv.data();
        p.accumulate = c.accumulate;
        EXPECT(hexiseq_attn_backward_cpu(&p) == HEXISEQ_OK, "reference backward: %s", hexiseq_last_error());
    }

    // The emulated CUDA forward, then the backward from that forward's own O and LSE (as in training).
    // Gradient presets for accumulate are drawn once (first call) and reused.
    void emulated(Outputs &r) {
        Half4 o(c.dtype, c.batch, c.seq_q, c.heads, c.head_dim, for_role(c.layout, O));
        Half4 dq(c.dtype, c.batch, c.seq_q, c.heads, c.head_dim, for_role(c.layout, DQ));
        Half4 dk(c.dtype, c.batch, c.seq_k, c.kv_heads, c.head_dim, for_role(c.layout, DK));
        Half4 dv(c.dtype, c.batch, c.seq_k, c.kv_heads, c.head_dim, for_role(c.layout, DV));
        std::vector<float> lse((size_t)(c.batch * c.heads * c.seq_q), NAN);
        hexiseq_attn_params p = base_params();
        p.dtype = c.dtype;
        p.q = q.base(), p.k = k.base(), p.v = v.base(), p.o = o.base(), p.lse = lse.data();
        set_strides(p, q.st, k.st, v.st, o.st, dout.st, dq.st, dk.st, dv.st);
        lse_strides(p.lse_stride);
        if (!doc.empty() && use_doc) {
            p.q_doc = doc.data(), p.q_doc_stride[0] = c.seq_q, p.q_doc_stride[1] = 1;
            if (c.batch == 1) // one layout for the batch: a repeated row
                p.q_doc_stride[0] = 0;
        }
        EXPECT(hexiseq_attn_forward_cuda(&p, nullptr) == HEXISEQ_OK, "emulated forward %s: %s",
               describe(c).c_str(), hexiseq_last_error());
        if (c.accumulate) {
            if (rg_q.empty()) {
                dq.fill_random(rg_q);
                dk.fill_random(rg_k);
                dv.fill_random(rg_v);
            } else {
                for (Half4 *t : {&dq, &dk, &dv}) {
                    const std::vector<double> &src = t == &dq ? rg_q : t == &dk ? rg_k : rg_v;
                    for (int64_t b = 0; b < t->n[0]; ++b)
                        for (int64_t s = 0; s < t->n[1]; ++s)
                            for (int64_t h = 0; h < t->n[2]; ++h)
                                for (int64_t x = 0; x < t->n[3]; ++x)
                                    t->mem[(size_t)t->at(b, s, h, x)] = to_bits(c.dtype, src[(size_t)t->lin(b, s, h, x)]);
                }
            }
        }
        p.do_ = dout.base(), p.dq = dq.base(), p.dk = dk.base(), p.dv = dv.base();
        p.accumulate = c.accumulate;
        EXPECT(hexiseq_attn_backward_cuda(&p, nullptr) == HEXISEQ_OK, "emulated backward %s: %s",
               describe(c).c_str(), hexiseq_last_error());
        r.o = o.values(), r.dq = dq.values(), r.dk = dk.values(), r.dv = dv.values();
        r.lse.assign(lse.size(), 0);
        for (int64_t b = 0; b < c.batch; ++b)
            for (int64_t h = 0; h < c.heads; ++h)
                for (int64_t s = 0; s < c.seq_q; ++s)
                    r.lse[(size_t)((b * c.heads + h) * c.seq_q + s)] = lse[(size_t)lse_at(b, h, s)];
        r.raw_o = o.mem, r.raw_dq = dq.mem, r.raw_dk = dk.mem, r.raw_dv = dv.mem, r.raw_lse = lse;
    }
};

double lse_err(const std::vector<double> &x, const std::vector<double> &ref) {
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (ref[i] == -INFINITY) {
            if (x[i] != -INFINITY)
                return INFINITY; // a fully masked row must say so exactly
            continue;
        }
        if (!std::isfinite(x[i]))
            return INFINITY;
        worst = std::max(worst, fabs(x[i] - ref[i]) / std::max(1.0, fabs(ref[i])));
    }
    return worst;
}

bool verbose = false;

void run_case(const Case &c) {
    const clock_t started = clock();
    Problem pr(c);
    Outputs ref, a, b;
    hexiseq_emu::set_schedule(hexiseq_emu::SCHEDULE_ROUND_ROBIN, 0);
    pr.emulated(a); // first: draws the accumulate presets the reference needs
    const bool brute = c.docs != DOCS_NONE || c.window || c.cap > 0; // masks the CPU kernels may not have
    if (brute)
        pr.reference_brute(ref);
    else
        pr.reference(ref);
    const double u = unit_roundoff(c.dtype);
    const double eo = rel_err(a.o, ref.o), el = lse_err(a.lse, ref.lse);
    const double eq = rel_err(a.dq, ref.dq), ek = rel_err(a.dk, ref.dk), ev = rel_err(a.dv, ref.dv);
    const std::string name = describe(c);
    if (verbose)
        printf("  %-64s o %.2fu lse %.1e dq %.2fu dk %.2fu dv %.2fu (%.1f s)\n", name.c_str(), eo / u, el, eq / u,
               ek / u, ev / u, (double)(clock() - started) / CLOCKS_PER_SEC);
    EXPECT(eo <= 3 * u, "%s: forward O error %.3g > 3u = %.3g", name.c_str(), eo, 3 * u);
    EXPECT(el <= 1e-4, "%s: LSE error %.3g > 1e-4", name.c_str(), el);
    EXPECT(eq <= 6 * u, "%s: dQ error %.3g > 6u = %.3g", name.c_str(), eq, 6 * u);
    EXPECT(ek <= 6 * u, "%s: dK error %.3g > 6u = %.3g", name.c_str(), ek, 6 * u);
    EXPECT(ev <= 6 * u, "%s: dV error %.3g > 6u = %.3g", name.c_str(), ev, 6 * u);

    // Fully masked rows: O exactly 0, and (brute-force reference cases) their dq exactly 0 or the preset: nothing flows.
    for (size_t i = 0; i < ref.lse.size(); ++i)
        if (ref.lse[i] == -INFINITY) {
            const int64_t s = (int64_t)(i % (size_t)c.seq_q), h = (int64_t)(i / (size_t)c.seq_q % (size_t)c.heads),
                          bb = (int64_t)(i / (size_t)c.seq_q / (size_t)c.heads);
            bool zero = true, no_grad = true;
            for (int64_t x = 0; x < c.head_dim; ++x) {
                const size_t at = (size_t)pr.q.lin(bb, s, h, x);
                zero = zero && a.o[at] == 0.0;
                no_grad = no_grad && a.dq[at] == ref.dq[at];
            }
            EXPECT(zero, "%s: fully masked row b%lld h%lld s%lld has O != 0", name.c_str(), (long long)bb,
                   (long long)h, (long long)s);
            if (brute)
                EXPECT(no_grad, "%s: fully masked row b%lld h%lld s%lld has a dq", name.c_str(), (long long)bb,
                       (long long)h, (long long)s);
        }

    // Nothing visible at all: no gradient may flow, exactly (or the presets stay exactly as they were).
    bool all_masked = true;
    for (double l : ref.lse)
        all_masked = all_masked && l == -INFINITY;
    if (all_masked)
        EXPECT(a.dq == ref.dq && a.dk == ref.dk && a.dv == ref.dv, "%s: gradients of a fully masked block are not zero",
               name.c_str());

    // One document over everything is the plain causal mask: the masked kernels must give its very bits (they
    // skip nothing and mask no element more).
    if (c.docs == DOCS_ONE) {
        pr.use_doc = false;
        pr.emulated(b);
        pr.use_doc = true;
        EXPECT(a.raw_o == b.raw_o && memcmp(a.raw_lse.data(), b.raw_lse.data(), a.raw_lse.size() * sizeof(float)) == 0 &&
                   a.raw_dq == b.raw_dq && a.raw_dk == b.raw_dk && a.raw_dv == b.raw_dv,
               "%s: one document differs from the plain causal result", name.c_str());
    }

    // The other thread schedules must give the same bits (else: a race between barriers, see emu.h).
    static const char *names[] = {"round-robin", "lowest-first", "highest-first", "random"};
#if defined(__SANITIZE_ADDRESS__)
    // the sanitizer build is there for memory errors, which the round-robin run above meets as well as any other
    // schedule (the addresses a kernel touches do not depend on the order of its threads); races are the optimised
    // build's to find, under every schedule. One run per case keeps the sanitized suite at half its time.
    const int first_schedule = hexiseq_emu::SCHEDULE_RANDOM + 1;
#else
    // the document, window and soft-capping cases are many and share the plain kernels' barriers: the random schedule
    // is enough for them
    const int first_schedule = brute ? hexiseq_emu::SCHEDULE_RANDOM : hexiseq_emu::SCHEDULE_LOWEST_FIRST;
#endif
    for (int sch = first_schedule; sch <= hexiseq_emu::SCHEDULE_RANDOM; ++sch) {
        hexiseq_emu::set_schedule((hexiseq_emu::Schedule)sch, 0x5eed0000ull + (uint64_t)c.seq_q * 131 + c.head_dim);
        pr.emulated(b);
        EXPECT(a.raw_o == b.raw_o &&
                   memcmp(a.raw_lse.data(), b.raw_lse.data(), a.raw_lse.size() * sizeof(float)) == 0,
               "%s: forward differs between the round-robin and %s schedules (a race)", name.c_str(), names[sch]);
        EXPECT(a.raw_dq == b.raw_dq && a.raw_dk == b.raw_dk && a.raw_dv == b.raw_dv,
               "%s: backward differs between the round-robin and %s schedules (a race)", name.c_str(), names[sch]);
    }
    hexiseq_emu::set_schedule(hexiseq_emu::SCHEDULE_ROUND_ROBIN, 0);
}

void test_attention_cases() {
    const int BF = HEXISEQ_DTYPE_BF16, F16 = HEXISEQ_DTYPE_F16;
    const Case cases[] = {
        // dtype B  Sq   Sk  H  Hkv d  causal qp kp  layout  lseT acc
        {BF, 1, 97, 97, 2, 1, 64, 1, 0, 0, CONTIG, 0, 0},          // odd size, GQA 2:1, vector loads
        {BF, 1, 150, 150, 6, 2, 64, 1, 0, 0, CONTIG, 0, 0},        // GQA 3:1 over two kv heads
        {F16, 1, 130, 130, 3, 3, 128, 0, 0, 0, HEADS_MAJOR, 0, 0}, // non-causal, heads-major, D=128
        {BF, 1, 1, 1, 1, 1, 64, 1, 0, 0, CONTIG, 0, 0},            // one token
        {BF, 2, 1, 77, 2, 2, 64, 1, 76, 0, CONTIG, 1, 0},          // decode-like: one query at the end
        {BF, 1, 65, 200, 2, 1, 80, 1, 150, 0, CONTIG, 0, 0},       // keys before the queries (ring: earlier block)
        {F16, 1, 97, 70, 2, 2, 20, 1, 0, 40, COL_STRIDE2, 0, 0},   // keys start inside: 40 fully masked rows
        {F16, 1, 33, 50, 1, 1, 64, 1, 0, 100, CONTIG, 0, 0},       // keys all after the queries: all masked
        {BF, 1, 130, 100, 2, 1, 64, 1, 0, 63, CONTIG, 0, 0},       // first visible row 63: last of a query tile
        {F16, 1, 100, 70, 2, 2, 128, 1, 1, 32, CONTIG, 0, 0},      // same at the 32-row tiles of the D=128 backward
        {BF, 1, 70, 45, 2, 2, 256, 1, 30, 10, NEG_SEQ, 0, 0},      // D=256, negative sequence stride
        {F16, 1, 100, 90, 4, 2, 256, 0, 0, 0, CONTIG, 0, 1},       // D=256 non-causal, GQA, cp.async, accumulate
        {BF, 1, 130, 130, 2, 1, 200, 1, 0, 0, HEADS_MAJOR, 1, 0},  // d=200 padded to 256, causal diagonal
        {F16, 2, 129, 129, 4, 1, 32, 1, 0, 0, MISALIGNED, 1, 0},   // MQA, batch 2, misaligned base
        {BF, 1, 97, 161, 2, 1, 128, 1, 64, 0, CONTIG, 0, 1},       // accumulate into preset gradients
        {F16, 1, 200, 90, 2, 1, 100, 0, 0, 0, HEADS_MAJOR, 0, 1},  // non-causal accumulate, d=100 (pad to 128)
        {BF, 1, 1025, 1025, 1, 1, 128, 1, 0, 0, CONTIG, 0, 0},     // many tiles, causal diagonal
        {BF, 2, 150, 140, 4, 2, 64, 1, 20, 0, MIXED_K, 1, 1},      // K element loads, V / Q cp.async-legal
        {F16, 1, 150, 140, 4, 2, 128, 0, 0, 0, MIXED_Q, 0, 0},     // Q, dO element loads, K legal
        // a full key tile whose last key is one past a query tile's first row: the forward's unmasked-tile test
        // must send it down the masked path (an off-by-one there passes every case above)
        {BF, 1, 200, 200, 2, 1, 64, 1, 0, 2, CONTIG, 0, 0},
        {F16, 1, 200, 200, 2, 1, 128, 1, 0, 2, CONTIG, 0, 0},
        {BF, 1, 100, 100, 1, 1, 256, 1, 0, 2, CONTIG, 0, 0},
        // odd head_dim: dQ accumulator rows of odd length, so the backward adds dQ one float at a time (even
        // head_dims add column pairs with one 8-byte reduction)
        {F16, 1, 75, 70, 2, 1, 45, 1, 0, 0, CONTIG, 0, 1},
        // the backward's 128-key tiles at D = 64 and 128 (8 warps, warp w: keys 16 w .. +15): partial last tiles
        // (72 keys, one key), causal diagonals inside a tile's second half (kp 100: the first row that sees any key
        // is row 100, and no query sees the second tile; qp 90: query row 0 sees keys 0 .. 90, the second tile from
        // row 38 on; qp 100 kp 80: key j from row j - 20 on, the second tile from row 108), GQA 2:1 and 3:1
        {BF, 1, 90, 200, 2, 1, 64, 0, 0, 0, CONTIG, 0, 0},
        {F16, 1, 70, 129, 2, 2, 128, 1, 60, 0, CONTIG, 0, 0},
        {BF, 1, 140, 260, 2, 1, 64, 1, 0, 100, CONTIG, 0, 0},
        {F16, 1, 100, 250, 2, 2, 128, 1, 90, 0, HEADS_MAJOR, 0, 1},
        {BF, 1, 150, 180, 6, 2, 128, 1, 100, 80, MIXED_Q, 1, 0},
        // the staged backward's 64-row query tiles: first visible row 63 (the last of a tile) at D = 128, and one
        // step whose rows past nq meet keys past nk (seq_q 65, seq_k 129: one row and one key in the last tiles)
        {F16, 1, 140, 100, 2, 1, 128, 1, 0, 63, CONTIG, 0, 0},
        {BF, 1, 65, 129, 3, 1, 128, 0, 0, 0, MIXED_K, 1, 1},
    };
    // An sm_90 device (227 KiB of opt-in shared memory): the D = 128 backward runs the staged kernel, D = 64 and 256
    // the register kernel.
    hexiseq_emu::set_smem_optin_limit(227 * 1024);
    for (const Case &c : cases)
        run_case(c);
    // The staged kernel at D = 64 (HEXISEQ_CUDA_BACKWARD=staged; not the default there, so a few cases: odd sizes
    // with GQA, a padded head dim with element loads and keys starting inside, MQA on a misaligned base, mixed
    // loads with accumulate, partial 128-key tiles).
    const Case staged64[] = {
        {BF, 1, 97, 97, 2, 1, 64, 1, 0, 0, CONTIG, 0, 0},
        {F16, 1, 97, 70, 2, 2, 20, 1, 0, 40, COL_STRIDE2, 0, 0},
        {F16, 2, 129, 129, 4, 1, 32, 1, 0, 0, MISALIGNED, 1, 0},
        {BF, 2, 150, 140, 4, 2, 64, 1, 20, 0, MIXED_K, 1, 1},
        {BF, 1, 140, 260, 2, 1, 64, 1, 0, 100, CONTIG, 0, 0},
    };
    setenv("HEXISEQ_CUDA_BACKWARD", "staged", 1);
    for (const Case &c : staged64)
        run_case(c);
    unsetenv("HEXISEQ_CUDA_BACKWARD");
    // The backward's split of a GQA group's query heads over CTAs: small cases take the whole group apart (one query
    // head per CTA, dK and dV summed in fp32 by attn_bwd_dkv_kernel); forced to 1, each CTA walks every head of its
    // group and stores dK, dV itself; forced to 2 on groups of 4 heads, two CTAs of two heads each. Both backward kernels, with
    // accumulate, documents' per-row bounds aside (test_documents runs them split by default).
    const Case gqa[] = {
        {BF, 1, 150, 150, 6, 2, 64, 1, 0, 0, CONTIG, 0, 0},
        {BF, 2, 150, 140, 4, 2, 64, 1, 20, 0, MIXED_K, 1, 1},
        {BF, 1, 150, 180, 6, 2, 128, 1, 100, 80, MIXED_Q, 1, 0},
        {F16, 1, 100, 90, 4, 2, 256, 0, 0, 0, CONTIG, 0, 1},
        {BF, 1, 65, 129, 3, 1, 128, 0, 0, 0, MIXED_K, 1, 1},
    };
    setenv("HEXISEQ_CUDA_BWD_SPLITS", "1", 1);
    for (const Case &c : gqa)
        run_case(c);
    setenv("HEXISEQ_CUDA_BWD_SPLITS", "2", 1); // groups of 4 heads in two CTAs of two heads each
    const Case halves[] = {{BF, 1, 150, 150, 8, 2, 64, 1, 0, 0, CONTIG, 0, 0},
                           {F16, 1, 130, 140, 8, 2, 128, 1, 10, 0, CONTIG, 0, 1}};
    for (const Case &c : halves)
        run_case(c);
    unsetenv("HEXISEQ_CUDA_BWD_SPLITS");
    // A key block longer than one forward piece is cut into pieces merged in double (see forward_typed); pieces of
    // 64 and 128 keys reach that path here: several pieces per block, partial last pieces, pieces no query of a
    // slice sees (causal, keys after the queries), fully masked rows, GQA, D = 256, strided and transposed outputs.
    const Case split[] = {
        {BF, 1, 97, 161, 2, 1, 64, 1, 64, 0, CONTIG, 0, 0},
        {F16, 1, 130, 200, 3, 3, 128, 0, 0, 0, HEADS_MAJOR, 1, 0},
        {F16, 1, 97, 170, 2, 2, 20, 1, 0, 40, COL_STRIDE2, 0, 0},
        {BF, 1, 70, 145, 2, 2, 256, 1, 100, 10, NEG_SEQ, 0, 0},
        {BF, 2, 150, 140, 4, 2, 64, 1, 20, 0, MIXED_K, 1, 0},
        {F16, 1, 33, 150, 1, 1, 64, 1, 0, 100, CONTIG, 0, 0},
    };
    for (const char *piece : {"64", "128"}) {
        setenv("HEXISEQ_CUDA_FORWARD_PIECE", piece, 1);
        for (const Case &c : split)
            run_case(c);
    }
    unsetenv("HEXISEQ_CUDA_FORWARD_PIECE");
    // An sm_80 device (163 KiB): the D = 128 backward runs the register kernel with 128-key tiles instead.
    hexiseq_emu::set_smem_optin_limit(166912);
    for (const Case &c : cases)
        if (c.head_dim > 64 && c.head_dim <= 128)
            run_case(c);
}

// A GPU with 99 KiB of opt-in shared memory per block (sm_86/89, e.g. L40S): the D = 128 forward and backward must
// fall back to their smaller-tile instances (forward BK = 32, 68 KiB; backward BK = 64, 73.3 KiB) instead of failing
// the launch, and the D = 64 backward (BK = 128, 90.5 KiB) fits as it is; forward and backward as above.
void test_small_smem_device() {
    const int BF = HEXISEQ_DTYPE_BF16, F16 = HEXISEQ_DTYPE_F16;
    const Case cases[] = {
        {F16, 1, 200, 200, 2, 1, 128, 1, 0, 2, CONTIG, 0, 0},
        {BF, 1, 150, 140, 4, 2, 128, 1, 20, 0, MIXED_K, 0, 0},
        {BF, 1, 97, 97, 2, 1, 64, 1, 0, 0, CONTIG, 0, 0},
        {F16, 1, 100, 200, 2, 1, 64, 1, 110, 0, CONTIG, 0, 0},
    };
    hexiseq_emu::set_smem_optin_limit(99 * 1024);
    for (const Case &c : cases)
        run_case(c);
    hexiseq_emu::set_smem_optin_limit(166912);
}

// The merge against the CPU merge: fp32 accumulator + bf16 partials, bf16 both sides, -inf on either side.
void test_merge() {
    const int64_t B = 2, S = 37, H = 3, D = 72;
    for (int variant = 0; variant < 2; ++variant) {
        const int acc_dt = variant == 0 ? HEXISEQ_DTYPE_F32 : HEXISEQ_DTYPE_BF16, part_dt = HEXISEQ_DTYPE_BF16;
        const size_t n = (size_t)(B * S * H * D), nl = (size_t)(B * H * S);
        std::vector<float> acc32(n), lacc(nl), lpart(nl);
        std::vector<uint16_t> acc16(n), part(n);
        for (size_t i = 0; i < n; ++i) {
            acc32[i] = (float)urand();
            acc16[i] = hexiseq_f32_to_bf16(acc32[i]);
            part[i] = hexiseq_f32_to_bf16((float)urand());
        }
        for (size_t i = 0; i < nl; ++i) {
            lacc[i] = i % 7 == 0 ? -INFINITY : (float)(3 * urand());
            lpart[i] = i % 5 == 0 ? -INFINITY : (float)(3 * urand());
        }
        if (variant == 0)
            for (size_t i = 0; i < n; ++i)
                if (lacc[i / (size_t)D % nl] == -INFINITY && i % 3 == 0)
                    acc32[i] = NAN; // never read: a -inf accumulator row is replaced
        hexiseq_attn_merge_params m;
        memset(&m, 0, sizeof m);
        m.batch = B, m.seq = S, m.heads = H, m.head_dim = D, m.acc_dtype = acc_dt, m.part_dtype = part_dt;
        contiguous_strides(m.o_acc_stride, S, H, D);
        contiguous_strides(m.o_part_stride, S, H, D);
        m.lse_acc_stride[0] = m.lse_part_stride[0] = H * S;
        m.lse_acc_stride[1] = m.lse_part_stride[1] = S;
        m.lse_acc_stride[2] = m.lse_part_stride[2] = 1;
        std::vector<float> acc32_cpu = acc32, lacc_cpu = lacc;
        std::vector<uint16_t> acc16_cpu = acc16;
        m.o_part = part.data(), m.lse_part = lpart.data();
        m.o_acc = variant == 0 ? (void *)acc32_cpu.data() : (void *)acc16_cpu.data(), m.lse_acc = lacc_cpu.data();
        EXPECT(hexiseq_attn_merge_cpu(&m) == HEXISEQ_OK, "cpu merge: %s", hexiseq_last_error());
        m.o_acc = variant == 0 ? (void *)acc32.data() : (void *)acc16.data(), m.lse_acc = lacc.data();
        EXPECT(hexiseq_attn_merge_cuda(&m, nullptr) == HEXISEQ_OK, "emulated merge: %s", hexiseq_last_error());
        // Same formula in double on both: equal up to the last bit of the (float or bf16) result.
        bool same = memcmp(lacc.data(), lacc_cpu.data(), nl * sizeof(float)) == 0;
        same = same && (variant == 0 ? memcmp(acc32.data(), acc32_cpu.data(), n * sizeof(float)) == 0
                                     : acc16 == acc16_cpu);
        if (!same && variant == 0) { // allow one ulp of float (exp/log1p implementations may differ)
            same = true;
            for (size_t i = 0; i < n && same; ++i)
                same = (std::isnan(acc32[i]) && std::isnan(acc32_cpu[i])) ||
                       fabsf(acc32[i] - acc32_cpu[i]) <= 1.2e-7f * std::max(1.0f, fabsf(acc32_cpu[i]));
            for (size_t i = 0; i < nl && same; ++i)
                same = lacc[i] == lacc_cpu[i] || fabsf(lacc[i] - lacc_cpu[i]) <= 1.2e-7f * std::max(1.0f, fabsf(lacc_cpu[i]));
        }
        EXPECT(same, "merge (%s accumulator) differs from the CPU merge", variant == 0 ? "f32" : "bf16");
    }
}

// The launchers validate like the CPU entry points and refuse what the CUDA build does not serve.
void test_refusals() {
    std::vector<float> x(64 * 6, 0.0f), lse(64, 0.0f);
    hexiseq_attn_params p;
    memset(&p, 0, sizeof p);
    p.q = p.k = p.v = x.data(), p.o = x.data() + 64, p.lse = lse.data();
    p.batch = 1, p.seq_q = p.seq_k = 1, p.heads = p.kv_heads = 1, p.head_dim = 64, p.scale = 0.125;
    int64_t st[4];
    contiguous_strides(st, 1, 1, 64);
    set_strides(p, st, st, st, st, st, st, st, st);
    p.lse_stride[0] = p.lse_stride[1] = p.lse_stride[2] = 1;
    p.dtype = HEXISEQ_DTYPE_F32;
    EXPECT(hexiseq_attn_forward_cuda(&p, nullptr) == HEXISEQ_ERR_UNSUPPORTED &&
               strstr(hexiseq_last_error(), "float32") != nullptr,
           "float32 forward must be refused naming the dtype: %s", hexiseq_last_error());
    p.dtype = HEXISEQ_DTYPE_BF16;
    p.head_dim = 300;
    EXPECT(hexiseq_attn_forward_cuda(&p, nullptr) != HEXISEQ_OK && strstr(hexiseq_last_error(), "head_dim") != nullptr,
           "head_dim 300 must be refused naming the field: %s", hexiseq_last_error());
    // The kernel-choice variables: a value they do not know is refused by name, before anything runs.
    p.head_dim = 64;
    p.do_ = x.data() + 128, p.dq = x.data() + 64 * 3, p.dk = x.data() + 64 * 4, p.dv = x.data() + 64 * 5;
    setenv("HEXISEQ_CUDA_FORWARD_KEYS", "48", 1);
    EXPECT(hexiseq_attn_forward_cuda(&p, nullptr) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "HEXISEQ_CUDA_FORWARD_KEYS=48") != nullptr,
           "HEXISEQ_CUDA_FORWARD_KEYS=48 must be refused by name: %s", hexiseq_last_error());
    unsetenv("HEXISEQ_CUDA_FORWARD_KEYS");
    for (const char *bad : {"100", "0", "64k", "-64"}) {
        setenv("HEXISEQ_CUDA_FORWARD_PIECE", bad, 1);
        EXPECT(hexiseq_attn_forward_cuda(&p, nullptr) == HEXISEQ_ERR_INVALID &&
                   strstr(hexiseq_last_error(), "HEXISEQ_CUDA_FORWARD_PIECE") != nullptr,
               "HEXISEQ_CUDA_FORWARD_PIECE=%s must be refused by name: %s", bad, hexiseq_last_error());
    }
    unsetenv("HEXISEQ_CUDA_FORWARD_PIECE");
    setenv("HEXISEQ_CUDA_BACKWARD", "fast", 1);
    EXPECT(hexiseq_attn_backward_cuda(&p, nullptr) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "HEXISEQ_CUDA_BACKWARD=fast") != nullptr,
           "HEXISEQ_CUDA_BACKWARD=fast must be refused by name: %s", hexiseq_last_error());
    unsetenv("HEXISEQ_CUDA_BACKWARD");
    for (const char *bad : {"0", "two", "2x"}) {
        setenv("HEXISEQ_CUDA_BWD_SPLITS", bad, 1);
        EXPECT(hexiseq_attn_backward_cuda(&p, nullptr) == HEXISEQ_ERR_INVALID &&
                   strstr(hexiseq_last_error(), "HEXISEQ_CUDA_BWD_SPLITS") != nullptr,
               "HEXISEQ_CUDA_BWD_SPLITS=%s must be refused by name: %s", bad, hexiseq_last_error());
    }
    unsetenv("HEXISEQ_CUDA_BWD_SPLITS");
    // A document mask: its layout is checked like the CPU entry points' (it needs causal = 1; strides in range), its
    // values are not read by the checks (on a GPU they are device memory).
    const int64_t doc[1] = {0};
    p.q_doc = doc, p.causal = 0;
    for (int backward = 0; backward < 2; ++backward) {
        const hexiseq_status s = backward ? hexiseq_attn_backward_cuda(&p, nullptr) : hexiseq_attn_forward_cuda(&p, nullptr);
        EXPECT(s == HEXISEQ_ERR_INVALID && strstr(hexiseq_last_error(), "q_doc") != nullptr &&
                   strstr(hexiseq_last_error(), "causal") != nullptr,
               "q_doc without causal must be refused by the CUDA %s: %s", backward ? "backward" : "forward",
               hexiseq_last_error());
    }
    p.causal = 1, p.q_doc_stride[1] = INT64_MAX;
    EXPECT(hexiseq_attn_forward_cuda(&p, nullptr) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "q_doc_stride") != nullptr,
           "a q_doc stride out of range must be refused: %s", hexiseq_last_error());
    // A window reaching past the causal diagonal (window_right > 0 with causal = 1), and a negative softcap: refused
    // by the shared check, before anything runs.
    p.q_doc = nullptr, p.q_doc_stride[1] = 0;
    p.causal = 1, p.window = 1, p.window_left = -1, p.window_right = 3;
    for (int backward = 0; backward < 2; ++backward) {
        const hexiseq_status s = backward ? hexiseq_attn_backward_cuda(&p, nullptr) : hexiseq_attn_forward_cuda(&p, nullptr);
        EXPECT(s == HEXISEQ_ERR_INVALID && strstr(hexiseq_last_error(), "window_right") != nullptr,
               "window_right = 3 with causal = 1 must be refused by the CUDA %s: %s", backward ? "backward" : "forward",
               hexiseq_last_error());
    }
    p.window = 0, p.window_right = -1, p.softcap = -1;
    EXPECT(hexiseq_attn_forward_cuda(&p, nullptr) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "softcap") != nullptr,
           "a negative softcap must be refused: %s", hexiseq_last_error());
}

#include "test_cuda_emu_masks.inc"

} // namespace

// NaN and infinities in q or k (one entry of a 67 x 67 bf16 block, D = 64) against the float64 CPU kernels on the same
// values, plain and through the forward's key-block split: the forward's non-finite rows exactly as the reference's
// (O NaN, LSE not finite; fully masked rows still O = 0, LSE = -inf), every other row within the usual bounds. For
// gradients, rows (a query's dq, a key's dk or dv, per head) that are NaN in every component must be the same, and
// any other NaN must sit in the poisoned component (3): it reaches a gradient row there only through a zero factor
// (dS = 0 on a masked key times the NaN or infinite entry of q or k), which depends on the tiling.
void test_nonfinite() {
    struct Poison {
        const char *name;
        bool in_k;
        int64_t row;
        double value;
    };
    const Poison poisons[] = {{"q NaN", false, 40, NAN}, {"k NaN", true, 20, NAN}, {"q +inf", false, 40, INFINITY},
                              {"k +inf", true, 20, INFINITY}};
    for (const char *piece : {"", "64"})
        for (const Poison &z : poisons)
            for (int causal = 0; causal <= 1; ++causal) {
                if (*piece)
                    setenv("HEXISEQ_CUDA_FORWARD_PIECE", piece, 1);
                const Case c{HEXISEQ_DTYPE_BF16, 2, 67, 67, 4, 2, 64, causal, 0, causal ? 10 : 0, CONTIG, 0, 0};
                Problem pr(c);
                Half4 &t = z.in_k ? pr.k : pr.q;
                const int64_t head = z.in_k ? 0 : 1;
                t.mem[(size_t)t.at(0, z.row, head, 3)] = to_bits(c.dtype, z.value);
                (z.in_k ? pr.rk : pr.rq)[(size_t)t.lin(0, z.row, head, 3)] = z.value;
                Outputs ref, a;
                pr.emulated(a);
                pr.reference(ref);
                unsetenv("HEXISEQ_CUDA_FORWARD_PIECE");
                char name[96];
                snprintf(name, sizeof name, "%s %s%s", z.name, causal ? "causal" : "full", *piece ? " split" : "");
                int nan_rows = 0;
                bool same_o = true, same_lse = true, finite_close = true;
                const double u = unit_roundoff(c.dtype);
                for (size_t i = 0; i < ref.lse.size(); ++i) {
                    const bool bad = !std::isfinite(ref.lse[i]) && ref.lse[i] != -INFINITY;
                    same_lse = same_lse && (bad ? !std::isfinite(a.lse[i]) && a.lse[i] != -INFINITY
                                                : a.lse[i] == ref.lse[i] || fabs(a.lse[i] - ref.lse[i]) <= 1e-4 *
                                                                                 std::max(1.0, fabs(ref.lse[i])));
                    nan_rows += bad;
                }
                double num = 0, den = 1e-3;
                for (size_t i = 0; i < ref.o.size(); ++i) {
                    same_o = same_o && std::isnan(a.o[i]) == std::isnan(ref.o[i]);
                    if (!std::isnan(ref.o[i]) && !std::isnan(a.o[i]))
                        num = std::max(num, fabs(a.o[i] - ref.o[i])), den = std::max(den, fabs(ref.o[i]));
                }
                finite_close = num / den <= 3 * u;
                EXPECT(nan_rows > 0, "%s: the poison must reach some row", name);
                EXPECT(same_o && same_lse, "%s: forward NaN rows differ from the reference (O %d, LSE %d)", name,
                       (int)same_o, (int)same_lse);
                EXPECT(finite_close, "%s: finite forward rows error %.3g > 3u", name, num / den);
                const std::vector<double> *got[] = {&a.dq, &a.dk, &a.dv}, *want[] = {&ref.dq, &ref.dk, &ref.dv};
                for (int g = 0; g < 3; ++g) {
                    const size_t d = (size_t)c.head_dim;
                    int differ = 0, full = 0;
                    for (size_t r = 0; r < want[g]->size() / d; ++r) {
                        bool all_a = true, all_r = true;
                        for (size_t x = 0; x < d; ++x)
                            all_a = all_a && std::isnan((*got[g])[r * d + x]),
                            all_r = all_r && std::isnan((*want[g])[r * d + x]);
                        bool stray = false; // a NaN outside the poisoned component in a row that is not all NaN
                        for (size_t x = 0; x < d; ++x)
                            stray = stray || (x != 3 && std::isnan((*got[g])[r * d + x]) && !all_a);
                        differ += all_a != all_r || stray;
                        full += all_r;
                    }
                    EXPECT(full > 0 && differ == 0, "%s: d%c has %d rows whose NaN differ from the reference's (%d NaN rows)",
                           name, "qkv"[g], differ, full);
                }
            }
}

// test_cuda_emu [-v] [name ...]: every test, or only those named (refusals merge documents documents_quick
// window_softcap cases small_smem nonfinite; documents_quick, a part of documents, runs only when named).
int main(int argc, char **argv) {
    int first = 1;
    verbose = argc > 1 && strcmp(argv[1], "-v") == 0;
    first += verbose;
    const struct {
        const char *name;
        void (*run)();
    } tests[] = {{"refusals", test_refusals},   {"merge", test_merge},
                 {"documents", test_documents}, {"documents_quick", test_documents_quick},
                 {"window_softcap", test_window_softcap},
                 {"cases", test_attention_cases},
                 {"small_smem", test_small_smem_device}, {"nonfinite", test_nonfinite}};
    for (int i = first; i < argc; ++i) { // a misspelt name would otherwise run nothing and pass
        bool known = false;
        for (const auto &t : tests)
            known = known || strcmp(argv[i], t.name) == 0;
        if (!known) {
            fprintf(stderr, "test_cuda_emu: no test named '%s'\n", argv[i]);
            return 2;
        }
    }
    for (const auto &t : tests) {
        bool wanted = first >= argc && strcmp(t.name, "documents_quick") != 0; // a part of documents: by name only
        for (int i = first; i < argc; ++i)
            wanted = wanted || strcmp(argv[i], t.name) == 0;
        if (wanted)
            t.run();
    }
    // The tile pitches (row length + 16 bytes) are chosen so that no ldmatrix pays a bank conflict: checked over
    // whatever ran (a subset without ldmatrix, such as refusals alone, has nothing to count; every test has).
    const bool everything = first >= argc;
    if (everything || hexiseq_emu::ldmatrix_calls > 0) {
        printf("ldmatrix: %llu warp calls, %llu extra passes from bank conflicts\n",
               (unsigned long long)hexiseq_emu::ldmatrix_calls,
               (unsigned long long)hexiseq_emu::ldmatrix_extra_passes);
        EXPECT(hexiseq_emu::ldmatrix_calls > 0 && hexiseq_emu::ldmatrix_extra_passes == 0,
               "ldmatrix bank conflicts: %llu extra passes", (unsigned long long)hexiseq_emu::ldmatrix_extra_passes);
    }
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
