// The CUDA attention backward with the scores staged in shared memory (attn_bwd_staged_kernel) and its launcher;
// backward_typed (backward.cu) picks it or the register design.
//
// D = 128 where shared memory allows (attn_bwd_staged_kernel, FlashAttention-2's backward layout):
// see the kernel's comment. P and dS are staged in shared memory so that each of the three products (S and
// dP; dV and dK; dQ) gets its own split of the 8 warps into 32-row tiles, which reads each shared-memory
// fragment for twice the tensor-core work of the register design (backward.cu). Lower bounds (document mask, window)
// and soft-capping: instances of their own (LB, CAP), as in the register design (see backward.cu's comment).
#ifndef HEXISEQ_KERNELS_BACKWARD_STAGED_CUH
#define HEXISEQ_KERNELS_BACKWARD_STAGED_CUH

#include "attention.h"
#include "backward.cuh"
#include "documents.cuh"
#include "host.cuh"
#include "tile.cuh"

namespace {

// Backward with the scores staged in shared memory (FlashAttention-2's backward layout): the D = 128 default where
// shared memory allows (sm_90); D = 64 only when forced (HEXISEQ_CUDA_BACKWARD=staged: on an H100 it ran no faster than
// the register kernel there, 0.65-0.70x of flash against 0.65-0.71x). One CTA of 8 warps per (key tile of BK = 128
// keys, kv head, batch), looping like attn_bwd_mma_kernel over every query head of the GQA group and every query tile
// (BQ = 64 rows) that can see the key tile. Each step runs three products, each with its own split of the 8 warps: 1. S
// = Q K^T and dP = dO V^T (64 x 128): warps as 2 (32 query rows) x 4 (32 keys); P = exp2(S scale log2(e) - LSE log2(e))
// masked and dS = P (dP - D) in registers, then both rounded to T into shared memory [BQ][BK]. 2. dV += P^T dO and dK
// += dS^T Q (128 keys x D): warps as 4 (32 keys) x 2 (D / 2 columns); the dK, dV accumulators stay in registers for the
// whole CTA (2 x 32 x D / 2 floats per warp). 3. dQ_tile = dS K (64 x D): warps as 2 (32 query rows) x 4 (D / 4
// columns), added scaled into the fp32 dQ scratch (red_add_f32x2).
// Why it beats the register design at D = 128 (attn_bwd_mma_kernel, one warp per 16 keys for all three products;
// 0.68-0.76x of flash against 0.60-0.64x, both in one run on an H100): each warp's
// tile there is 16 rows tall, so every warp reads the whole Q and dO tile from shared memory for every product
// (0.65 ldmatrix.x4 per mma.sync over a step); with 32 x 32 and 32 x D / 2 warp tiles it is 0.45, and shared-memory
// bandwidth, not the tensor cores, bounded that kernel on an H100. The query tile also doubles (64 rows against
// 32), halving the per-step barriers, LSE and D loads. The price is shared memory: 170.5 KiB at D = 128 (sm_90's
// 227 KiB limit; other devices run attn_bwd_mma_kernel there), 106.5 KiB at D = 64.
// Barriers per step: one after Q, dO, LSE and D are in place (every warp is then also done with the previous step's
// products 2 and 3, so P and dS may be rewritten), one after P and dS are written (every warp is then done with
// product 1, so LSE and D may be rewritten at the next step's start, and with the previous step's Q and dO, whose
// buffer the next step's tiles are then prefetched into, overlapping products 2 and 3).
template <int D> struct BwdStagedTiles {
    static_assert(D == 64 || D == 128, "the staged backward serves D = 64 and 128");
    static constexpr int BQ = 64, BK = 128, THREADS = 256;
    static constexpr int LDT = D + 8;  // Q, dO, K, V rows: 16 bytes past a multiple of 128 (no ldmatrix conflicts)
    static constexpr int LDP = BK + 8; // P and dS rows (one query each), same rule
    static constexpr int DV = D / 2;   // dK, dV columns per warp (product 2)
    static constexpr int DQ = D / 4;   // dQ columns per warp (product 3)
    static constexpr int qt = smem_round(BQ * LDT * 2); // one Q or dO tile
    static constexpr int pt = smem_round(BQ * LDP * 2); // P or dS
    static constexpr int k = 0;
    static constexpr int v = k + smem_round(BK * LDT * 2);
    static constexpr int q = v + smem_round(BK * LDT * 2); // Q tiles 0 and 1 (double buffer), then dO 0, 1
    static constexpr int dO = q + 2 * qt;
    static constexpr int p = dO + 2 * qt;
    static constexpr int ds = p + pt;
    static constexpr int lse = ds + pt;
    static constexpr int delta = lse + smem_round(BQ * 4);
    static constexpr int doc = delta + smem_round(BQ * 4); // lower bounds: each row's first key in the tile
    static constexpr int bytes = doc + smem_round(BQ * 4);
};

// LB: the per-row lower bounds (document mask, window), CAP: soft-capping, each in instances of their own, as in
// attn_bwd_mma_kernel.
template <typename T, int D, bool LB, bool CAP>
__global__ void __launch_bounds__(BwdStagedTiles<D>::THREADS) attn_bwd_staged_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    using L = BwdStagedTiles<D>;
    constexpr int BQ = L::BQ, BK = L::BK, LDT = L::LDT, LDP = L::LDP, NT = L::THREADS, DV = L::DV, DQ = L::DQ;
    extern __shared__ __align__(128) unsigned char smem[];
    T *ks = reinterpret_cast<T *>(smem + L::k);                  // [BK][LDT]
    T *vs = reinterpret_cast<T *>(smem + L::v);                  // [BK][LDT]
    T *ps = reinterpret_cast<T *>(smem + L::p);                  // [BQ][LDP] P, rounded to T
    T *dss = reinterpret_cast<T *>(smem + L::ds);                // [BQ][LDP] dS, unscaled, rounded to T
    float *lse_s = reinterpret_cast<float *>(smem + L::lse);     // [BQ] LSE * log2(e); -inf: no key seen / past nq
    float *delta_s = reinterpret_cast<float *>(smem + L::delta); // [BQ] D
    int *doc_s = reinterpret_cast<int *>(smem + L::doc);         // [BQ] first key of each row (lower bound)

    const int64_t bid = blockIdx.x;
    const int64_t kt = bid % cfg.n_ktiles;
    const int32_t slot = (int32_t)(bid / cfg.n_ktiles % ((int64_t)p.kv_heads * cfg.splits)); // (kv head, split)
    const int32_t hk = slot / cfg.splits;
    const int32_t h_first = hk * cfg.group + slot % cfg.splits * cfg.heads_per; // this CTA's first query head
    const int64_t b = bid / cfg.n_ktiles / ((int64_t)p.kv_heads * cfg.splits);
    const int64_t k0 = kt * BK;
    const int nk = (int)min((int64_t)BK, p.seq_k - k0); // keys in this tile (32-bit compares per element)
    const int64_t key_first = p.k_pos0 + k0;             // absolute position of the tile's first key

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int sm = 32 * (warp / 4), sn = 32 * (warp % 4); // product 1: query rows sm .., keys sn ..
    const int vk = 32 * (warp % 4), vc = DV * (warp / 4); // product 2: keys vk .., columns vc ..
    const int qm = 32 * (warp % 2), qc = DQ * (warp / 2); // product 3: query rows qm .., columns qc ..

    int64_t i_first = 0; // queries before the first key of the tile see none of it under the causal mask
    if (p.causal)
        i_first = max((int64_t)0, p.k_pos0 + k0 - p.q_pos0);
    // Lower bounds: the first query tile with a row that may see the tile; seq_q: none (K, V are not even loaded).
    int64_t q0_start = i_first / BQ * BQ;
    if constexpr (LB)
        q0_start = doc_next_tile<BQ>(p, cfg, b, q0_start, key_first + nk - 1);

    const T *kg = static_cast<const T *>(p.k) + b * p.k_stride[0] + k0 * p.k_stride[1] + hk * p.k_stride[2];
    const T *vg = static_cast<const T *>(p.v) + b * p.v_stride[0] + k0 * p.v_stride[1] + hk * p.v_stride[2];
    if (!LB || q0_start < p.seq_q) {
        load_kv_tiles<T, BK, D, LDT, NT>(ks, vs, kg, vg, p, nk, cfg.vec_k, cfg.vec_v);
    }

    float dk[2][DV / 8][4], dv[2][DV / 8][4]; // key rows vk + 16 i + g (+ 8), columns vc + 8 j + 2 t (+ 1)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < DV / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dk[i][j][e] = dv[i][j][e] = 0.0f;

    const int64_t q0_first = q0_start;
    const int64_t n_qt = max((int64_t)0, (p.seq_q - q0_first + BQ - 1) / BQ);
    const int64_t n_steps = (int64_t)cfg.heads_per * n_qt;
    const bool async = cfg.vec_q && cfg.vec_do;
    auto q_tile = [&](int buf) { return reinterpret_cast<T *>(smem + L::q + buf * L::qt); };   // [BQ][LDT]
    auto do_tile = [&](int buf) { return reinterpret_cast<T *>(smem + L::dO + buf * L::qt); }; // [BQ][LDT]
    auto q_src = [&](int32_t h, int64_t q0) {
        return static_cast<const T *>(p.q) + b * p.q_stride[0] + h * p.q_stride[2] + q0 * p.q_stride[1];
    };
    auto do_src = [&](int32_t h, int64_t q0) {
        return static_cast<const T *>(p.do_) + b * p.do_stride[0] + h * p.do_stride[2] + q0 * p.do_stride[1];
    };
    auto prefetch = [&](int32_t h, int64_t q0, int buf) {
        load_tile_pair_async<T, BQ, D, LDT, NT>(q_tile(buf), q_src(h, q0), p.q_stride[1], do_tile(buf), do_src(h, q0), p.do_stride[1],
                                                min((int64_t)BQ, p.seq_q - q0), p.head_dim);
        cp_async_commit();
    };
    // Under lower bounds the steps walk the tiles doc_next_tile keeps and end with the group's heads.
    const int32_t h_end = h_first + cfg.heads_per;
    int32_t h = LB && q0_start >= p.seq_q ? h_end : h_first;
    int64_t q0 = q0_first;
    if (async && (LB ? h < h_end : n_steps > 0))
        prefetch(h, q0, 0);
    int buf = 0;
    for (int64_t step = 0; LB ? h < h_end : step < n_steps; ++step, buf ^= async ? 1 : 0) {
        int32_t h_next = h;
        int64_t q0_next = q0 + BQ;
        if constexpr (LB)
            q0_next = doc_next_tile<BQ>(p, cfg, b, q0_next, key_first + nk - 1);
        if (q0_next >= p.seq_q) {
            q0_next = q0_first;
            ++h_next;
        }
        const bool more = LB ? h_next < h_end : step + 1 < n_steps; // a step follows this one
        const int nq = (int)min((int64_t)BQ, p.seq_q - q0);
        const float *lseg = static_cast<const float *>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
        const float *deltag = cfg.delta + (b * p.heads + h) * p.seq_q;
        float *dqg = cfg.dq_acc + ((b * p.heads + h) * p.seq_q + q0) * p.head_dim;
        // key kr sees query qr iff kr - qr <= diag (causal_diag: 32-bit, kr - qr lies in (-BQ, BK))
        const int diag = causal_diag<BQ, BK>(p, q0, k0);
        if (async) {
            cp_async_wait<0>(); // this step's tiles, prefetched during the previous step
        } else {
            __syncthreads(); // buffer 0's last readers (the previous step's product 2) are done
            load_tile<T, BQ, D, LDT, NT>(q_tile(0), q_src(h, q0), p.q_stride[1], p.q_stride[3], nq, p.head_dim, false);
            load_tile<T, BQ, D, LDT, NT>(do_tile(0), do_src(h, q0), p.do_stride[1], p.do_stride[3], nq, p.head_dim, false);
        }
        load_row_stats<BQ, NT>(lse_s, delta_s, lseg, p.lse_stride[2], deltag, q0, nq);
        const bool doc_cut = LB && doc_tile_cut<BQ>(cfg, b, q0, key_first); // uniform
        if (doc_cut) // rewritten under the same rule as LSE and D
            doc_tile_starts<BQ, BK, NT>(doc_s, p, b, q0, nq, key_first);
        __syncthreads(); // K, V (first step), Q, dO, LSE, D, lower bounds ready; the previous step's readers of P,
                         // dS done
        const T *qs = q_tile(buf), *dos = do_tile(buf);

        // 1. S and dP for query rows sm + 16 i + g (+ 8) x keys sn + 8 j + 2 t (+ 1): S first, then dP, so that
        // only one product's fragments are live at a time.
        float s[2][4][4], dp[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[i][j][e] = dp[i][j][e] = 0.0f;
#pragma unroll 2
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                load_a(qa[i], qs, LDT, sm + 16 * i, 16 * kk);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                uint32_t kb[4];
                load_b_cols(kb, ks, LDT, sn + 16 * j, 16 * kk);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mma16816<T>(s[i][2 * j], qa[i], kb[0], kb[1]);
                    mma16816<T>(s[i][2 * j + 1], qa[i], kb[2], kb[3]);
                }
            }
        }
#pragma unroll 2
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t da[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                load_a(da[i], dos, LDT, sm + 16 * i, 16 * kk);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                uint32_t vb[4];
                load_b_cols(vb, vs, LDT, sn + 16 * j, 16 * kk);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mma16816<T>(dp[i][2 * j], da[i], vb[0], vb[1]);
                    mma16816<T>(dp[i][2 * j + 1], da[i], vb[2], vb[3]);
                }
            }
        }
        // P and dS = P (dP - D); masked entries and rows past nq are 0 (lse_s = -inf there), keys past nk too: row
        // qr keeps keys kr <= last, one compare per entry. dS is 0 there too: a row whose D is NaN (a NaN in its O)
        // must not reach its masked keys through 0 x NaN. Soft-capped (CAP): P from the capped score softcap t, t =
        // tanh(S scale / softcap), and dS times 1 - t^2.
        const float scale_log2 = cfg.scale_log2;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const int qr = sm + 16 * i + g + 8 * hi;
                const float l2 = lse_s[qr], dr = delta_s[qr];
                const int last = l2 == -INFINITY ? -1 : min(nk - 1, qr + diag);
                int first = 0; // lower bound: the row's first key in the tile
                if constexpr (LB)
                    first = doc_cut ? doc_s[qr] : 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float pv[2], sv[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kr = sn + 8 * j + 2 * t + e;
                        bool ok = kr <= last;
                        if constexpr (LB)
                            ok = ok && kr >= first;
                        if constexpr (CAP) {
                            const float th = cap_tanh(s[i][j][2 * hi + e] * cfg.cap_scale);
                            pv[e] = ok ? fast_exp2(th * cfg.cap_log2 - l2) : 0.0f;
                            sv[e] = ok ? pv[e] * (dp[i][j][2 * hi + e] - dr) * (1.0f - th * th) : 0.0f;
                        } else {
                            pv[e] = ok ? fast_exp2(s[i][j][2 * hi + e] * scale_log2 - l2) : 0.0f;
                            sv[e] = ok ? pv[e] * (dp[i][j][2 * hi + e] - dr) : 0.0f;
                        }
                    }
                    const int at = qr * LDP + sn + 8 * j + 2 * t;
                    *reinterpret_cast<uint32_t *>(ps + at) = pack2<T>(pv[0], pv[1]);
                    *reinterpret_cast<uint32_t *>(dss + at) = pack2<T>(sv[0], sv[1]);
                }
            }
        __syncthreads(); // P and dS complete; product 1's readers of LSE, D and the other Q/dO buffer done
        if (async && more)
            prefetch(h_next, q0_next, buf ^ 1);

        // 2. dV += P^T dO, dK += dS^T Q over the BQ queries: A = P^T, dS^T (ldmatrix.trans), B = dO, Q rows.
#pragma unroll
        for (int c = 0; c < BQ / 16; ++c) {
            uint32_t pa[2][4], sa[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                load_a_trans(pa[i], ps, LDP, vk + 16 * i, 16 * c);
                load_a_trans(sa[i], dss, LDP, vk + 16 * i, 16 * c);
            }
#pragma unroll
            for (int j = 0; j < DV / 8; j += 2) {
                uint32_t db[4], qb[4];
                load_b_rows(db, dos, LDT, 16 * c, vc + 8 * j);
                load_b_rows(qb, qs, LDT, 16 * c, vc + 8 * j);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mma16816<T>(dv[i][j], pa[i], db[0], db[1]);
                    mma16816<T>(dv[i][j + 1], pa[i], db[2], db[3]);
                    mma16816<T>(dk[i][j], sa[i], qb[0], qb[1]);
                    mma16816<T>(dk[i][j + 1], sa[i], qb[2], qb[3]);
                }
            }
        }

        // 3. dQ_tile = dS K for query rows qm + 16 i + g (+ 8) x columns qc + 8 j + 2 t (+ 1), over the BK keys.
        float dq[2][DQ / 8][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < DQ / 8; ++j)
                dq[i][j][0] = dq[i][j][1] = dq[i][j][2] = dq[i][j][3] = 0.0f;
#pragma unroll 2
        for (int c = 0; c < BK / 16; ++c) {
            uint32_t sa[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                load_a(sa[i], dss, LDP, qm + 16 * i, 16 * c);
#pragma unroll
            for (int j = 0; j < DQ / 8; j += 2) {
                uint32_t kb[4];
                load_b_rows(kb, ks, LDT, 16 * c, qc + 8 * j);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mma16816<T>(dq[i][j], sa[i], kb[0], kb[1]);
                    mma16816<T>(dq[i][j + 1], sa[i], kb[2], kb[3]);
                }
            }
        }
        // As in attn_bwd_mma_kernel, written out in both: as one shared inline helper (with the dK/dV stores below)
        // the sm_80 build of the register kernel's 64-key instance went from 254 registers to 255 and a spill.
        const bool pairs = p.head_dim % 2 == 0;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < DQ / 8; ++j)
#pragma unroll
                for (int hi = 0; hi < 2; ++hi) {
                    const int r = qm + 16 * i + g + 8 * hi, col = qc + 8 * j + 2 * t;
                    if (r < nq && col < p.head_dim) {
                        float *at = dqg + (r * p.head_dim + col);
                        const float x = dq[i][j][2 * hi] * cfg.scale, y = dq[i][j][2 * hi + 1] * cfg.scale;
                        if (pairs) {
                            red_add_f32x2(at, x, y);
                        } else {
                            atomicAdd(at, x);
                            if (col + 1 < p.head_dim)
                                atomicAdd(at + 1, y);
                        }
                    }
                }
        h = h_next;
        q0 = q0_next;
    }

    T *dkg = static_cast<T *>(p.dk) + b * p.dk_stride[0] + k0 * p.dk_stride[1] + hk * p.dk_stride[2];
    T *dvg = static_cast<T *>(p.dv) + b * p.dv_stride[0] + k0 * p.dv_stride[1] + hk * p.dv_stride[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < DV / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = vk + 16 * i + g + 8 * (e / 2), col = vc + 8 * j + 2 * t + (e & 1);
                if (r >= nk || col >= p.head_dim)
                    continue;
                float gk = dk[i][j][e] * cfg.scale, gv = dv[i][j][e];
                if (cfg.dkv_acc) { // the group's heads split over CTAs (see attn_bwd_mma_kernel)
                    float *at = cfg.dkv_acc + (((b * p.seq_k + k0 + r) * p.kv_heads + hk) * p.head_dim + col);
                    atomicAdd(at, gk);
                    atomicAdd(at + p.batch * p.seq_k * p.kv_heads * p.head_dim, gv);
                    continue;
                }
                T *pk = dkg + r * p.dk_stride[1] + col * p.dk_stride[3];
                T *pv = dvg + r * p.dv_stride[1] + col * p.dv_stride[3];
                if (p.accumulate) {
                    gk += to_f32(*pk);
                    gv += to_f32(*pv);
                }
                *pk = from_f32<T>(gk);
                *pv = from_f32<T>(gv);
            }
}
template <typename T, int D> hexiseq_status launch_bwd_staged(const hexiseq_attn_params &p, BwdLaunch cfg,
                                                              cudaStream_t stream) {
    using L = BwdStagedTiles<D>;
    cfg.n_ktiles = ceil_div(p.seq_k, L::BK);
    const int64_t blocks = cfg.n_ktiles * p.kv_heads * cfg.splits * p.batch;
    const bool lb = p.q_doc != nullptr || p.window, cap = p.softcap > 0; // the instance, as in launch_fwd
    auto kernel = lb ? (cap ? attn_bwd_staged_kernel<T, D, true, true> : attn_bwd_staged_kernel<T, D, true, false>)
                     : (cap ? attn_bwd_staged_kernel<T, D, false, true> : attn_bwd_staged_kernel<T, D, false, false>);
    return launch_with_smem(kernel, "attn_bwd_staged_kernel", blocks, L::THREADS, L::bytes, stream, p, cfg);
}

} // namespace

#endif // HEXISEQ_KERNELS_BACKWARD_STAGED_CUH
