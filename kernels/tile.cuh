// Shared tile code of the CUDA attention kernels: dtype conversions, shared-memory tile loads and the mma.sync,
// ldmatrix and cp.async primitives the forward and backward kernels are built from; and the kernels' overview.
//
// The CUDA attention kernels (forward, backward, merge), behind the C launchers of kernels/launch.h:
//   tile.cuh             this file: the overview below and the device code every kernel uses
//   host.cuh             host side of the launchers: params checks, 16-byte load legality, shared-memory opt-in
//   forward.cu           the forward kernel and its launchers (with the split of long key blocks), the merge entry
//   merge.cuh            the merge kernel, and the fill and store kernels of the split forward
//   backward.cu          the register backward kernel (attn_bwd_mma_kernel), the delta and dq kernels, the launchers
//   backward.cuh         what the backward kernels share: their launch parameters and the dQ atomics
//   backward_staged.cuh  the staged backward kernel (attn_bwd_staged_kernel) and its launcher
//   documents.cuh        the backward's per-row lower bounds (document mask, window): two small kernels and the
//                        per-tile helpers
//   entry.cu, device_info.cu the library's export table and its CUDA runtime queries
// setup.py compiles each .cu file on its own and links them into libhexiseq_cuda.so; code two of them use lives in
// the .cuh headers (include guards; internal linkage, so each .cu file holds its own copy of what it uses).
//
// STATUS: run on an NVIDIA H100 80GB HBM3 (torch 2.11, CUDA 13.0; benchmarks/run_gpu_checks.sh): tests/test_cuda_ops.py
// (against float64 references, torch SDPA and the CPU kernels) passes, compute-sanitizer memcheck, racecheck and
// synccheck report nothing at head dims 64/80/128/256, and the speed next to torch's FlashAttention-2 backend is in
// benchmarks/results/cuda_attention.md (forward 0.85-1.01x of it, backward 0.64-0.76x, bf16, 4K-32K tokens, head dims
// 64 and 128). The logic is also tested without a GPU: tests/c/test_cuda_emu.cpp compiles these files unchanged as C++
// against a CPU emulator of the CUDA subset used here (tests/c/cuda_emu/emu.h: blocks of fiber threads, barriers,
// shuffles, mma.sync and ldmatrix with the PTX ISA's documented layouts, cp.async) and checks forward, backward and
// merge against the CPU kernels in float64 (odd sizes, every causal offset case, GQA/MQA, padded head dims, strides, a
// 99 KiB shared-memory device), under four thread schedules to expose missing barriers, with shared-memory bounds and
// ldmatrix bank conflicts checked. CI runs that; a change here should also be run on a GPU before its speed or its
// memory ordering is claimed. The forward's split of key blocks longer than 2^16 keys into pieces (forward_typed; the
// emulator test covers it with 64- and 128-key pieces) ran on an H200 against float64 at 65,537, 69,536 and 131,149
// keys (benchmarks/gpu_split_and_documents.py); blocks up to 2^16 keys take the single-launch path.
// These files were one (kernels/attention.cu) until it was split by concern, and three loops the kernels had
// written out more than once were shared (causal_diag, load_row_stats, load_kv_tiles): every kernel, compiled for
// sm_80 and sm_90 (-O3), has byte-identical machine code before and after. The split files then ran on an NVIDIA
// H200 (benchmarks/results/gpu/h200_split_kernels.md): the CUDA tests (the document mask's cases among them), the
// sanitizers and the acceptance check pass, at the same ratios to flash as before.
// The sliding window and logit soft-capping (the LB instances' window bound and the CAP instances) are tested on the
// emulator (test_window_softcap) against a float64 reference; the plain instances compiled for sm_80 and sm_90 have the
// same machine code as before them (nvdisasm, modulo addresses); H200 timings: benchmarks/results/gpu/variants_h200.md.
//
// Semantics are those of csrc/attention/attention.h and the CPU reference: causal means key_pos <= query_pos on
// absolute positions (q_pos0 + i, k_pos0 + j); a fully masked row gives O = 0, LSE = -inf and no gradient;
// the backward takes O and LSE as given and computes D = rowsum(dO * O) itself; the merge is computed in
// double and is an exact no-op for lse_part = -inf. Sliding window and soft-capping as in attention.h: the launchers
// rewrite every call into its canonical mask (hexiseq_attn_canonical_mask: unwindowed, or causal with a left window),
// so the kernels see a window only as a per-row lower bound next to the document start (row_low below).
//
// Design (FlashAttention-2 structure, written for readability):
//   * dtypes: float16 and bfloat16 inputs, fp32 accumulation everywhere (S, P, O, dK, dV, dQ). float32 and
//     float64 forward/backward return HEXISEQ_ERR_UNSUPPORTED (use the CPU kernels); the merge takes all four.
//   * head_dim 1..256: the kernels are compiled for D = 64, 128, 256; a head_dim d is served by the smallest
//     D >= d with columns d..D-1 zero-filled on load and never stored (zero columns change no dot product).
//   * strides: any element strides (negative too). Tiles are loaded with 16-byte vector loads when the
//     head_dim stride is 1, d % 8 == 0, the base is 16-byte aligned and the other strides are multiples of 8;
//     otherwise element by element (correct, slower).
//   * the kernels: forward.cu (forward), backward.cu (register backward), backward_staged.cuh (backward with the
//     scores staged in shared memory), merge.cuh (merge), documents.cuh (document mask, window); each file's comment has
//     its design.
//
// Resource usage (nvcc 13.0 --resource-usage, -O3; bf16 shown, f16 within a few registers):
//   forward (128 threads), registers, D = 64 / 128 / 256 (D = 128 with BK = 32 in brackets):
//     sm_80  210 / 255 (245) / 239   sm_90  224 / 255 (241) / 240   D = 128 with BK = 64 spills: 36 / 72 bytes
//     (sm_80), 36 / 84 (sm_90) of stores / loads. It stays the default because on an H100 it still ran 0.97-1.10x
//     the speed of the spill-free BK = 32 instance, median 1.03x (benchmarks/results/cuda_attention.md, one run).
//   backward register kernel (256 threads; the D = 128 instance with 64-key tiles, 128 threads, in brackets),
//   registers, D = 64 / 128 / 256:
//     sm_80  242 / 248 (255) / 255   sm_90  244 / 250 (255) / 244   (no spills; the dK, dV accumulators take
//     2 x 64 floats per thread at D = 128 and 256, 2 x 32 at D = 64)
//   backward staged kernel (256 threads), D = 64 / 128: sm_80 221 / 252, sm_90 222 / 247 (no spills; its phase-1
//     loops are unrolled by 2, not fully: fully unrolled, the D = 128 instance spilled 80 bytes)
//   lower-bound (LB: document mask, window), soft-capping (CAP) and LB + CAP instances, registers sm_80 / sm_90
//   (nvcc 13.0 -O3 -Xptxas -v; spill stores / loads in brackets, none where not given):
//     forward, D = 64 / 128 (BK 64) / 128 (BK 32) / 256:
//       LB        230 / 230, 255 (68/124) / 255 (56/56), 253 / 255 (8/28), 241 / 244
//       CAP       254 / 251, 255 / 255, 249 / 251, 239 / 240
//       LB + CAP  254 / 254, 255 (68/124) / 255 (108/116), 254 / 255 (56/72), 241 / 244
//     register backward, D = 64 / 128 (BK 128) / 128 (BK 64) / 256:
//       LB        sm_80 245 / 250 / 255 (4/4) / 252, sm_90 243 / 241 / 253 / 254
//       CAP       sm_80 238 / 245 / 255 / 255, sm_90 239 / 246 / 255 / 254
//       LB + CAP  sm_80 242 / 250 / 255 (4/4) / 252, sm_90 244 / 244 / 253 / 254
//     staged backward, D = 64 / 128: LB and LB + CAP sm_80 226 / 249, sm_90 227 / 255; CAP sm_80 222 / 253, sm_90
//       222 / 247
//     The plain instances are unchanged by them: the same machine code (nvdisasm of the sm_80 and sm_90 cubins before
//     and after, modulo addresses and helper names). The window made the LB forward's D = 128 instances spill more on
//     one target each (sm_80 BK 64: 56 / 76 bytes before; sm_90 BK 32: none before), the other LB instances did not
//     change by more than 3 registers.
//   delta 32-40, dq 28-30, merge 66-68, split-forward store 28-30, document bounds 28-32 registers; no spills
//   dynamic shared memory per CTA (opted in with cudaFuncSetAttribute on every launch):
//     forward  D=64: 54 KiB   D=128: 102 KiB   D=256: 99 KiB (Q [BQ][D+8], 2 x K and V [BK][D+8], 16-bit)
//     backward, register kernel: D=64 (BQ 64, BK 128): 90.5 KiB   D=128 (BQ 32, BK 128): 112.3 KiB (BK 64:
//              73.3 KiB)   D=256 (BQ 16, BK 64): 118.3 KiB (K, V [BK][D+8], 2 x Q and dO, dS^T, at D = 256 the
//              partial-score exchange)
//     backward, staged kernel (BQ 64, BK 128): D=64: 106.5 KiB   D=128: 170.5 KiB (K, V, 2 x Q and dO, P, dS)
//   The staged D = 128 backward needs sm_90's 227 KiB; elsewhere the register kernel runs. Everything else fits
//   the 163 KiB opt-in limit of sm_80. On GPUs with less (sm_86/89: 99 KiB) the D = 128 forward runs its BK = 32
//   instance (68 KiB) and the D = 128 backward the register kernel's BK = 64 instance (73.3 KiB; all chosen at
//   launch from the device's limit), and the D = 256 backward gets HEXISEQ_ERR_CUDA from cudaFuncSetAttribute.
//   HEXISEQ_CUDA_BACKWARD=staged|register and HEXISEQ_CUDA_FORWARD_KEYS=64|32 force a variant where it fits (for
//   timing one against the other; an unknown value is refused by name).
#ifndef HEXISEQ_KERNELS_TILE_CUH
#define HEXISEQ_KERNELS_TILE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "attention.h"

namespace {

constexpr int kThreads = 256; // threads per CTA of the small kernels (delta, dq, merge)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ------------------------------------------------------------------------------------------------
// Element conversions

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; } // the forward's float partials

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// 2^x by the special-function unit alone (ex2.approx.ftz: relative error about 2^-22, subnormal results flushed to
// 0, 2^-inf = 0). exp2f without fast-math guards the subnormal range around it (a compare, two multiplies and
// predicated moves per call: in the backward's SASS that was about a third of the P and dS code). The emulator
// uses exp2f.
#ifdef HEXISEQ_CUDA_EMU
__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
#else
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif

// tanh for logit soft-capping: (1 - e) / (1 + e), e = exp(-2 |x|) from fast_exp2, the sign put back. The capped score
// softcap tanh(x) enters the softmax through exp(score - LSE), which turns an absolute error of the score into a
// relative one of P: what counts is tanh's absolute error, here a few 1e-8 (ex2.approx's 2^-22 relative error and
// the division's 2 ulp, on values in [0, 1]), times softcap. tanh.approx.f32 is faster but errs by up to 2^-11
// relative, 0.025 of a score at softcap 50; tanhf is exact to an ulp but costs a branchy polynomial per score (the
// forward ran 1.40x the plain kernel with it at 8K tokens on an H200). NaN stays NaN, +-inf gives +-1.
__device__ __forceinline__ float cap_tanh(float x) {
    const float e = fast_exp2(-2.8853900817779268f * fabsf(x)); // 2 log2(e) |x|
    return copysignf(__fdividef(1.0f - e, 1.0f + e), x);
}

// ------------------------------------------------------------------------------------------------
// Shared-memory building blocks

// dst[r][c] (ld LD) = src[r * row_stride + c * col_stride] for r < n_rows, c < d; 0 elsewhere in [ROWS][D].
// src: row 0, column 0 of the tile in global memory. vec: 16-byte loads are legal (see the strides above).
template <typename T, int ROWS, int D, int LD, int NT>
__device__ void load_tile(T *dst /* [ROWS][LD] smem */, const T *src, int64_t row_stride, int64_t col_stride,
                          int64_t n_rows, int d, bool vec) {
    if (vec) {
        constexpr int CH = D / 8; // 16-byte chunks per row
        for (int idx = threadIdx.x; idx < ROWS * CH; idx += NT) {
            const int r = idx / CH, c = idx % CH * 8;
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (r < n_rows && c < d)
                val = *reinterpret_cast<const uint4 *>(src + r * row_stride + c);
            *reinterpret_cast<uint4 *>(dst + r * LD + c) = val;
        }
    } else {
        for (int idx = threadIdx.x; idx < ROWS * D; idx += NT) {
            const int r = idx / D, c = idx % D;
            T val = from_f32<T>(0.0f);
            if (r < n_rows && c < d)
                val = src[r * row_stride + c * col_stride];
            dst[r * LD + c] = val;
        }
    }
}

// The causal mask of a query tile at row q0 (BQ rows) against a key tile at key k0 (BK keys): key c of the key tile
// is visible to row r of the query tile iff k_pos0 + k0 + c <= q_pos0 + q0 + r, i.e. c - r <= diag. diag is clamped
// to [-BQ, BK] so the per-element test is 32-bit: with 0 <= r < BQ and 0 <= c < BK the clamp changes no comparison.
// Not causal: BK (every key visible).
template <int BQ, int BK>
__device__ __forceinline__ int causal_diag(const hexiseq_attn_params &p, int64_t q0, int64_t k0) {
    return p.causal ? (int)max((int64_t)-BQ, min((int64_t)BK, p.q_pos0 + q0 - p.k_pos0 - k0)) : BK;
}

// The per-row lower bound of the canonical mask (hexiseq_attn_canonical_mask; the launchers pass its form): the first
// absolute key position query row i of batch row b may see, the larger of its document start (q_doc) and, with a
// window, q_pos0 + i - window_left; INT64_MIN when neither applies. It may be negative (a window reaching before
// position 0), so every use clamps it against a key position (`start > key ? start - key : 0`). The only reader of
// q_doc in the kernels: the lower-bound instances (template flag LB) take every bound through it.
__device__ __forceinline__ int64_t row_low(const hexiseq_attn_params &p, int64_t b, int64_t i) {
    int64_t lo = p.window ? p.q_pos0 + i - p.window_left : INT64_MIN; // no overflow: the bounds fit the block
    if (p.q_doc != nullptr)
        lo = max(lo, p.q_doc[b * p.q_doc_stride[0] + i * p.q_doc_stride[1]]);
    return lo;
}

// Byte size of a shared buffer rounded up to 128 bytes, so every buffer carved after it stays aligned.
constexpr int smem_round(int bytes) { return (bytes + 127) / 128 * 128; }

// ------------------------------------------------------------------------------------------------
// Register-level tensor-core primitives (the forward): mma.sync m16n8k16 with fp32 accumulators and ldmatrix.
// Fragment layouts, g = lane / 4, t = lane % 4, two 16-bit elements per register (lower index in the low half):
//   A (16x16): reg 0 = (row g, cols 2t, 2t+1), reg 1 = (row g+8, same), reg 2 = (row g, cols 2t+8, 2t+9),
//              reg 3 = (row g+8, cols 2t+8, 2t+9);   B (16x8): reg 0 = (rows 2t, 2t+1; col g), reg 1 = rows + 8;
//   C (16x8, fp32): c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1).
// So the C fragments of two adjacent 16x8 score tiles, converted to 16 bits, are exactly the A fragment of the
// next product (P V): the probabilities never leave registers. The CPU emulator (tests/c/cuda_emu) implements
// the same two instructions from the same layouts.

#ifdef HEXISEQ_CUDA_EMU
template <typename T> __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                              uint32_t b1) {
    hexiseq_emu_mma16816<std::is_same<T, __nv_bfloat16>::value>(d, a, b0, b1);
}
template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *row_address) {
    hexiseq_emu_ldmatrix_x4<TRANS>(r, row_address);
}
#else
template <typename T> __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                              uint32_t b1) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Lanes 8i .. 8i+7 give the (16-byte aligned, shared) row addresses of 8x8 matrix i, which lands in r[i].
template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *row_address) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row_address);
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
}
#endif

// cp.async: 16 bytes global -> shared without passing through registers (valid = false: zero-fill, no read);
// the copies of a thread complete by commit group, cp_async_wait<N> waiting until at most N groups are pending.
#ifdef HEXISEQ_CUDA_EMU
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    hexiseq_emu::cp_async16(dst, src, valid);
}
__device__ __forceinline__ void cp_async_commit() { hexiseq_emu::cp_async_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { hexiseq_emu::cp_async_wait(N); }
#else
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// Two tiles with the same rows (K and V, or Q and dO) through cp.async, the caller committing and waiting; load_tile's
// zero fill and 16-byte legality rule. A thread copies the chunk at column lc of rows lr, lr + RS, ... of both, its
// source pointers advancing by one add per row: written as src + r * row_stride per chunk, the compiler kept every
// chunk's 64-bit offset in registers across the caller's loop, and the forward (two m-blocks per warp) and the
// backward spilled.
template <typename T, int ROWS, int D, int LD, int NT>
__device__ __forceinline__ void load_tile_pair_async(T *dst0, const T *src0, int64_t stride0, T *dst1, const T *src1,
                                                     int64_t stride1, int64_t n_rows, int d) {
    constexpr int CH = D / 8, RS = NT / CH; // 16-byte chunks per row; rows per pass of the CTA
    static_assert(NT % CH == 0 && ROWS % RS == 0, "every thread copies the same chunk column of ROWS / RS rows");
    const int lr = threadIdx.x / CH, lc = threadIdx.x % CH * 8;
    const T *p0 = src0 + lr * stride0 + lc, *p1 = src1 + lr * stride1 + lc;
#pragma unroll
    for (int i = 0; i < ROWS / RS; ++i, p0 += RS * stride0, p1 += RS * stride1) {
        const int r = lr + i * RS;
        const bool ok = r < n_rows && lc < d; // else zero-filled, nothing read
        cp_async16(dst0 + r * LD + lc, ok ? p0 : src0, ok);
        cp_async16(dst1 + r * LD + lc, ok ? p1 : src1, ok);
    }
}

__device__ __forceinline__ uint32_t bits16(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
// Two floats rounded to T and packed as one register (lo in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return bits16(from_f32<T>(lo)) | (bits16(from_f32<T>(hi)) << 16);
}

// The C fragments of two adjacent 16x8 blocks (columns 0-7 and 8-15), rounded to T: the A fragment of the 16x16
// block they form.
template <typename T>
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack2<T>(c0[0], c0[1]);
    a[1] = pack2<T>(c0[2], c0[3]);
    a[2] = pack2<T>(c1[0], c1[1]);
    a[3] = pack2<T>(c1[2], c1[3]);
}

// Fragments from 16-bit tiles in shared memory (tile[row * ld + col]), one ldmatrix.x4 each; this lane's row
// address picks which 8x8 matrix lands in which register.
// A fragment of the 16x16 block A[m][k] = tile[m0 + m][k0 + k].
template <typename T> __device__ __forceinline__ void load_a(uint32_t (&a)[4], const T *tile, int ld, int m0, int k0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4<false>(a, tile + (m0 + lane % 16) * ld + k0 + (lane / 16) * 8);
}
// A fragment of A[m][k] = tile[k0 + k][m0 + m] (the tile holds A transposed).
template <typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T *tile, int ld, int m0, int k0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4<true>(a, tile + (k0 + 8 * (lane / 16) + lane % 8) * ld + m0 + 8 * ((lane / 8) % 2));
}
// B fragments of the two 16x8 blocks B[k][n0 .. n0+15] when B[k][n] = tile[n][k0 + k] (tile rows are B's
// columns, e.g. K in Q K^T): b[0], b[1] for columns n0 .. n0+7, b[2], b[3] for n0+8 .. n0+15.
template <typename T>
__device__ __forceinline__ void load_b_cols(uint32_t (&b)[4], const T *tile, int ld, int n0, int k0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4<false>(b, tile + (n0 + 8 * (lane / 16) + lane % 8) * ld + k0 + 8 * ((lane / 8) % 2));
}
// The same when B[k][n] = tile[k0 + k][n] (tile rows are B's rows, e.g. V in P V).
template <typename T>
__device__ __forceinline__ void load_b_rows(uint32_t (&b)[4], const T *tile, int ld, int k0, int n0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4<true>(b, tile + (k0 + 8 * ((lane / 8) % 2) + lane % 8) * ld + n0 + 8 * (lane / 16));
}

} // namespace

#endif // HEXISEQ_KERNELS_TILE_CUH
