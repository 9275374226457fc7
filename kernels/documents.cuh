// The per-row lower bounds (document mask, sliding window) for the CUDA attention backward kernels: two small kernels
// writing per-chunk bounds, and the helpers with which a key tile's CTA picks and masks its query tiles.
//
// Per-row lower bound: in the canonical mask the launchers pass (hexiseq_attn_canonical_mask, attention.h), key j is
// visible to query i iff low_i <= k_pos0 + j <= q_pos0 + i, where low_i (row_low, tile.cuh) is the larger of the
// document start q_doc[b, i] (packed sequences) and, with a window, q_pos0 + i - window_left. Both masks are thus one
// code path: instances of their own of the forward and of both backward kernels (template flag LB, launched when
// q_doc != NULL or window), so the plain ones carry none of it; every read of q_doc goes through row_low. A window's
// bound can be negative (before position 0): every clamp against a key position takes that as "no bound". Forward:
// each CTA reduces its rows' smallest and largest bound once; the key loop starts at the tile holding the smallest
// (earlier tiles are neither loaded nor computed: under a window a query tile walks only the key tiles of its window),
// and only tiles beginning before the largest compute the rows' bounds for the per-element mask. Backward: two small
// kernels write per 16-row chunk the smallest and largest bound and the suffix minimum; a key tile's CTA walks only
// the query tiles some row of which may see it and stops once the suffix minimum passes its last key (a window's
// bounds grow with the row, so the walk ends right after the window); the per-element mask runs only in steps whose
// tile holds a bound past the key tile's first key. Rows that see nothing: O = 0, LSE = -inf, no gradient, as under
// the causal mask. The document mask ran on an H200: its cases of tests/test_attention_ops.py pass and the sanitizers
// report nothing (benchmarks/results/gpu/h200_split_kernels.md); the window is tested on the CPU emulator only
// (tests/c/test_cuda_emu.cpp, test_window_softcap).
#ifndef HEXISEQ_KERNELS_DOCUMENTS_CUH
#define HEXISEQ_KERNELS_DOCUMENTS_CUH

#include "attention.h"
#include "backward.cuh"

namespace {

// The lower bounds' per-chunk extremes for the backward kernels, which walk query tiles for a fixed key tile: a tile
// whose every bound lies past the key tile's last key is skipped (its smallest bound: the min over its chunks, every
// query tile being whole chunks), and once the suffix minimum passes that key no later tile can see it either, so the
// walk stops (exactly after the last visible tile when the bounds do not decrease, as in packed sequences and under
// a window, and correctly, if later, for any bounds). Chunks of 16 rows: every backward query tile (16, 32, 64 rows)
// is whole ones.
constexpr int kDocChunk = 16;

// doc_min, doc_max of chunk c of batch row b, one thread per (b, c).
__global__ void attn_doc_chunks_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; // b * doc_chunks + c
    if (idx >= p.batch * cfg.doc_chunks)
        return;
    const int64_t b = idx / cfg.doc_chunks, i0 = idx % cfg.doc_chunks * kDocChunk;
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = i0; i < min(i0 + kDocChunk, p.seq_q); ++i) {
        const int64_t s = row_low(p, b, i);
        lo = min(lo, s);
        hi = max(hi, s);
    }
    cfg.doc_min[idx] = lo;
    cfg.doc_max[idx] = hi;
}

// doc_suf[b][c] = min over chunks c' >= c of doc_min[b][c']: one warp per batch row, 32 chunks at a time from the
// end (a suffix scan within the window, then the minimum of everything after it).
__global__ void attn_doc_suffix_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    const int64_t b = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (b >= p.batch) // whole warps: blockDim is a multiple of 32
        return;
    const int64_t n = cfg.doc_chunks;
    int64_t after = INT64_MAX; // the smallest start of the chunks past the window
    for (int64_t w = (n - 1) / 32 * 32; w >= 0; w -= 32) {
        const int64_t c = w + lane;
        int64_t x = c < n ? cfg.doc_min[b * n + c] : INT64_MAX;
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t y = __shfl_down_sync(0xffffffffu, x, o);
            if (lane + o < 32)
                x = min(x, y);
        }
        x = min(x, after);
        if (c < n)
            cfg.doc_suf[b * n + c] = x;
        for (int o = 16; o > 0; o >>= 1) // lane 0's x, on every lane: the window's minimum and what follows it
            x = min(x, __shfl_xor_sync(0xffffffffu, x, o));
        after = x;
    }
}

// The first tile start q0' >= q0 (q0 a tile start, q0' = q0 + a multiple of BQ) of a query tile with a row whose
// lower bound lies at or before key_last, the key tile's last key (absolute); seq_q when there is none. The same for
// every thread of the CTA (uniform loads).
template <int BQ>
__device__ int64_t doc_next_tile(const hexiseq_attn_params &p, const BwdLaunch &cfg, int64_t b, int64_t q0,
                                 int64_t key_last) {
    static_assert(BQ % kDocChunk == 0, "query tiles are whole document chunks");
    const int64_t *mn = cfg.doc_min + b * cfg.doc_chunks, *suf = cfg.doc_suf + b * cfg.doc_chunks;
    for (; q0 < p.seq_q; q0 += BQ) {
        const int64_t c = q0 / kDocChunk;
        if (suf[c] > key_last)
            break; // every row from here on has its bound past the key tile
        int64_t lo = mn[c];
        for (int i = 1; i < BQ / kDocChunk && c + i < cfg.doc_chunks; ++i)
            lo = min(lo, mn[c + i]);
        if (lo <= key_last)
            return q0;
    }
    return p.seq_q;
}

// Whether a row of the query tile at q0 has its lower bound after key_first, the key tile's first key (absolute):
// only then do its keys need the per-element lower-bound mask.
template <int BQ>
__device__ bool doc_tile_cut(const BwdLaunch &cfg, int64_t b, int64_t q0, int64_t key_first) {
    const int64_t *mx = cfg.doc_max + b * cfg.doc_chunks;
    const int64_t c = q0 / kDocChunk;
    int64_t hi = mx[c];
    for (int i = 1; i < BQ / kDocChunk && c + i < cfg.doc_chunks; ++i)
        hi = max(hi, mx[c + i]);
    return hi > key_first;
}

// Lower bounds of the query tile's rows as key-tile columns clamped to [0, BK] (the first key each row may see;
// BK: none; a bound before the tile, negative ones included: 0), into doc_s[r] for r < BQ (0 past nq). Threads r,
// r + NT, ...
template <int BQ, int BK, int NT>
__device__ __forceinline__ void doc_tile_starts(int *doc_s, const hexiseq_attn_params &p, int64_t b, int64_t q0, int nq,
                                                int64_t key_first) {
    for (int r = threadIdx.x; r < BQ; r += NT) {
        const int64_t start = r < nq ? row_low(p, b, q0 + r) : 0;
        doc_s[r] = start > key_first ? (int)min((int64_t)BK, start - key_first) : 0; // no overflow: key_first >= 0
    }
}

} // namespace

#endif // HEXISEQ_KERNELS_DOCUMENTS_CUH
