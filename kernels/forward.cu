// The CUDA attention forward kernel and its launchers (with the split of long key blocks into merged pieces), and
// the merge entry point: hexiseq_attn_forward_cuda and hexiseq_attn_merge_cuda of kernels/launch.h.
//
// Forward: register-level tensor cores (mma.sync m16n8k16 + ldmatrix, layouts documented at the
// primitives in tile.cuh). One CTA of 4 warps per (query tile of BQ rows, head, batch); each warp owns MW blocks
// of 16 rows (MW = 2, BQ = 128 at D = 64 and 128; MW = 1, BQ = 64 at D = 256, where registers allow no
// more), so each K and V fragment read from shared memory feeds MW independent mma chains. Q and each K/V
// tile (64 keys, 32 at D = 256) are staged in shared memory; S = Q K^T lands in registers, the online
// softmax (base 2, max-subtracted) runs on registers with two quad shuffles per row, the O accumulator
// stays in registers and P goes from the score registers straight into O += P V as the A operand. Under
// the causal mask the key loop stops after the last key any query of the tile sees, and the mask is
// applied only to the key tiles that need it (the last, partial one and those crossing the diagonal).
// K/V tiles are double-buffered with cp.async when their rows allow 16-byte copies (else loaded element by
// element). Not done: Hopper wgmma/TMA/warp specialisation (FlashAttention-3's techniques). A key block longer
// than kFwdPieceKeys (2^16) is split by the launcher into pieces whose fp32 partials are merged in double (the
// O and row-sum registers take every key in turn, so their fp32 error grows with the block; see forward_typed).
// Masks: the launcher rewrites the call into its canonical mask (hexiseq_attn_canonical_mask in attention.h: no
// window, or causal with a left window only), so a sliding window is one more per-row lower bound on the visible keys,
// next to the document start: both run in the lower-bound instances (LB; documents.cuh has the design), where a query
// tile walks only the key tiles from its smallest bound on. Logit soft-capping (softcap > 0) runs in instances of its
// own (CAP: cap_tanh of the scaled scores before the mask, softcap log2(e) as the exponent's factor); the plain instances
// carry neither.
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "attention.h"
#include "host.cuh"
#include "launch.h"
#include "merge.cuh"
#include "tile.cuh"

namespace {

// Forward tiles: 4 warps, each owning MW m-blocks of 16 query rows (warp w: rows 16 MW w .. 16 MW w + 16 MW - 1),
// so the CTA's query tile is BQ = 64 MW rows. Each K and V fragment read from shared memory then feeds MW
// independent mma chains: MW = 2 at D <= 128 halves the K and V fragment reads per mma and gives the scheduler
// two chains to interleave; at D = 256 the O accumulator (MW x D / 2 floats per thread) leaves no room for a second
// m-block. K/V tiles of BK keys (32 at D = 256 to keep the scores, MW x BK / 2 floats, within the budget too).
constexpr int kFwdThreads = 128;
// BK = 64 at D = 128 ran 0.97-1.10x the speed of BK = 32 on an H100 (median 1.03x; bf16, 4K-32K tokens; 6-12% faster
// before the exponent went to ex2.approx, which pushed this instance into a small spill), but needs 102 KiB of
// shared memory: GPUs whose opt-in limit is lower (sm_86/89: 99 KiB) get the BK = 32 instance (68 KiB), see
// forward_typed.
constexpr int fwd_default_bk(int D) { return D <= 128 ? 64 : 32; }
template <int D, int BK_ = fwd_default_bk(D)> struct FwdTiles {
    static constexpr int MW = D <= 128 ? 2 : 1;
    static constexpr int BQ = kFwdThreads / 32 * 16 * MW;
    static constexpr int BK = BK_;
    static constexpr int LDT = D + 8; // row pitch of the Q, K, V tiles: 16 bytes past a multiple of 128, so the
                                      // 8 rows an ldmatrix reads fall in different banks
    static constexpr int q = 0;
    static constexpr int kv = smem_round(BK * LDT * 2);  // one K or V tile
    static constexpr int k = q + smem_round(BQ * LDT * 2); // K tiles 0 and 1 (double buffer), then V 0, 1
    static constexpr int v = k + 2 * kv;
    static constexpr int bytes = v + 2 * kv;
};

// The kernels take the call's hexiseq_attn_params by value, as the caller filled it (kernel parameters live in
// constant memory, so an unused field costs nothing), and next to it what only the launch decides: the grid split,
// which tensors allow 16-byte loads, the scale in the form the exponent wants, the backward's scratch buffers.
// Together far under the 4 KiB kernel parameter limit of every target.
struct FwdLaunch {
    int64_t n_qtiles;         // query tiles per (batch, head): the grid is n_qtiles x heads x batch
    int32_t group;            // heads / kv_heads
    int32_t vec_q, vec_k, vec_v; // 16-byte loads allowed for that tensor (vec_ok)
    float scale_log2;         // scale * log2(e): scores go through exp2
    float cap_scale, cap_log2; // softcap (CAP instances only): scale / softcap, and softcap * log2(e)
};
static_assert(sizeof(hexiseq_attn_params) + sizeof(FwdLaunch) <= 4096, "kernel parameters past 4 KiB");

// One CTA per (query tile of BQ rows, head, batch). Q, then each K/V tile, are staged in shared memory; every
// warp computes S = Q K^T for its MW x 16 rows into registers (mma.sync), masks and scales it, runs the online
// softmax on its registers (a row's 4 owners are the 4 lanes of a quad: max and sum need two shuffles), rescales
// its O accumulator (registers) and adds P V with P taken straight from the score registers. O is stored as TO:
// T, or float for the partial results of a key block split into pieces (see forward_typed).
// LB: the per-row lower bound of the canonical mask (row_low in tile.cuh: the document start of p.q_doc, device
// memory, and the window's left edge) is applied. A separate instance, so that the plain kernel carries none of its
// registers: the tile's smallest and largest bound, reduced once per CTA, give the first key tile any row sees (the
// loop starts there: earlier tiles are neither loaded nor computed; under a window that is the whole saving, a query
// tile walks only the key tiles of its window) and the last that holds a bound past its first key (only up to there
// does the per-element mask compute the rows' bounds).
// CAP: logit soft-capping, also an instance of its own: each raw score s becomes t = tanh(s scale / softcap) (cap_tanh
// of tile.cuh, to a few 1e-8 absolute: tanh.approx's 2^-11 relative error would move a score by softcap 2^-11) before
// the mask, and the
// exponent's factor is softcap log2(e) instead of scale log2(e), so the softmax runs on softcap t, the capped score.
template <typename T, typename TO, int D, int BK_, bool LB, bool CAP>
__global__ void __launch_bounds__(kFwdThreads) attn_fwd_kernel(const hexiseq_attn_params p, const FwdLaunch cfg) {
    using L = FwdTiles<D, BK_>;
    constexpr int MW = L::MW, BQ = L::BQ, BK = L::BK, LDT = L::LDT;
    static_assert(D % 16 == 0 && BK % 16 == 0, "tiles are whole 16x16 mma blocks");
    extern __shared__ __align__(128) unsigned char smem[];
    T *qs = reinterpret_cast<T *>(smem + L::q); // [BQ][LDT]

    // Last query tiles first: under the causal mask they have the most keys.
    const int64_t bid = blockIdx.x;
    const int64_t qt = cfg.n_qtiles - 1 - bid % cfg.n_qtiles;
    const int32_t h = (int32_t)(bid / cfg.n_qtiles % p.heads);
    const int64_t b = bid / cfg.n_qtiles / p.heads;
    const int32_t hk = h / cfg.group;
    const int64_t q0 = qt * BQ;
    const int64_t nq = min((int64_t)BQ, p.seq_q - q0);

    // Keys past the last one any query of this tile sees are skipped (they would be masked anyway).
    int64_t kend = p.seq_k;
    if (p.causal)
        kend = min(p.seq_k, max((int64_t)0, p.q_pos0 + q0 + nq - 1 - p.k_pos0 + 1));

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = warp * 16 * MW + g; // this thread's rows in the tile: row0 + 16 mb + 8 i (m-block mb, i = 0, 1)

    // Lower bounds: every warp reduces the tile's bounds itself (the same values, so the results are CTA-uniform
    // without a barrier or shared memory). Key tiles ending before the smallest bound are skipped whole; a key tile
    // starting at or after the largest needs no per-element lower-bound mask.
    int64_t kbeg = 0, doc_hi = 0; // first key tile; the largest bound (absolute)
    if constexpr (LB) {
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        for (int r = lane; r < nq; r += 32) {
            const int64_t s = row_low(p, b, q0 + r);
            lo = min(lo, s);
            hi = max(hi, s);
        }
        for (int o = 16; o > 0; o >>= 1) {
            lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
            hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        if (lo > p.k_pos0) // no overflow: lo > k_pos0 >= 0 (a negative bound skips nothing)
            kbeg = (lo - p.k_pos0) / BK * BK;
        doc_hi = hi;
    }

    const T *qg = static_cast<const T *>(p.q) + b * p.q_stride[0] + q0 * p.q_stride[1] + h * p.q_stride[2];
    load_tile<T, BQ, D, LDT, kFwdThreads>(qs, qg, p.q_stride[1], p.q_stride[3], nq, p.head_dim, cfg.vec_q);

    float o[MW][D / 8][4]; // O rows (row0 + 16 mb, + 8) x columns 8j + 2t + {0, 1}, unnormalised
    float m[MW][2], l[MW][2]; // per row: running max (log2 units), this thread's part of the sum of exp2(x - m)
#pragma unroll
    for (int mb = 0; mb < MW; ++mb) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            o[mb][j][0] = o[mb][j][1] = o[mb][j][2] = o[mb][j][3] = 0.0f;
        m[mb][0] = m[mb][1] = -INFINITY;
        l[mb][0] = l[mb][1] = 0.0f;
    }

    // K/V tiles: with 16-byte-legal rows (the usual contiguous case) they are double-buffered with cp.async, the
    // next tile in flight while this one is used; otherwise loaded element by element into buffer 0.
    const T *kg = static_cast<const T *>(p.k) + b * p.k_stride[0] + hk * p.k_stride[2];
    const T *vg = static_cast<const T *>(p.v) + b * p.v_stride[0] + hk * p.v_stride[2];
    const bool async = cfg.vec_k && cfg.vec_v;
    auto issue = [&](int64_t k0, int buf) {
        T *kb = reinterpret_cast<T *>(smem + L::k + buf * L::kv), *vb = reinterpret_cast<T *>(smem + L::v + buf * L::kv);
        load_tile_pair_async<T, BK, D, LDT, kFwdThreads>(kb, kg + k0 * p.k_stride[1], p.k_stride[1], vb, vg + k0 * p.v_stride[1], p.v_stride[1],
                                                         min((int64_t)BK, kend - k0), p.head_dim);
        cp_async_commit();
    };
    if (async && kbeg < kend)
        issue(kbeg, 0);
    int buf = 0;
    for (int64_t k0 = kbeg; k0 < kend; k0 += BK, buf ^= async ? 1 : 0) {
        const int64_t nk = min((int64_t)BK, kend - k0);
        T *ks = reinterpret_cast<T *>(smem + L::k + buf * L::kv); // [BK][LDT]
        T *vs = reinterpret_cast<T *>(smem + L::v + buf * L::kv); // [BK][LDT]
        if (async) {
            if (k0 + BK < kend) {
                issue(k0 + BK, buf ^ 1); // into the buffer every warp finished with last iteration
                cp_async_wait<1>();      // this thread's copies of tile k0 are done
            } else {
                cp_async_wait<0>();
            }
        } else {
            load_tile<T, BK, D, LDT, kFwdThreads>(ks, kg + k0 * p.k_stride[1], p.k_stride[1], p.k_stride[3], nk, p.head_dim, false);
            load_tile<T, BK, D, LDT, kFwdThreads>(vs, vg + k0 * p.v_stride[1], p.v_stride[1], p.v_stride[3], nk, p.head_dim, false);
        }
        __syncthreads(); // Q (first pass), K, V of this tile visible to every thread

        // S = Q K^T for the warp's rows: s[mb][j] is the 16x8 block of m-block mb and keys 8j .. 8j+7. Each K
        // fragment is read once for all MW m-blocks; the Q fragments are re-read from shared memory per step
        // (holding all of Q's would take MW x D / 4 more registers).
        float s[MW][BK / 8][4];
#pragma unroll
        for (int mb = 0; mb < MW; ++mb)
#pragma unroll
            for (int j = 0; j < BK / 8; ++j)
                s[mb][j][0] = s[mb][j][1] = s[mb][j][2] = s[mb][j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[MW][4];
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
                load_a(qa[mb], qs, LDT, (warp * MW + mb) * 16, kk * 16);
#pragma unroll
            for (int j = 0; j < BK / 8; j += 2) {
                uint32_t kb[4]; // keys as columns: key blocks j and j + 1
                load_b_cols(kb, ks, LDT, 8 * j, kk * 16);
#pragma unroll
                for (int mb = 0; mb < MW; ++mb) {
                    mma16816<T>(s[mb][j], qa[mb], kb[0], kb[1]);
                    mma16816<T>(s[mb][j + 1], qa[mb], kb[2], kb[3]);
                }
            }
        }

        // Soft-capping: t = tanh(s scale / softcap), its factor softcap folded into the exponent like the scale.
        if constexpr (CAP) {
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                for (int j = 0; j < BK / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[mb][j][e] = cap_tanh(s[mb][j][e] * cfg.cap_scale);
        }

        // Mask (the scores stay unscaled: the scale is folded into the exponent's FFMA below). Only the last, partial
        // key tile and the tiles crossing the causal diagonal need the mask: a tile whose every key is present and at
        // or before the CTA's first query position is visible to every row (rows past nq hold zero-filled Q and are
        // never stored). Under a lower bound also the tiles whose first key lies before some row's bound (doc_cut).
        // The tests are CTA-uniform.
        const bool doc_cut = LB && p.k_pos0 + k0 < doc_hi;
        const bool all_visible = nk == BK && (!p.causal || p.k_pos0 + k0 + BK - 1 <= p.q_pos0 + q0) && !doc_cut;
        if (!all_visible) {
            // Key c of the tile is visible to tile row r iff c < nk and c <= diag + r (causal_diag: 32-bit).
            const int diag = causal_diag<BQ, BK>(p, q0, k0);
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    // This thread's columns are 8j + 2t + e: visible iff 8j + e <= last, a compare with a constant.
                    const int last = min((int)nk - 1, diag + row0 + 16 * mb + 8 * i) - 2 * t;
                    if (doc_cut) {
                        // and (lower bound) iff 8j + e >= first: the row's bound as a tile column, clamped to [0, BK]
                        // (a bound past the tile hides all of it, one before it nothing); rows past nq read none
                        const int r = row0 + 16 * mb + 8 * i;
                        const int64_t start = r < nq ? row_low(p, b, q0 + r) : 0, base = p.k_pos0 + k0;
                        const int first = (start > base ? (int)min((int64_t)BK, start - base) : 0) - 2 * t;
#pragma unroll
                        for (int j = 0; j < BK / 8; ++j)
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                if (8 * j + e > last || 8 * j + e < first)
                                    s[mb][j][2 * i + e] = -INFINITY;
                        continue;
                    }
#pragma unroll
                    for (int j = 0; j < BK / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (8 * j + e > last)
                                s[mb][j][2 * i + e] = -INFINITY;
                }
        }

        // Online softmax per row on scaled scores (s scale log2(e), or t softcap log2(e); the maximum of the unscaled
        // scores, scaled, is the scaled maximum since the factor is positive): maxima over the quad (the 4 lanes
        // holding a row), rescale l and O, exponentiate.
        const float sl2 = CAP ? cfg.cap_log2 : cfg.scale_log2;
#pragma unroll
        for (int mb = 0; mb < MW; ++mb) {
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int j = 0; j < BK / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    mx[e / 2] = fmaxf(mx[e / 2], s[mb][j][e]);
            float alpha[2], m_use[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
                const float m_new = fmaxf(m[mb][i], mx[i] * sl2);
                // Nothing seen yet (m_new = -inf): every p is 0 and O is still 0; use 0 to avoid inf - inf.
                m_use[i] = m_new == -INFINITY ? 0.0f : m_new;
                alpha[i] = fast_exp2(m[mb][i] - m_use[i]); // 0 when m = -inf
                m[mb][i] = m_new;
                l[mb][i] *= alpha[i];
            }
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                o[mb][j][0] *= alpha[0], o[mb][j][1] *= alpha[0];
                o[mb][j][2] *= alpha[1], o[mb][j][3] *= alpha[1];
            }
#pragma unroll
            for (int j = 0; j < BK / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[mb][j][e] = fast_exp2(s[mb][j][e] * sl2 - m_use[e / 2]); // 0 where masked
                    l[mb][e / 2] += s[mb][j][e];
                }
        }

        // O += P V: key block pair (2c, 2c + 1) of an m-block's scores is the A fragment of keys 16c .. 16c + 15;
        // each V fragment is read once for all MW m-blocks.
#pragma unroll
        for (int c = 0; c < BK / 16; ++c) {
            uint32_t pa[MW][4];
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
                a_from_c<T>(pa[mb], s[mb][2 * c], s[mb][2 * c + 1]);
#pragma unroll
            for (int j = 0; j < D / 8; j += 2) {
                uint32_t vb[4]; // output column blocks j and j + 1
                load_b_rows(vb, vs, LDT, 16 * c, 8 * j);
#pragma unroll
                for (int mb = 0; mb < MW; ++mb) {
                    mma16816<T>(o[mb][j], pa[mb], vb[0], vb[1]);
                    mma16816<T>(o[mb][j + 1], pa[mb], vb[2], vb[3]);
                }
            }
        }
        __syncthreads(); // every warp is done with this buffer before it is refilled
    }

    // Epilogue: the quad's partial sums, then O / l and LSE = (m + log2 l) ln 2, or O = 0, LSE = -inf for a row
    // that saw no key (l = 0: exp2 of -inf is exactly 0). The max ignores NaN scores (fmaxf), but exp2 of NaN is
    // NaN, so a NaN score (or +inf: inf - inf) always reaches l and O; `!(l <= 0)` lets such a row through, and
    // its O and LSE come out NaN, as in torch, never 0 and -inf.
    TO *og = static_cast<TO *>(p.o) + b * p.o_stride[0] + q0 * p.o_stride[1] + h * p.o_stride[2];
#pragma unroll
    for (int mb = 0; mb < MW; ++mb)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l[mb][i] += __shfl_xor_sync(0xffffffffu, l[mb][i], 1);
            l[mb][i] += __shfl_xor_sync(0xffffffffu, l[mb][i], 2);
            const int r = row0 + 16 * mb + 8 * i;
            if (r >= nq)
                continue;
            const bool seen = !(l[mb][i] <= 0.0f); // l > 0, or NaN
            const float inv = seen ? 1.0f / l[mb][i] : 0.0f;
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = 8 * j + 2 * t + e;
                    if (c < p.head_dim)
                        og[r * p.o_stride[1] + c * p.o_stride[3]] = from_f32<TO>(o[mb][j][2 * i + e] * inv);
                }
            if (t == 0)
                static_cast<float *>(p.lse)[b * p.lse_stride[0] + h * p.lse_stride[1] + (q0 + r) * p.lse_stride[2]] =
                    seen ? (m[mb][i] + log2f(l[mb][i])) * kLn2 : -INFINITY;
        }
}
// The query tile (BQ rows) depends on D, so the grid is sized here.
template <typename T, typename TO, int D, int BK = fwd_default_bk(D)>
hexiseq_status launch_fwd(const hexiseq_attn_params &p, FwdLaunch cfg, cudaStream_t stream) {
    using L = FwdTiles<D, BK>;
    cfg.n_qtiles = ceil_div(p.seq_q, L::BQ);
    const int64_t blocks = cfg.n_qtiles * p.heads * p.batch;
    if (blocks > INT32_MAX)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "batch * heads * ceil(seq_q / %d) = %lld CTAs exceeds the CUDA grid limit 2^31 - 1", L::BQ,
                            (long long)blocks);
    // The instance: lower bounds (document mask or window) and soft-capping each only where the call has them.
    const bool lb = p.q_doc != nullptr || p.window, cap = p.softcap > 0;
    auto kernel = lb ? (cap ? attn_fwd_kernel<T, TO, D, BK, true, true> : attn_fwd_kernel<T, TO, D, BK, true, false>)
                     : (cap ? attn_fwd_kernel<T, TO, D, BK, false, true> : attn_fwd_kernel<T, TO, D, BK, false, false>);
    return launch_with_smem(kernel, "attn_fwd_kernel", blocks, kFwdThreads, L::bytes, stream, p, cfg);
}
// One forward launch of p (a key block of at most one piece), O stored as TO; keys: HEXISEQ_CUDA_FORWARD_KEYS.
template <typename T, typename TO>
hexiseq_status launch_fwd_any(const hexiseq_attn_params &p, const char *keys, cudaStream_t stream) {
    FwdLaunch cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.group = p.heads / p.kv_heads;
    cfg.vec_q = vec_ok(p.q, p.q_stride, p.head_dim);
    cfg.vec_k = vec_ok(p.k, p.k_stride, p.head_dim);
    cfg.vec_v = vec_ok(p.v, p.v_stride, p.head_dim);
    cfg.scale_log2 = (float)(p.scale * 1.4426950408889634);
    if (p.softcap > 0) {
        cfg.cap_scale = (float)(p.scale / p.softcap);
        cfg.cap_log2 = (float)(p.softcap * 1.4426950408889634);
    }
    switch (padded_head_dim(p.head_dim)) {
    case 64: return launch_fwd<T, TO, 64>(p, cfg, stream);
    case 128:
        if (smem_optin_limit() >= FwdTiles<128>::bytes && !(keys && strcmp(keys, "32") == 0))
            return launch_fwd<T, TO, 128>(p, cfg, stream);
        return launch_fwd<T, TO, 128, 32>(p, cfg, stream);
    default: return launch_fwd<T, TO, 256>(p, cfg, stream);
    }
}

// Longest key block one forward launch takes. The kernel's O and row-sum accumulators are fp32 sums that take every
// key in turn, so their rounding error grows with the number of keys (and past 2^24 terms of equal size they stop
// counting); a longer block is cut into pieces of this many keys, each computed on its own into fp32 partials and
// merged by log-sum-exp into double accumulators (the merge kernel), rounded to the output dtype once at the end.
// HEXISEQ_CUDA_FORWARD_PIECE=<keys> (a multiple of 64) sets it, so that tests reach the split on small blocks.
constexpr int64_t kFwdPieceKeys = (int64_t)1 << 16;
// Scratch of a split forward: double accumulators and fp32 partials for a slice of the query rows at a time, at
// most about this many bytes.
constexpr int64_t kFwdSplitScratchBytes = (int64_t)256 << 20;

template <typename T> hexiseq_status forward_typed(const hexiseq_attn_params *p, cudaStream_t stream) {
    // HEXISEQ_CUDA_FORWARD_KEYS=64 or =32 forces the D = 128 key tile where it fits (to time one against the other:
    // benchmarks/bench_cuda_attention.py --fwd-keys); unset: 64 where shared memory allows.
    const char *keys = getenv("HEXISEQ_CUDA_FORWARD_KEYS");
    if (keys && *keys && strcmp(keys, "64") != 0 && strcmp(keys, "32") != 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "HEXISEQ_CUDA_FORWARD_KEYS=%s: expected 64, 32 or unset", keys);
    int64_t piece = kFwdPieceKeys;
    const char *piece_env = getenv("HEXISEQ_CUDA_FORWARD_PIECE");
    if (piece_env && *piece_env) {
        char *end = nullptr;
        const long long v = strtoll(piece_env, &end, 10);
        if (*end != '\0' || v < 64 || v % 64 != 0 || v > ((int64_t)1 << 40))
            return hexiseq_fail(HEXISEQ_ERR_INVALID,
                                "HEXISEQ_CUDA_FORWARD_PIECE=%s: expected a multiple of 64 in [64, 2^40] or unset",
                                piece_env);
        piece = v;
    }
    if (p->seq_k <= piece)
        return launch_fwd_any<T, T>(*p, keys, stream);

    // Split: per slice of query rows, piece 0 writes fp32 (O, LSE) partials straight into part, which the first merge
    // moves into the double accumulators (acc, whose LSE starts at -inf: the merge then takes the partial as it is);
    // each later piece's partial is merged in; the store kernel rounds the result into o and lse.
    const int64_t B = p->batch, H = p->heads, d = p->head_dim;
    const int64_t row_bytes = B * H * (d * (int64_t)(sizeof(double) + sizeof(float)) + 2 * (int64_t)(sizeof(double) + sizeof(float)));
    int64_t slice = std::max((int64_t)128, kFwdSplitScratchBytes / row_bytes / 128 * 128);
    slice = std::min(slice, p->seq_q);
    const size_t acc_bytes = (size_t)(B * slice * H * d) * sizeof(double);
    const size_t lacc_bytes = (size_t)(B * H * slice) * sizeof(double);
    const size_t part_bytes = (size_t)(B * slice * H * d) * sizeof(float);
    const size_t lpart_bytes = (size_t)(B * H * slice) * sizeof(float);
    auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    void *scratch = nullptr;
    cudaError_t e = cudaMallocAsync(&scratch, up(acc_bytes) + up(lacc_bytes) + up(part_bytes) + lpart_bytes, stream);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaMallocAsync of the split forward's scratch (double accumulators, fp32 partials)");
    char *base = static_cast<char *>(scratch);
    double *acc = reinterpret_cast<double *>(base);
    double *lacc = reinterpret_cast<double *>(base + up(acc_bytes));
    float *part = reinterpret_cast<float *>(base + up(acc_bytes) + up(lacc_bytes));
    float *lpart = reinterpret_cast<float *>(base + up(acc_bytes) + up(lacc_bytes) + up(part_bytes));

    hexiseq_status s = HEXISEQ_OK;
    for (int64_t q0 = 0; q0 < p->seq_q && s == HEXISEQ_OK; q0 += slice) {
        const int64_t nq = std::min(slice, p->seq_q - q0);
        // contiguous [B, nq, H, d] and [B, H, nq] strides of this slice's scratch
        const int64_t o_st[4] = {nq * H * d, H * d, d, 1}, l_st[3] = {H * nq, nq, 1};
        hexiseq_attn_merge_params m;
        memset(&m, 0, sizeof m);
        m.o_acc = acc, m.lse_acc = lacc, m.o_part = part, m.lse_part = lpart;
        memcpy(m.o_acc_stride, o_st, sizeof o_st);
        memcpy(m.o_part_stride, o_st, sizeof o_st);
        memcpy(m.lse_acc_stride, l_st, sizeof l_st);
        memcpy(m.lse_part_stride, l_st, sizeof l_st);
        m.batch = B, m.seq = nq, m.heads = (int32_t)H, m.head_dim = (int32_t)d;
        m.acc_dtype = HEXISEQ_DTYPE_F64, m.part_dtype = HEXISEQ_DTYPE_F32;
        const int64_t rows = B * H * nq;
        for (int64_t k0 = 0; k0 < p->seq_k && s == HEXISEQ_OK; k0 += piece) {
            // The piece is itself an attention call: this slice's queries against this piece's keys, its O (fp32,
            // whatever p->dtype says: the kernel's TO decides) and LSE into the contiguous partials.
            hexiseq_attn_params pp = *p;
            pp.q = static_cast<const T *>(p->q) + q0 * p->q_stride[1];
            if (p->q_doc != nullptr) // this slice's rows of the document starts (absolute: the piece needs no shift)
                pp.q_doc = p->q_doc + q0 * p->q_doc_stride[1];
            pp.seq_q = nq;
            pp.q_pos0 = p->q_pos0 + q0;
            pp.k = static_cast<const T *>(p->k) + k0 * p->k_stride[1];
            pp.v = static_cast<const T *>(p->v) + k0 * p->v_stride[1];
            pp.seq_k = std::min(piece, p->seq_k - k0);
            pp.k_pos0 = p->k_pos0 + k0;
            pp.o = part, pp.lse = lpart;
            memcpy(pp.o_stride, o_st, sizeof o_st);
            memcpy(pp.lse_stride, l_st, sizeof l_st);
            if (k0 == 0) { // acc's LSE to -inf: the first merge takes the partial as it is (acc is never read)
                HEXISEQ_LAUNCH(attn_fill_kernel, (unsigned)std::min(ceil_div(rows, kThreads), (int64_t)1 << 20),
                               kThreads, 0, stream, lacc, rows, -INFINITY);
                s = check_launch("attn_fill_kernel launch");
            }
            if (s == HEXISEQ_OK)
                s = launch_fwd_any<T, float>(pp, keys, stream);
            if (s == HEXISEQ_OK) {
                HEXISEQ_LAUNCH(attn_merge_kernel, (unsigned)ceil_div(rows, kThreads / 32), kThreads, 0, stream, m);
                s = check_launch("attn_merge_kernel launch");
            }
        }
        if (s == HEXISEQ_OK) {
            hexiseq_attn_params ps = *p; // this slice's rows of o and lse
            ps.o = static_cast<T *>(p->o) + q0 * p->o_stride[1];
            ps.lse = static_cast<float *>(p->lse) + q0 * p->lse_stride[2];
            ps.seq_q = nq;
            const int64_t n = B * nq * H * d;
            HEXISEQ_LAUNCH(attn_fwd_store_kernel, (unsigned)std::min(ceil_div(n, kThreads), (int64_t)1 << 20), kThreads,
                           0, stream, ps, static_cast<const double *>(acc), static_cast<const double *>(lacc));
            s = check_launch("attn_fwd_store_kernel launch");
        }
    }
    e = cudaFreeAsync(scratch, stream);
    if (e != cudaSuccess && s == HEXISEQ_OK)
        s = cuda_fail(e, "cudaFreeAsync of the split forward's scratch");
    return s;
}

} // namespace

// The shared checks, then the kernels for the dtype.
// The kernels see the canonical mask (hexiseq_attn_canonical_mask): no window, or causal with a left window only, so
// the window is one more per-row lower bound; the split into key pieces works on that form too (positions are
// absolute, so a piece needs no other change).
extern "C" hexiseq_status hexiseq_attn_forward_cuda(const hexiseq_attn_params *p, void *stream) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(check_params(p, 0));
    hexiseq_attn_params c = *p;
    hexiseq_attn_canonical_mask(&c);
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (c.dtype == HEXISEQ_DTYPE_F16)
        return forward_typed<__half>(&c, st);
    return forward_typed<__nv_bfloat16>(&c, st);
}

extern "C" hexiseq_status hexiseq_attn_merge_cuda(const hexiseq_attn_merge_params *m, void *stream) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(hexiseq_attn_check_merge(m));
    const int64_t rows = m->batch * m->heads * m->seq;
    const int64_t blocks = ceil_div(rows, kThreads / 32);
    if (blocks > INT32_MAX)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED, "batch * heads * seq = %lld rows exceeds the CUDA grid limit",
                            (long long)rows);
    HEXISEQ_LAUNCH(attn_merge_kernel, (unsigned)blocks, kThreads, 0, static_cast<cudaStream_t>(stream), *m);
    return check_launch("attn_merge_kernel launch");
}
