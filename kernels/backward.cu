// The CUDA attention backward: its launchers (hexiseq_attn_backward_cuda of kernels/launch.h), the register-level
// backward kernel (attn_bwd_mma_kernel) and the delta and dq kernels around both backward designs.
//
// Backward where the staged kernel (backward_staged.cuh) does not run: attn_bwd_mma_kernel, the same register design as the forward on the transposed problem. A
// preprocessing kernel writes D = rowsum(dO * O) (fp32, [batch, heads, seq_q]). One CTA per (key tile, kv head,
// batch; where one CTA per kv head is too few, one per query head or a few of them: BwdLaunch::splits): 128 keys
// and 8 warps at D = 64 and 128 (64 keys and 4 warps for D = 128 on GPUs with 99 KiB of shared
// memory), 64 keys and 8 warps at D = 256; each warp owns 16 keys and their dK, dV accumulators in registers (at D
// = 256 two warps split a key block's head dim and swap partial scores through shared memory), and loops over every
// query head of its GQA group and every query tile that can see the key tile: S^T = K Q^T, P^T = exp(scale S^T -
// LSE) (masked), dP^T = V dO^T, dV += P^T dO, dS^T = P^T (dP^T - D), dK += dS^T Q (P^T and dS^T go from registers
// into the products as A operands); dS^T goes through shared memory so the warps can compute dQ_tile = dS K, summed
// over the CTA's keys before it leaves the CTA (the wider the key tile, the fewer dQ atomic adds and Q, dO tile
// reads per key). Q and dO tiles are double-buffered with cp.async when legal, the next step's in flight. dK, dV
// are written once at the end (one thread owns each element, so no atomics; accumulate adds to the old values). dQ:
// fp32 atomic adds into a zeroed [batch, heads, seq_q, d] scratch buffer (already scaled), then a small kernel
// writes (or, with accumulate, adds into) dq in the input dtype. Each thread's two adjacent columns of a row go as
// one pair: on sm_90 one vector reduction (red.global.add.v2.f32), elsewhere two atomicAdd; an odd d (pairs not
// 8-byte aligned) adds float by float. Atomics are the simple choice: the cost is that dQ is not bit-for-bit
// deterministic (summation order of fp32 adds across key tiles varies run to run). Scratch (D and the dQ
// accumulator) is allocated with cudaMallocAsync / cudaFreeAsync on the stream.
// Masks and soft-capping, in both backward kernels: the launcher passes the canonical mask (attention.h), so a sliding
// window is a per-row lower bound like the document start, served by the lower-bound instances (LB, documents.cuh):
// a key tile walks only the query tiles whose rows may see it. Soft-capping runs in instances of its own (CAP): P is
// recomputed from the capped score softcap tanh(scale S / softcap) and dS takes the factor 1 - tanh^2; dQ and dK are
// scaled as before. The plain instances carry neither.
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "backward.cuh"
#include "backward_staged.cuh"
#include "documents.cuh"
#include "host.cuh"
#include "launch.h"
#include "tile.cuh"

namespace {

// D[b, h, i] = sum_c dO[b, i, h, c] * O[b, i, h, c] in fp32; one warp per row.
template <typename T> __global__ void attn_bwd_delta_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; // (b * heads + h) * seq_q + i
    const int lane = threadIdx.x % 32;
    if (row >= p.batch * p.heads * p.seq_q)
        return;
    const int64_t i = row % p.seq_q;
    const int64_t h = row / p.seq_q % p.heads;
    const int64_t b = row / p.seq_q / p.heads;
    const T *og = static_cast<const T *>(p.o) + b * p.o_stride[0] + i * p.o_stride[1] + h * p.o_stride[2];
    const T *dog = static_cast<const T *>(p.do_) + b * p.do_stride[0] + i * p.do_stride[1] + h * p.do_stride[2];
    float sum = 0.0f;
    for (int c = lane; c < p.head_dim; c += 32)
        sum += to_f32(og[c * p.o_stride[3]]) * to_f32(dog[c * p.do_stride[3]]);
    sum = warp_sum(sum);
    if (lane == 0)
        cfg.delta[row] = sum;
}
// Backward on register-level tensor cores. One CTA per (key tile of BK keys, kv head, batch) with KB x DS warps,
// KB = BK / 16 key blocks: warp w owns keys 16 (w % KB) .. +15 and head-dim columns [(w / KB) D / DS, +D / DS) of
// their dK and dV, in registers for the whole CTA (DS = 1 up to D = 128; DS = 2 at D = 256, where 16 keys x 256
// columns of dK and dV would not fit one warp's registers). BK = 128 (8 warps) at D = 64 and 128, 64 (8 warps) at
// D = 256: a wider key tile sums each query tile's dQ over more keys before its one set of atomic adds and reads
// each Q and dO tile from L2 fewer times per key (both halve from BK = 64 to 128). For every query head of the GQA
// group and every query tile (BQ rows) that can see the key tile, each warp computes, with keys as rows (the
// transposed problem, so that P^T and dS^T are A operands straight from registers):
//   S^T = K Q^T, P^T = exp2(scale log2(e) S^T - LSE log2(e)) masked, dP^T = V dO^T, dV += P^T dO,
//   dS^T = P^T (dP^T - D), dK += dS^T Q.
// With DS = 2 a warp computes S^T and dP^T over its half of the head dim and the two warps of a key block swap
// their partial sums through shared memory (both then hold the same full sums: a + b = b + a exactly). Then dS^T
// (16-bit) goes to shared memory, and after a barrier the warps compute dQ_tile = dS K (each a part of the tile,
// summing over all BK keys) and add it, scaled, into the fp32 dQ scratch with atomics.
// The D = 128 instance with BK = 128 needs 112.3 KiB of shared memory: GPUs whose opt-in limit is lower (sm_86/89:
// 99 KiB) get the BK = 64 instance (4 warps, 73.3 KiB), see backward_typed.
constexpr int bwd_default_bk(int D) { return D <= 128 ? 128 : 64; }
template <int D, int BK_ = bwd_default_bk(D)> struct BwdMmaTiles {
    static_assert(D == 64 || D == 128 || D == 256, "the register backward serves D = 64, 128 and 256");
    static constexpr int BK = BK_;                       // keys per CTA
    static_assert(BK == 64 || BK == 128, "key tiles of 64 or 128 keys");
    static constexpr int KB = BK / 16;                   // key blocks of 16 keys, one per warp (per DS warps)
    static constexpr int DS = D <= 128 ? 1 : 2;          // warps sharing a key block's head dim
    static constexpr int THREADS = 32 * KB * DS;
    static constexpr int DW = D / DS;                    // head-dim columns of dK, dV per warp
    static constexpr int BQ = D == 64 ? 64 : D == 128 ? 32 : 16; // query rows per step
    static constexpr int LDT = D + 8;                    // Q, dO, K, V rows: 16 bytes past a multiple of 128
    static constexpr int LDS = BQ + 8;                   // dS^T rows (keys), same padding rule
    static constexpr int qt = smem_round(BQ * LDT * 2);  // one Q or dO tile
    static constexpr int k = 0;
    static constexpr int v = k + smem_round(BK * LDT * 2);
    static constexpr int q = v + smem_round(BK * LDT * 2); // Q tiles 0 and 1 (double buffer), then dO 0, 1
    static constexpr int dO = q + 2 * qt;
    static constexpr int ds = dO + 2 * qt;
    static constexpr int lse = ds + smem_round(BK * LDS * 2);
    static constexpr int delta = lse + smem_round(BQ * 4);
    static constexpr int xch = delta + smem_round(BQ * 4); // DS = 2: per warp, its partial S^T and dP^T
    static constexpr int xch_warp = 2 * 16 * BQ * 4;         // bytes per warp
    static constexpr int doc = xch + (DS > 1 ? THREADS / 32 * xch_warp : 0); // lower bounds: each row's first key
    static constexpr int bytes = doc + smem_round(BQ * 4);
    // The dQ phase: THREADS / 32 warps over QM blocks of 16 query rows x (warps / QM) parts of DQ head-dim columns.
    static constexpr int QM = BQ / 16, DQ = D / (THREADS / 32 / QM);
    static_assert(THREADS / 32 % QM == 0 && D % (THREADS / 32 / QM) == 0 && DQ % 16 == 0,
                  "every warp gets a 16-row block and a multiple of 16 head-dim columns of dQ");
};
// Only the D = 128 instance has a smaller-tile fallback: D = 64 with BK = 128 fits every target (99 KiB and up).
static_assert(BwdMmaTiles<64>::bytes <= 99 * 1024, "the D = 64 backward must fit a 99 KiB device");

// LB: the per-row lower bounds (document mask, window; see documents.cuh), in their own instance (see attn_fwd_kernel in
// forward.cu): query tiles no row of which sees the key tile are skipped (doc_next_tile; neither loaded nor computed),
// and the per-element mask takes the rows' bounds only in the steps whose tile holds a bound past the key tile's first
// key. CAP: soft-capping, in its own instance: P^T is recomputed from the capped score (t = tanh(S^T scale / softcap),
// cap_tanh, tile.cuh; P^T = exp2(t softcap log2(e) - LSE log2(e))) and dS^T takes the factor 1 - t^2 of the cap's derivative.
template <typename T, int D, int BK_, bool LB, bool CAP>
__global__ void __launch_bounds__(BwdMmaTiles<D, BK_>::THREADS) attn_bwd_mma_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    using L = BwdMmaTiles<D, BK_>;
    constexpr int BQ = L::BQ, BK = L::BK, KB = L::KB, LDT = L::LDT, LDS = L::LDS, DS = L::DS, DW = L::DW;
    constexpr int NT = L::THREADS;
    extern __shared__ __align__(128) unsigned char smem[];
    T *ks = reinterpret_cast<T *>(smem + L::k);                  // [BK][LDT]
    T *vs = reinterpret_cast<T *>(smem + L::v);                  // [BK][LDT]
    T *dst = reinterpret_cast<T *>(smem + L::ds);                // [BK][LDS] dS^T, unscaled
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
    const int kb = warp % KB, dh = warp / KB; // key block kb, head-dim part dh
    const int key0 = kb * 16 + g;             // this thread's key rows in the tile: key0 and key0 + 8
    const int c0 = dh * DW;                   // first head-dim column of this warp's dK, dV

    // K and V first in the plain instance, as they always were (computing the start below first moved the sm_80
    // D = 256 build into a 4-byte spill); the lower-bound instance loads them only if some query tile sees them.
    const T *kg = static_cast<const T *>(p.k) + b * p.k_stride[0] + k0 * p.k_stride[1] + hk * p.k_stride[2];
    const T *vg = static_cast<const T *>(p.v) + b * p.v_stride[0] + k0 * p.v_stride[1] + hk * p.v_stride[2];
    if constexpr (!LB) {
        load_kv_tiles<T, BK, D, LDT, NT>(ks, vs, kg, vg, p, nk, cfg.vec_k, cfg.vec_v);
    }

    float dk[DW / 8][4], dv[DW / 8][4]; // rows key0, key0 + 8 x columns c0 + 8j + 2t + {0, 1}; dK unscaled
#pragma unroll
    for (int j = 0; j < DW / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            dk[j][e] = dv[j][e] = 0.0f;

    // Queries before the first key of the tile see none of it under the causal mask.
    int64_t i_first = 0;
    if (p.causal)
        i_first = max((int64_t)0, p.k_pos0 + k0 - p.q_pos0);
    const int64_t qt_first = i_first / BQ;
    // Lower bounds: the first query tile with a row that may see the tile; seq_q: none (K, V are not even loaded).
    int64_t q0_start = qt_first * BQ;
    if constexpr (LB) {
        q0_start = doc_next_tile<BQ>(p, cfg, b, q0_start, key_first + nk - 1);
        if (q0_start < p.seq_q) {
            load_kv_tiles<T, BK, D, LDT, NT>(ks, vs, kg, vg, p, nk, cfg.vec_k, cfg.vec_v);
        }
    }

    // The dQ part of this warp: query rows 16 qm .. +15, columns [dc0, dc0 + DQ) (QM x NT / 32 / QM warps; DQ = 32
    // at BK = 128 and at D = 256, 64 in the D = 128 BK = 64 fallback).
    constexpr int QM = L::QM, DQ = L::DQ;
    const int qm = warp % QM, dc0 = warp / QM * DQ;

    // The steps: every query head of the group x every query tile from qt_first on. Q and dO tiles are
    // double-buffered with cp.async when their rows allow 16-byte copies (the next step's tiles load during this
    // one, across head boundaries too); otherwise loaded element by element into buffer 0.
    const int64_t n_qt = max((int64_t)0, (p.seq_q + BQ - 1) / BQ - qt_first);
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
    auto prefetch = [&](int32_t h, int64_t q0, int buf) { // the tiles of query head h, rows q0 ..
        load_tile_pair_async<T, BQ, D, LDT, NT>(q_tile(buf), q_src(h, q0), p.q_stride[1], do_tile(buf), do_src(h, q0), p.do_stride[1],
                                                min((int64_t)BQ, p.seq_q - q0), p.head_dim);
        cp_async_commit();
    };
    // The step's query head h and first query row q0 advance by counting (no 64-bit divisions per step): the next
    // query tile of the head, after its last tile the first tile of the next head. Under lower bounds the next
    // tile is the next one doc_next_tile keeps, and the steps end with the group's heads (their count is not known
    // ahead).
    const int64_t q0_first = q0_start;
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
        const int nq = (int)min((int64_t)BQ, p.seq_q - q0); // query rows of this tile
        const float *lseg = static_cast<const float *>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
        const float *deltag = cfg.delta + (b * p.heads + h) * p.seq_q;
        float *dqg = cfg.dq_acc + ((b * p.heads + h) * p.seq_q + q0) * p.head_dim; // row q0 of the tile
        // Causal: key kr sees query qc iff kr - qc <= diag (causal_diag: 32-bit, kr - qc lies in (-BQ, BK)).
        const int diag = causal_diag<BQ, BK>(p, q0, k0);
        const T *qs = q_tile(buf), *dos = do_tile(buf);
        // No barrier is needed before refilling a Q/dO buffer or LSE, D: their last readers (the dV/dK phase
        // of an earlier step) are behind that step's "dS^T complete" barrier, and dS^T is rewritten only
        // after the "ready" barrier below, which every warp reaches only after its previous dQ phase.
        if (async) {
            if (LB ? h_next < h_end : step + 1 < n_steps) { // a step follows this one
                prefetch(h_next, q0_next, buf ^ 1);
                cp_async_wait<1>(); // this thread's copies for this step are done
            } else {
                cp_async_wait<0>();
            }
        } else {
            load_tile<T, BQ, D, LDT, NT>(q_tile(0), q_src(h, q0), p.q_stride[1], p.q_stride[3], nq, p.head_dim, false);
            load_tile<T, BQ, D, LDT, NT>(do_tile(0), do_src(h, q0), p.do_stride[1], p.do_stride[3], nq, p.head_dim, false);
        }
        load_row_stats<BQ, NT>(lse_s, delta_s, lseg, p.lse_stride[2], deltag, q0, nq);
        const bool doc_cut = LB && doc_tile_cut<BQ>(cfg, b, q0, key_first); // uniform
        if (doc_cut) // rewritten under the same rule as LSE and D (see above)
            doc_tile_starts<BQ, BK, NT>(doc_s, p, b, q0, nq, key_first);
        __syncthreads(); // K, V (first step), Q, dO, LSE, D, lower bounds ready

        // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BQ queries (query block j: 8j .. 8j+7),
        // over this warp's head-dim columns (all of them when DS = 1).
        float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                st[j][e] = dpt[j][e] = 0.0f;
#pragma unroll
        for (int kk = c0 / 16; kk < (c0 + DW) / 16; ++kk) {
            uint32_t ka[4], va[4];
            load_a(ka, ks, LDT, kb * 16, kk * 16);
            load_a(va, vs, LDT, kb * 16, kk * 16);
#pragma unroll
            for (int j = 0; j < BQ / 8; j += 2) {
                uint32_t qb[4], db[4]; // queries as columns: query blocks j and j + 1
                load_b_cols(qb, qs, LDT, 8 * j, kk * 16);
                load_b_cols(db, dos, LDT, 8 * j, kk * 16);
                mma16816<T>(st[j], ka, qb[0], qb[1]);
                mma16816<T>(st[j + 1], ka, qb[2], qb[3]);
                mma16816<T>(dpt[j], va, db[0], db[1]);
                mma16816<T>(dpt[j + 1], va, db[2], db[3]);
            }
        }

        if constexpr (DS > 1) { // add the partner warp's partial sums (the other half of the head dim)
            static_assert(DS == 2, "one partner warp: the same key block kb, the other head-dim part");
            const int partner = kb + KB * (dh ^ 1);
            float *mine = reinterpret_cast<float *>(smem + L::xch + warp * L::xch_warp);
            const float *theirs = reinterpret_cast<const float *>(smem + L::xch + partner * L::xch_warp);
#pragma unroll
            for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    mine[(j * 4 + e) * 32 + lane] = st[j][e];
                    mine[(BQ / 2 + j * 4 + e) * 32 + lane] = dpt[j][e];
                }
            __syncthreads(); // both halves written
#pragma unroll
            for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    st[j][e] += theirs[(j * 4 + e) * 32 + lane];
                    dpt[j][e] += theirs[(BQ / 2 + j * 4 + e) * 32 + lane];
                }
        }

        // P^T, then dS^T = P^T (dP^T - D), in place; masked and out-of-range entries are 0 (dS too: a row whose D is
        // NaN, from a NaN in its O, must not reach its masked keys through 0 x NaN). Soft-capped: P^T from the capped
        // score and dS^T times 1 - t^2.
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kr = key0 + 8 * (e / 2), qc = 8 * j + 2 * t + (e & 1);
                const float l2 = lse_s[qc];
                bool ok = kr < nk && l2 != -INFINITY && kr - qc <= diag;
                if constexpr (LB)
                    ok = ok && (!doc_cut || kr >= doc_s[qc]);
                if constexpr (CAP) {
                    const float th = cap_tanh(st[j][e] * cfg.cap_scale);
                    const float pv = ok ? fast_exp2(th * cfg.cap_log2 - l2) : 0.0f;
                    st[j][e] = pv;
                    dpt[j][e] = ok ? pv * (dpt[j][e] - delta_s[qc]) * (1.0f - th * th) : 0.0f;
                } else {
                    const float pv = ok ? fast_exp2(st[j][e] * cfg.scale_log2 - l2) : 0.0f;
                    st[j][e] = pv;
                    dpt[j][e] = ok ? pv * (dpt[j][e] - delta_s[qc]) : 0.0f;
                }
            }

        // dV += P^T dO and dK += dS^T Q: query block pair (2c, 2c + 1) is the A fragment of queries 16c .. +15.
#pragma unroll
        for (int c = 0; c < BQ / 16; ++c) {
            uint32_t pa[4], sa[4];
            a_from_c<T>(pa, st[2 * c], st[2 * c + 1]);
            a_from_c<T>(sa, dpt[2 * c], dpt[2 * c + 1]);
#pragma unroll
            for (int j = 0; j < DW / 8; j += 2) {
                uint32_t db[4], qb[4]; // output column blocks j and j + 1 of this warp's columns
                load_b_rows(db, dos, LDT, 16 * c, c0 + 8 * j);
                load_b_rows(qb, qs, LDT, 16 * c, c0 + 8 * j);
                mma16816<T>(dv[j], pa, db[0], db[1]);
                mma16816<T>(dv[j + 1], pa, db[2], db[3]);
                mma16816<T>(dk[j], sa, qb[0], qb[1]);
                mma16816<T>(dk[j + 1], sa, qb[2], qb[3]);
            }
            // dS^T to shared memory for dQ (the same rounded values that went into dK; one warp per key block).
            if (dh == 0) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kr = key0 + 8 * (e & 1), qc = 16 * c + 8 * (e / 2) + 2 * t;
                    *reinterpret_cast<uint32_t *>(dst + kr * LDS + qc) = sa[e];
                }
            }
        }
        __syncthreads(); // dS^T complete

        // This warp's part of dQ = dS K over the BK keys: A[q][key] = dS^T[key][q] (ldmatrix.trans of dS^T), B = K.
        float dq[DQ / 8][4];
#pragma unroll
        for (int j = 0; j < DQ / 8; ++j)
            dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;
        // Unrolled by 4 key blocks, not all BK / 16: fully unrolled over 128 keys, the sm_90 build hoisted loads
        // until it hit 255 registers and spilled (16 to 20 bytes).
#pragma unroll 4
        for (int c = 0; c < BK / 16; ++c) {
            uint32_t da[4];
            load_a_trans(da, dst, LDS, 16 * qm, 16 * c);
#pragma unroll
            for (int j = 0; j < DQ / 8; j += 2) {
                uint32_t kb[4];
                load_b_rows(kb, ks, LDT, 16 * c, dc0 + 8 * j);
                mma16816<T>(dq[j], da, kb[0], kb[1]);
                mma16816<T>(dq[j + 1], da, kb[2], kb[3]);
            }
        }
        // dq[j][2i], dq[j][2i + 1] are columns col, col + 1 of one row (col even). With an even row length p.head_dim each
        // pair is 8-byte aligned in dq_acc (a 256-byte aligned carve of the scratch) and col < p.head_dim implies
        // col + 1 < p.head_dim: one red_add_f32x2 per pair. An odd p.head_dim (a uniform branch) takes one atomicAdd per float.
        const bool pairs = p.head_dim % 2 == 0;
#pragma unroll
        for (int j = 0; j < DQ / 8; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = 16 * qm + g + 8 * i, col = dc0 + 8 * j + 2 * t;
                if (r < nq && col < p.head_dim) {
                    float *at = dqg + (r * p.head_dim + col);
                    const float x = dq[j][2 * i] * cfg.scale, y = dq[j][2 * i + 1] * cfg.scale;
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

    // dK = scale dS^T Q and dV; one thread owns each element, so plain stores (accumulate: add to old values), or,
    // with the group's heads split over CTAs, fp32 adds.
    T *dkg = static_cast<T *>(p.dk) + b * p.dk_stride[0] + k0 * p.dk_stride[1] + hk * p.dk_stride[2];
    T *dvg = static_cast<T *>(p.dv) + b * p.dv_stride[0] + k0 * p.dv_stride[1] + hk * p.dv_stride[2];
#pragma unroll
    for (int j = 0; j < DW / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = key0 + 8 * (e / 2), col = c0 + 8 * j + 2 * t + (e & 1);
            if (r >= nk || col >= p.head_dim)
                continue;
            float gk = dk[j][e] * cfg.scale, gv = dv[j][e];
            if (cfg.dkv_acc) { // the group's heads split over CTAs: their sums meet in fp32 (attn_bwd_dkv_kernel)
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
// dq[b, i, h, c] = (accumulate ? dq : 0) + dq_acc[b, h, i, c], one thread per element.
template <typename T> __global__ void attn_bwd_dq_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    const int64_t n = p.batch * p.heads * p.seq_q * p.head_dim;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = idx % p.head_dim;
        const int64_t i = idx / p.head_dim % p.seq_q;
        const int64_t h = idx / p.head_dim / p.seq_q % p.heads;
        const int64_t b = idx / p.head_dim / p.seq_q / p.heads;
        T *pq = static_cast<T *>(p.dq) + b * p.dq_stride[0] + i * p.dq_stride[1] + h * p.dq_stride[2] + c * p.dq_stride[3];
        float g = cfg.dq_acc[idx];
        if (p.accumulate)
            g += to_f32(*pq);
        *pq = from_f32<T>(g);
    }
}
// dk[b, j, hk, c] = (accumulate ? dk : 0) + dkv_acc[0][b, j, hk, c], and dv from dkv_acc[1]: the sums of the CTAs
// that split a GQA group's query heads, one thread per element.
template <typename T> __global__ void attn_bwd_dkv_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    const int64_t n = p.batch * p.seq_k * p.kv_heads * p.head_dim;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = idx % p.head_dim;
        const int64_t hk = idx / p.head_dim % p.kv_heads;
        const int64_t j = idx / p.head_dim / p.kv_heads % p.seq_k;
        const int64_t b = idx / p.head_dim / p.kv_heads / p.seq_k;
        T *pk = static_cast<T *>(p.dk) + b * p.dk_stride[0] + j * p.dk_stride[1] + hk * p.dk_stride[2] + c * p.dk_stride[3];
        T *pv = static_cast<T *>(p.dv) + b * p.dv_stride[0] + j * p.dv_stride[1] + hk * p.dv_stride[2] + c * p.dv_stride[3];
        float gk = cfg.dkv_acc[idx], gv = cfg.dkv_acc[n + idx];
        if (p.accumulate) {
            gk += to_f32(*pk);
            gv += to_f32(*pv);
        }
        *pk = from_f32<T>(gk);
        *pv = from_f32<T>(gv);
    }
}
// How many CTAs split a GQA group's query heads (BwdLaunch::splits). Under the causal mask or per-row lower bounds
// key tiles carry unequal work, and one CTA per (key tile, kv head) leaves the SMs that got the light tiles idle:
// the smallest divisor of the group that gives at least 8 CTAs per SM to spread (one CTA of 8 warps fits an SM at a
// time), else the whole group. Without a mask every CTA carries the same work, and splitting only adds the fp32
// sums: split just enough for one CTA per SM. On an H100 (benchmarks/results/gpu/gqa_backward_h100.md, 16/4 heads)
// the causal backward took 0.76-0.80x the unsplit time at 4K and 8K tokens, the full one 0.98-1.16x, where this rule
// would have split it. HEXISEQ_CUDA_BWD_SPLITS=n forces the largest divisor of the group up to n (to time one
// against another, and for the tests). base: CTAs unsplit; uneven: a causal mask or lower bounds.
hexiseq_status bwd_splits(int32_t group, int64_t base, bool uneven, int32_t *splits) {
    const char *force = getenv("HEXISEQ_CUDA_BWD_SPLITS");
    if (force && *force) {
        char *end = nullptr;
        const long n = strtol(force, &end, 10);
        if (*end != '\0' || n < 1)
            return hexiseq_fail(HEXISEQ_ERR_INVALID, "HEXISEQ_CUDA_BWD_SPLITS=%s: expected a positive integer or unset",
                                force);
        int32_t d = 1;
        for (int32_t x = 1; x <= group && x <= n; ++x)
            if (group % x == 0)
                d = x;
        *splits = d;
        return HEXISEQ_OK;
    }
    const int64_t want = (uneven ? 8 : 1) * (int64_t)sm_count();
    *splits = group;
    for (int32_t x = 1; x < group; ++x)
        if (group % x == 0 && base * x >= want) {
            *splits = x;
            break;
        }
    return HEXISEQ_OK;
}
// The key tile (BK keys per CTA) depends on the instance, so the grid is sized here (backward_typed has checked
// it against the grid limit for the smallest key tile).
template <typename T, int D, int BK = bwd_default_bk(D)>
hexiseq_status launch_bwd_mma(const hexiseq_attn_params &p, BwdLaunch cfg, cudaStream_t stream) {
    using L = BwdMmaTiles<D, BK>;
    cfg.n_ktiles = ceil_div(p.seq_k, BK);
    const int64_t blocks = cfg.n_ktiles * p.kv_heads * cfg.splits * p.batch;
    const bool lb = p.q_doc != nullptr || p.window, cap = p.softcap > 0; // the instance, as in launch_fwd
    auto kernel = lb ? (cap ? attn_bwd_mma_kernel<T, D, BK, true, true> : attn_bwd_mma_kernel<T, D, BK, true, false>)
                     : (cap ? attn_bwd_mma_kernel<T, D, BK, false, true> : attn_bwd_mma_kernel<T, D, BK, false, false>);
    return launch_with_smem(kernel, "attn_bwd_mma_kernel", blocks, L::THREADS, L::bytes, stream, p, cfg);
}
template <typename T>
hexiseq_status backward_typed(const hexiseq_attn_params *p, cudaStream_t stream) {
    BwdLaunch cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.group = p->heads / p->kv_heads;
    cfg.vec_q = vec_ok(p->q, p->q_stride, p->head_dim);
    cfg.vec_k = vec_ok(p->k, p->k_stride, p->head_dim);
    cfg.vec_v = vec_ok(p->v, p->v_stride, p->head_dim);
    cfg.vec_do = vec_ok(p->do_, p->do_stride, p->head_dim);
    cfg.scale = (float)p->scale;
    cfg.scale_log2 = (float)(p->scale * 1.4426950408889634);
    if (p->softcap > 0) {
        cfg.cap_scale = (float)(p->scale / p->softcap);
        cfg.cap_log2 = (float)(p->softcap * 1.4426950408889634);
    }
    const bool lb = p->q_doc != nullptr || p->window; // per-row lower bounds: the LB instances and their chunk bounds

    const int D = padded_head_dim(p->head_dim);
    const int64_t rows = p->batch * p->heads * p->seq_q;
    const int64_t base_blocks = ceil_div(p->seq_k, 64) * p->kv_heads * p->batch; // the most unsplit: 64-key tiles
    HEXISEQ_CHECK(bwd_splits(cfg.group, base_blocks, p->causal || lb, &cfg.splits));
    cfg.heads_per = cfg.group / cfg.splits;
    const int64_t main_blocks = base_blocks * cfg.splits;
    const int64_t delta_blocks = ceil_div(rows, kThreads / 32);
    if (main_blocks > INT32_MAX || delta_blocks > INT32_MAX || rows > INT64_MAX / 8 / p->head_dim)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "batch %lld x heads %d x seq_q %lld x seq_k %lld exceeds the CUDA grid limit 2^31 - 1",
                            (long long)p->batch, (int)p->heads, (long long)p->seq_q, (long long)p->seq_k);

    // HEXISEQ_CUDA_BACKWARD=register or =staged forces one backward kernel where it fits (to time one against the
    // other: benchmarks/bench_cuda_attention.py --bwd-kernels); unset: chosen below.
    const char *force = getenv("HEXISEQ_CUDA_BACKWARD");
    if (force && *force && strcmp(force, "staged") != 0 && strcmp(force, "register") != 0)
        return hexiseq_fail(HEXISEQ_ERR_INVALID, "HEXISEQ_CUDA_BACKWARD=%s: expected staged, register or unset", force);
    const bool staged_ok = !force || !*force || strcmp(force, "staged") == 0;

    // Scratch: D [rows], the fp32 dQ accumulator [rows][d] and, with lower bounds (document mask or window), their
    // three [batch][chunks] bound arrays; stream-ordered.
    const size_t delta_bytes = (size_t)rows * sizeof(float);
    const size_t acc_bytes = (size_t)rows * (size_t)p->head_dim * sizeof(float);
    cfg.doc_chunks = lb ? ceil_div(p->seq_q, kDocChunk) : 0;
    const size_t doc_bytes = (size_t)(p->batch * cfg.doc_chunks) * sizeof(int64_t);
    const size_t kv_elems = (size_t)(p->batch * p->seq_k * p->kv_heads * p->head_dim);
    const size_t dkv_bytes = cfg.splits > 1 ? 2 * kv_elems * sizeof(float) : 0; // split heads: fp32 dK, dV sums
    auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    void *scratch = nullptr;
    cudaError_t e = cudaMallocAsync(&scratch, up(delta_bytes) + up(acc_bytes) + 3 * up(doc_bytes) + up(dkv_bytes),
                                    stream);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaMallocAsync of the backward scratch (D and the fp32 dQ accumulator)");
    cfg.delta = static_cast<float *>(scratch);
    cfg.dq_acc = reinterpret_cast<float *>(static_cast<char *>(scratch) + up(delta_bytes));
    if (lb) {
        int64_t *doc = reinterpret_cast<int64_t *>(static_cast<char *>(scratch) + up(delta_bytes) + up(acc_bytes));
        cfg.doc_min = doc;
        cfg.doc_max = reinterpret_cast<int64_t *>(reinterpret_cast<char *>(doc) + up(doc_bytes));
        cfg.doc_suf = reinterpret_cast<int64_t *>(reinterpret_cast<char *>(doc) + 2 * up(doc_bytes));
    }
    cfg.dkv_acc = dkv_bytes ? reinterpret_cast<float *>(static_cast<char *>(scratch) + up(delta_bytes) + up(acc_bytes) +
                                                        3 * up(doc_bytes))
                            : nullptr;

    hexiseq_status s = HEXISEQ_OK;
    e = cudaMemsetAsync(cfg.dq_acc, 0, acc_bytes, stream);
    if (e != cudaSuccess)
        s = cuda_fail(e, "cudaMemsetAsync of the dQ accumulator");
    if (s == HEXISEQ_OK && dkv_bytes) {
        e = cudaMemsetAsync(cfg.dkv_acc, 0, dkv_bytes, stream);
        if (e != cudaSuccess)
            s = cuda_fail(e, "cudaMemsetAsync of the dK, dV accumulators");
    }
    if (s == HEXISEQ_OK) {
        HEXISEQ_LAUNCH(attn_bwd_delta_kernel<T>, (unsigned)delta_blocks, kThreads, 0, stream, *p, cfg);
        s = check_launch("attn_bwd_delta_kernel launch");
    }
    if (s == HEXISEQ_OK && lb) {
        HEXISEQ_LAUNCH(attn_doc_chunks_kernel, (unsigned)ceil_div(p->batch * cfg.doc_chunks, kThreads), kThreads, 0,
                       stream, *p, cfg);
        s = check_launch("attn_doc_chunks_kernel launch");
        if (s == HEXISEQ_OK) {
            HEXISEQ_LAUNCH(attn_doc_suffix_kernel, (unsigned)ceil_div(p->batch, kThreads / 32), kThreads, 0, stream,
                           *p, cfg);
            s = check_launch("attn_doc_suffix_kernel launch");
        }
    }
    if (s == HEXISEQ_OK) {
        // D = 128: the staged kernel where the device's shared memory holds it (170.5 KiB), else the register
        // design. D = 64: the register design unless forced (on an H100 it ran 0-3% faster than the staged one,
        // whose shared-memory saving matters less when a warp's tiles are only 64 columns deep; both are timed side
        // by side in benchmarks/results/cuda_attention.md).
        const int limit = smem_optin_limit();
        switch (D) {
        case 64:
            if (force && strcmp(force, "staged") == 0 && limit >= BwdStagedTiles<64>::bytes)
                s = launch_bwd_staged<T, 64>(*p, cfg, stream);
            else
                s = launch_bwd_mma<T, 64>(*p, cfg, stream);
            break;
        case 128:
            if (staged_ok && limit >= BwdStagedTiles<128>::bytes)
                s = launch_bwd_staged<T, 128>(*p, cfg, stream);
            else if (limit >= BwdMmaTiles<128>::bytes)
                s = launch_bwd_mma<T, 128>(*p, cfg, stream);
            else
                s = launch_bwd_mma<T, 128, 64>(*p, cfg, stream);
            break;
        default: s = launch_bwd_mma<T, 256>(*p, cfg, stream); break;
        }
    }
    if (s == HEXISEQ_OK) {
        const int64_t n = rows * p->head_dim;
        const int64_t blocks = ceil_div(n, kThreads) < (1 << 20) ? ceil_div(n, kThreads) : (1 << 20); // grid-stride
        HEXISEQ_LAUNCH(attn_bwd_dq_kernel<T>, (unsigned)blocks, kThreads, 0, stream, *p, cfg);
        s = check_launch("attn_bwd_dq_kernel launch");
    }
    if (s == HEXISEQ_OK && dkv_bytes) {
        const int64_t n = (int64_t)kv_elems;
        const int64_t blocks = ceil_div(n, kThreads) < (1 << 20) ? ceil_div(n, kThreads) : (1 << 20);
        HEXISEQ_LAUNCH(attn_bwd_dkv_kernel<T>, (unsigned)blocks, kThreads, 0, stream, *p, cfg);
        s = check_launch("attn_bwd_dkv_kernel launch");
    }
    e = cudaFreeAsync(scratch, stream);
    if (e != cudaSuccess && s == HEXISEQ_OK)
        s = cuda_fail(e, "cudaFreeAsync of the backward scratch");
    return s;
}

} // namespace

// The shared checks, then the kernels for the dtype.
// The kernels see the canonical mask (hexiseq_attn_canonical_mask, as in the forward).
extern "C" hexiseq_status hexiseq_attn_backward_cuda(const hexiseq_attn_params *p, void *stream) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(check_params(p, 1));
    hexiseq_attn_params c = *p;
    hexiseq_attn_canonical_mask(&c);
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (c.dtype == HEXISEQ_DTYPE_F16)
        return backward_typed<__half>(&c, st);
    return backward_typed<__nv_bfloat16>(&c, st);
}
