// What the CUDA attention backward kernels share: their launch parameters (BwdLaunch) and the dQ atomic adds.
#ifndef HEXISEQ_KERNELS_BACKWARD_CUH
#define HEXISEQ_KERNELS_BACKWARD_CUH

#include "attention.h"
#include "tile.cuh"

namespace {

// What the backward's launch decides, next to the params (see FwdLaunch in forward.cu).
struct BwdLaunch {
    float *delta;    // [batch, heads, seq_q] contiguous scratch: D = rowsum(dO * O)
    float *dq_acc;   // [batch, heads, seq_q, head_dim] contiguous scratch: fp32 dQ (already scaled)
    int64_t n_ktiles; // key tiles per (batch, kv head): the grid is n_ktiles x (kv_heads x splits) x batch
    int32_t group;   // heads / kv_heads
    // The query heads of a GQA group split over `splits` CTAs per key tile, heads_per = group / splits each (more
    // CTAs where one per kv head would leave the GPU idle: 16/4 heads at 8K tokens made 512 CTAs on 132 SMs, each
    // walking 4 heads, and the causal backward took as long as the full one). With splits > 1 the CTAs add their
    // scaled dK, dV into dkv_acc (fp32 [2][batch, seq_k, kv_heads, head_dim], zeroed) and attn_bwd_dkv_kernel
    // writes dk, dv; with splits = 1 dkv_acc is null and each CTA stores its own.
    int32_t splits, heads_per;
    float *dkv_acc;
    int32_t vec_q, vec_k, vec_v, vec_do; // 16-byte loads allowed for that tensor (vec_ok)
    float scale, scale_log2; // the softmax scale in fp32, and times log2(e)
    // Lower-bound instances only (document mask or window; attn_doc_chunks_kernel, attn_doc_suffix_kernel): per batch
    // row and chunk of kDocChunk query rows, the smallest and largest bound (row_low), and the smallest bound of that
    // chunk and every later one.
    int64_t *doc_min, *doc_max, *doc_suf; // [batch][doc_chunks] scratch
    int64_t doc_chunks;                         // ceil(seq_q / kDocChunk)
    // Soft-capping instances only (CAP): scale / softcap (t = tanh(s scale / softcap), the capped score softcap t), and
    // softcap log2(e) (P = exp2(t softcap log2(e) - LSE log2(e))).
    float cap_scale, cap_log2;
};
static_assert(sizeof(hexiseq_attn_params) + sizeof(BwdLaunch) <= 4096, "kernel parameters past 4 KiB");

// LSE (times log2(e)) and D of the query tile's rows into shared memory, lse_s[r] and delta_s[r] for r < BQ: -inf and
// 0 past the tile's nq rows. lseg: the LSE of the head's row 0 (rows lse_stride apart); deltag: D of the head's row 0.
// Threads r, r + NT, ...
template <int BQ, int NT>
__device__ __forceinline__ void load_row_stats(float *lse_s /* [BQ] smem */, float *delta_s /* [BQ] smem */,
                                               const float *lseg, int64_t lse_stride, const float *deltag, int64_t q0,
                                               int nq) {
    for (int r = threadIdx.x; r < BQ; r += NT) {
        lse_s[r] = r < nq ? lseg[(q0 + r) * lse_stride] * kLog2e : -INFINITY;
        delta_s[r] = r < nq ? deltag[q0 + r] : 0.0f;
    }
}

// The key tile's K and V rows (nk of BK) into shared memory (load_tile; vec_k, vec_v: 16-byte loads legal).
template <typename T, int BK, int D, int LDT, int NT>
__device__ __forceinline__ void load_kv_tiles(T *ks /* [BK][LDT] smem */, T *vs /* [BK][LDT] smem */,
                                              const T *kg /* K row 0 of the key tile */,
                                              const T *vg /* V row 0 of the key tile */, const hexiseq_attn_params &p,
                                              int nk, bool vec_k, bool vec_v) {
    load_tile<T, BK, D, LDT, NT>(ks, kg, p.k_stride[1], p.k_stride[3], nk, p.head_dim, vec_k);
    load_tile<T, BK, D, LDT, NT>(vs, vg, p.v_stride[1], p.v_stride[3], nk, p.head_dim, vec_v);
}

// dQ accumulation: p[0] += x, p[1] += y in global memory, atomically per float (p 8-byte aligned). On sm_90 one
// vector reduction (red.global.add.v2.f32, PTX ISA 8.1) instead of two atomicAdd: half the atomic instructions,
// and the 4 lanes of a quad write 8 consecutive floats of a row (one whole 32-byte sector when d % 8 == 0)
// instead of every other float of them. Other targets: two atomicAdd. The CPU emulator checks the alignment
// and adds the two floats.
#ifdef HEXISEQ_CUDA_EMU
__device__ __forceinline__ void red_add_f32x2(float *p, float x, float y) { hexiseq_emu::red_add_f32x2(p, x, y); }
#else
__device__ __forceinline__ void red_add_f32x2(float *p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}
#endif

} // namespace

#endif // HEXISEQ_KERNELS_BACKWARD_CUH
