// CUDA attention kernels (forward, backward, merge) behind the C launchers of kernels/launch.h.
//
// STATUS: run on an NVIDIA H100 80GB HBM3 (torch 2.11, CUDA 13.0; benchmarks/run_gpu_checks.sh): tests/test_cuda_ops.py
// (against float64 references, torch SDPA and the CPU kernels) passes, compute-sanitizer memcheck, racecheck and
// synccheck report nothing at head dims 64/80/128/256, and the speed next to torch's FlashAttention-2 backend is in
// benchmarks/results/cuda_attention.md (forward 0.85-1.01x of it, backward 0.64-0.76x, bf16, 4K-32K tokens, head dims
// 64 and 128). The logic is also tested without a GPU: tests/c/test_cuda_emu.cpp compiles this file unchanged as C++
// against a CPU emulator of the CUDA subset used here (tests/c/cuda_emu/emu.h: blocks of fiber threads, barriers,
// shuffles, mma.sync and ldmatrix with the PTX ISA's documented layouts, cp.async) and checks forward, backward and
// merge against the CPU kernels in float64 (odd sizes, every causal offset case, GQA/MQA, padded head dims, strides, a
// 99 KiB shared-memory device), under four thread schedules to expose missing barriers, with shared-memory bounds and
// ldmatrix bank conflicts checked. CI runs that; a change here should also be run on a GPU before its speed or its
// memory ordering is claimed. Not yet run on a GPU: the forward's split of key blocks longer than 2^16 keys into
// pieces (forward_typed; the emulator test covers it with 64- and 128-key pieces); blocks up to 2^16 keys take the
// unchanged single-launch path.
//
// Semantics are those of csrc/attention.h and the CPU reference: causal means key_pos <= query_pos on
// absolute positions (q_pos0 + i, k_pos0 + j); a fully masked row gives O = 0, LSE = -inf and no gradient;
// the backward takes O and LSE as given and computes D = rowsum(dO * O) itself; the merge is computed in
// double and is an exact no-op for lse_part = -inf.
//
// Design (FlashAttention-2 structure, written for readability):
//   * dtypes: float16 and bfloat16 inputs, fp32 accumulation everywhere (S, P, O, dK, dV, dQ). float32 and
//     float64 forward/backward return HEXISEQ_ERR_UNSUPPORTED (use the CPU kernels); the merge takes all four.
//   * head_dim 1..256: the kernels are compiled for D = 64, 128, 256; a head_dim d is served by the smallest
//     D >= d with columns d..D-1 zero-filled on load and never stored (zero columns change no dot product).
//   * strides: any element strides (negative too). Tiles are loaded with 16-byte vector loads when the
//     head_dim stride is 1, d % 8 == 0, the base is 16-byte aligned and the other strides are multiples of 8;
//     otherwise element by element (correct, slower).
//   * forward: register-level tensor cores (mma.sync m16n8k16 + ldmatrix, layouts documented at the
//     primitives below). One CTA of 4 warps per (query tile of BQ rows, head, batch); each warp owns MW blocks
//     of 16 rows (MW = 2, BQ = 128 at D = 64 and 128; MW = 1, BQ = 64 at D = 256, where registers allow no
//     more), so each K and V fragment read from shared memory feeds MW independent mma chains. Q and each K/V
//     tile (64 keys, 32 at D = 256) are staged in shared memory; S = Q K^T lands in registers, the online
//     softmax (base 2, max-subtracted) runs on registers with two quad shuffles per row, the O accumulator
//     stays in registers and P goes from the score registers straight into O += P V as the A operand. Under
//     the causal mask the key loop stops after the last key any query of the tile sees, and the mask is
//     applied only to the key tiles that need it (the last, partial one and those crossing the diagonal).
//     K/V tiles are double-buffered with cp.async when their rows allow 16-byte copies (else loaded element by
//     element). Not done: Hopper wgmma/TMA/warp specialisation (FlashAttention-3's techniques). A key block longer
//     than kFwdPieceKeys (2^16) is split by the launcher into pieces whose fp32 partials are merged in double (the
//     O and row-sum registers take every key in turn, so their fp32 error grows with the block; see forward_typed).
//   * backward, D = 128 where shared memory allows (attn_bwd_staged_kernel, FlashAttention-2's backward layout):
//     see the kernel's comment. P and dS are staged in shared memory so that each of the three products (S and
//     dP; dV and dK; dQ) gets its own split of the 8 warps into 32-row tiles, which reads each shared-memory
//     fragment for twice the tensor-core work of the register design below.
//   * backward otherwise (attn_bwd_mma_kernel): the same register design as the forward on the transposed problem. A
//     preprocessing kernel writes D = rowsum(dO * O) (fp32, [batch, heads, seq_q]). One CTA per (key tile, kv head,
//     batch): 128 keys and 8 warps at D = 64 and 128 (64 keys and 4 warps for D = 128 on GPUs with 99 KiB of shared
//     memory), 64 keys and 8 warps at D = 256; each warp owns 16 keys and their dK, dV accumulators in registers (at D
//     = 256 two warps split a key block's head dim and swap partial scores through shared memory), and loops over every
//     query head of its GQA group and every query tile that can see the key tile: S^T = K Q^T, P^T = exp(scale S^T -
//     LSE) (masked), dP^T = V dO^T, dV += P^T dO, dS^T = P^T (dP^T - D), dK += dS^T Q (P^T and dS^T go from registers
//     into the products as A operands); dS^T goes through shared memory so the warps can compute dQ_tile = dS K, summed
//     over the CTA's keys before it leaves the CTA (the wider the key tile, the fewer dQ atomic adds and Q, dO tile
//     reads per key). Q and dO tiles are double-buffered with cp.async when legal, the next step's in flight. dK, dV
//     are written once at the end (one thread owns each element, so no atomics; accumulate adds to the old values). dQ:
//     fp32 atomic adds into a zeroed [batch, heads, seq_q, d] scratch buffer (already scaled), then a small kernel
//     writes (or, with accumulate, adds into) dq in the input dtype. Each thread's two adjacent columns of a row go as
//     one pair: on sm_90 one vector reduction (red.global.add.v2.f32), elsewhere two atomicAdd; an odd d (pairs not
//     8-byte aligned) adds float by float. Atomics are the simple choice: the cost is that dQ is not bit-for-bit
//     deterministic (summation order of fp32 adds across key tiles varies run to run). Scratch (D and the dQ
//     accumulator) is allocated with cudaMallocAsync / cudaFreeAsync on the stream.
//   * merge: one warp per (batch, head, row); lane 0 reads both LSEs, the warp updates the row, lane 0
//     writes the new LSE last (so no thread reads an LSE another already rewrote).
//   * document mask (q_doc, packed sequences; key j visible to query i iff q_doc[b, i] <= k_pos0 + j <= q_pos0 + i):
//     instances of their own of the forward and of both backward kernels (template flag DOC), so the plain ones
//     carry none of it. Forward: each CTA reduces its rows' smallest and largest start once; the key loop starts at
//     the tile holding the smallest (earlier tiles are neither loaded nor computed), and only tiles beginning before
//     the largest read the rows' starts for the per-element mask. Backward: two small kernels write per 16-row chunk
//     the smallest and largest start and the suffix minimum; a key tile's CTA walks only the query tiles some row of
//     which may see it and stops once the suffix minimum passes its last key; the per-element mask runs only in
//     steps whose tile holds a start past the key tile's first key. Rows that see nothing: O = 0, LSE = -inf, no
//     gradient, as under the causal mask. Not yet run on a GPU (tested on the emulator only).
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
//   document-mask instances (DOC), sm_80 / sm_90: forward D = 64 233 / 233, D = 128 BK = 32 252 / 250, D = 256 241 / 244
//     (no spills), D = 128 BK = 64 255 with 56 / 76 bytes (sm_80) and 56 / 56 (sm_90) of spill stores / loads (the
//     plain instance spills there already); register backward D = 64 / 128 (BK 128) / 128 (BK 64) / 256: sm_80 242 /
//     250 / 255 / 252, sm_90 244 / 242 / 254 / 254; staged D = 64 / 128: sm_80 226 / 249, sm_90 227 / 246 (no spills);
//     the plain instances are unchanged by them (same registers, no new spill)
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
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>

#include "attention.h"
#include "launch.h"

// Every launch goes through this macro so that tests/c/cuda_emu (a CPU emulator of the CUDA subset used
// here, which compiles this file as plain C++) can substitute its own launcher for the <<<>>> syntax.
#ifndef HEXISEQ_LAUNCH
#define HEXISEQ_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

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

// One element of any hexiseq_dtype as double / stored from double (merge only: it mixes dtypes).
__device__ double load_any(const void *base, int32_t dtype, int64_t at) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: return ((const double *)base)[at];
    case HEXISEQ_DTYPE_F32: return (double)((const float *)base)[at];
    case HEXISEQ_DTYPE_F16: return (double)__half2float(((const __half *)base)[at]);
    default: return (double)__bfloat162float(((const __nv_bfloat16 *)base)[at]);
    }
}

__device__ void store_any(void *base, int32_t dtype, int64_t at, double x) {
    switch (dtype) {
    case HEXISEQ_DTYPE_F64: ((double *)base)[at] = x; break;
    case HEXISEQ_DTYPE_F32: ((float *)base)[at] = (float)x; break;
    case HEXISEQ_DTYPE_F16: ((__half *)base)[at] = __float2half_rn((float)x); break; // as the CPU: via float
    default: ((__nv_bfloat16 *)base)[at] = __float2bfloat16_rn((float)x); break;
    }
}

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

// ------------------------------------------------------------------------------------------------
// Shared-memory building blocks

// dst[r][c] (ld LD) = src[r * row_stride + c * col_stride] for r < n_rows, c < d; 0 elsewhere in [ROWS][D].
// src: row 0, column 0 of the tile in global memory. vec: 16-byte loads are legal (see the file comment).
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

// ------------------------------------------------------------------------------------------------
// Forward

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
};
static_assert(sizeof(hexiseq_attn_params) + sizeof(FwdLaunch) <= 4096, "kernel parameters past 4 KiB");

// One CTA per (query tile of BQ rows, head, batch). Q, then each K/V tile, are staged in shared memory; every
// warp computes S = Q K^T for its MW x 16 rows into registers (mma.sync), masks and scales it, runs the online
// softmax on its registers (a row's 4 owners are the 4 lanes of a quad: max and sum need two shuffles), rescales
// its O accumulator (registers) and adds P V with P taken straight from the score registers. O is stored as TO:
// T, or float for the partial results of a key block split into pieces (see forward_typed).
// DOC: the document mask (p.q_doc, device memory) is applied. A separate instance, so that the plain kernel carries
// none of its registers: the tile's smallest and largest document start, read once per CTA, give the first key tile
// any row sees (the loop starts there: earlier tiles are neither loaded nor computed) and the last that holds a
// document start past its first key (only up to there does the per-element mask read the rows' starts).
template <typename T, typename TO, int D, int BK_, bool DOC>
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

    // Document mask: every warp reduces the tile's starts itself (the same values, so the results are CTA-uniform
    // without a barrier or shared memory). Key tiles ending before the smallest start are skipped whole; a key tile
    // starting at or after the largest needs no per-element document mask.
    int64_t kbeg = 0, doc_hi = 0; // first key tile; the largest start (absolute)
    const int64_t *docg = nullptr; // q_doc of the tile's row 0
    if constexpr (DOC) {
        docg = p.q_doc + b * p.q_doc_stride[0] + q0 * p.q_doc_stride[1];
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        for (int r = lane; r < nq; r += 32) {
            const int64_t s = docg[r * p.q_doc_stride[1]];
            lo = min(lo, s);
            hi = max(hi, s);
        }
        for (int o = 16; o > 0; o >>= 1) {
            lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
            hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        if (lo > p.k_pos0) // no overflow: lo > k_pos0 >= 0
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

        // Mask (the scores stay unscaled: the scale is folded into the exponent's FFMA below). Only the last, partial
        // key tile and the tiles crossing the causal diagonal need the mask: a tile whose every key is present and at
        // or before the CTA's first query position is visible to every row (rows past nq hold zero-filled Q and are
        // never stored). Under the document mask also the tiles whose first key lies before some row's document
        // start (doc_cut). The tests are CTA-uniform.
        const bool doc_cut = DOC && p.k_pos0 + k0 < doc_hi;
        const bool all_visible = nk == BK && (!p.causal || p.k_pos0 + k0 + BK - 1 <= p.q_pos0 + q0) && !doc_cut;
        if (!all_visible) {
            // Key c of the tile is visible to tile row r iff c < nk and (causal) k_pos0 + k0 + c <= q_pos0 + q0 + r,
            // i.e. c <= diag + r. diag is clamped to [-BQ, BK] so the rest is 32-bit: with 0 <= r < BQ and
            // 0 <= c < BK the clamp changes no comparison.
            const int diag = p.causal ? (int)max((int64_t)-BQ, min((int64_t)BK, p.q_pos0 + q0 - p.k_pos0 - k0)) : BK;
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    // This thread's columns are 8j + 2t + e: visible iff 8j + e <= last, a compare with a constant.
                    const int last = min((int)nk - 1, diag + row0 + 16 * mb + 8 * i) - 2 * t;
                    if (doc_cut) {
                        // and (document) iff 8j + e >= first: the row's start as a tile column, clamped to [0, BK]
                        // (a start past the tile hides all of it); rows past nq read none
                        const int r = row0 + 16 * mb + 8 * i;
                        const int64_t start = r < nq ? docg[r * p.q_doc_stride[1]] : 0, base = p.k_pos0 + k0;
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

        // Online softmax per row on scaled scores (s scale log2(e); the maximum of the unscaled scores, scaled, is
        // the scaled maximum since the scale is positive): maxima over the quad (the 4 lanes holding a row),
        // rescale l and O, exponentiate.
        const float sl2 = cfg.scale_log2;
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
    // that saw no key.
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
            const float inv = l[mb][i] > 0.0f ? 1.0f / l[mb][i] : 0.0f;
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
                    l[mb][i] > 0.0f ? (m[mb][i] + log2f(l[mb][i])) * kLn2 : -INFINITY;
        }
}

// ------------------------------------------------------------------------------------------------
// Backward

// What the backward's launch decides, next to the params (see FwdLaunch).
struct BwdLaunch {
    float *delta;    // [batch, heads, seq_q] contiguous scratch: D = rowsum(dO * O)
    float *dq_acc;   // [batch, heads, seq_q, head_dim] contiguous scratch: fp32 dQ (already scaled)
    int64_t n_ktiles; // key tiles per (batch, kv head): the grid is n_ktiles x kv_heads x batch
    int32_t group;   // heads / kv_heads
    int32_t vec_q, vec_k, vec_v, vec_do; // 16-byte loads allowed for that tensor (vec_ok)
    float scale, scale_log2; // the softmax scale in fp32, and times log2(e)
    // Document mask only (attn_doc_chunks_kernel, attn_doc_suffix_kernel): per batch row and chunk of kDocChunk
    // query rows, the smallest and largest start, and the smallest start of that chunk and every later one.
    int64_t *doc_min, *doc_max, *doc_suf; // [batch][doc_chunks] scratch
    int64_t doc_chunks;                         // ceil(seq_q / kDocChunk)
};
static_assert(sizeof(hexiseq_attn_params) + sizeof(BwdLaunch) <= 4096, "kernel parameters past 4 KiB");

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

// The document mask's per-chunk bounds for the backward kernels, which walk query tiles for a fixed key tile: a tile
// whose every start lies past the key tile's last key is skipped (its smallest start: the min over its chunks, every
// query tile being whole chunks), and once the suffix minimum passes that key no later tile can see it either, so the
// walk stops (exactly after the last visible tile when the starts do not decrease, as in packed sequences, and
// correctly, if later, for any starts). Chunks of 16 rows: every backward query tile (16, 32, 64 rows) is whole ones.
constexpr int kDocChunk = 16;

// doc_min, doc_max of chunk c of batch row b, one thread per (b, c).
__global__ void attn_doc_chunks_kernel(const hexiseq_attn_params p, const BwdLaunch cfg) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; // b * doc_chunks + c
    if (idx >= p.batch * cfg.doc_chunks)
        return;
    const int64_t b = idx / cfg.doc_chunks, i0 = idx % cfg.doc_chunks * kDocChunk;
    const int64_t *docg = p.q_doc + b * p.q_doc_stride[0];
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = i0; i < min(i0 + kDocChunk, p.seq_q); ++i) {
        const int64_t s = docg[i * p.q_doc_stride[1]];
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
// document starts at or before key_last, the key tile's last key (absolute); seq_q when there is none. The same for
// every thread of the CTA (uniform loads).
template <int BQ>
__device__ int64_t doc_next_tile(const hexiseq_attn_params &p, const BwdLaunch &cfg, int64_t b, int64_t q0,
                                 int64_t key_last) {
    static_assert(BQ % kDocChunk == 0, "query tiles are whole document chunks");
    const int64_t *mn = cfg.doc_min + b * cfg.doc_chunks, *suf = cfg.doc_suf + b * cfg.doc_chunks;
    for (; q0 < p.seq_q; q0 += BQ) {
        const int64_t c = q0 / kDocChunk;
        if (suf[c] > key_last)
            break; // every row from here on starts its document past the key tile
        int64_t lo = mn[c];
        for (int i = 1; i < BQ / kDocChunk && c + i < cfg.doc_chunks; ++i)
            lo = min(lo, mn[c + i]);
        if (lo <= key_last)
            return q0;
    }
    return p.seq_q;
}

// Whether a row of the query tile at q0 starts its document after key_first, the key tile's first key (absolute):
// only then do its keys need the per-element document mask.
template <int BQ>
__device__ bool doc_tile_cut(const BwdLaunch &cfg, int64_t b, int64_t q0, int64_t key_first) {
    const int64_t *mx = cfg.doc_max + b * cfg.doc_chunks;
    const int64_t c = q0 / kDocChunk;
    int64_t hi = mx[c];
    for (int i = 1; i < BQ / kDocChunk && c + i < cfg.doc_chunks; ++i)
        hi = max(hi, mx[c + i]);
    return hi > key_first;
}

// Document starts of the query tile's rows as key-tile columns clamped to [0, BK] (the first key each row may see;
// BK: none), into doc_s[r] for r < BQ (0 past nq). Threads r, r + NT, ...
template <int BQ, int BK, int NT>
__device__ __forceinline__ void doc_tile_starts(int *doc_s, const hexiseq_attn_params &p, int64_t b, int64_t q0, int nq,
                                                int64_t key_first) {
    const int64_t *docg = p.q_doc + b * p.q_doc_stride[0];
    for (int r = threadIdx.x; r < BQ; r += NT) {
        const int64_t start = r < nq ? docg[(q0 + r) * p.q_doc_stride[1]] : 0;
        doc_s[r] = start > key_first ? (int)min((int64_t)BK, start - key_first) : 0; // no overflow: key_first >= 0
    }
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
    static constexpr int doc = xch + (DS > 1 ? THREADS / 32 * xch_warp : 0); // document mask: each row's first key
    static constexpr int bytes = doc + smem_round(BQ * 4);
    // The dQ phase: THREADS / 32 warps over QM blocks of 16 query rows x (warps / QM) parts of DQ head-dim columns.
    static constexpr int QM = BQ / 16, DQ = D / (THREADS / 32 / QM);
    static_assert(THREADS / 32 % QM == 0 && D % (THREADS / 32 / QM) == 0 && DQ % 16 == 0,
                  "every warp gets a 16-row block and a multiple of 16 head-dim columns of dQ");
};
// Only the D = 128 instance has a smaller-tile fallback: D = 64 with BK = 128 fits every target (99 KiB and up).
static_assert(BwdMmaTiles<64>::bytes <= 99 * 1024, "the D = 64 backward must fit a 99 KiB device");

// DOC: the document mask, in its own instance (see attn_fwd_kernel): query tiles no row of which sees the key tile are
// skipped (doc_next_tile; neither loaded nor computed), and the per-element mask reads the rows' starts only in the
// steps whose tile holds a start past the key tile's first key.
template <typename T, int D, int BK_, bool DOC>
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
    int *doc_s = reinterpret_cast<int *>(smem + L::doc);         // [BQ] first key of each row (document mask)

    const int64_t bid = blockIdx.x;
    const int64_t kt = bid % cfg.n_ktiles;
    const int32_t hk = (int32_t)(bid / cfg.n_ktiles % p.kv_heads);
    const int64_t b = bid / cfg.n_ktiles / p.kv_heads;
    const int64_t k0 = kt * BK;
    const int nk = (int)min((int64_t)BK, p.seq_k - k0); // keys in this tile (32-bit compares per element)
    const int64_t key_first = p.k_pos0 + k0;             // absolute position of the tile's first key

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kb = warp % KB, dh = warp / KB; // key block kb, head-dim part dh
    const int key0 = kb * 16 + g;             // this thread's key rows in the tile: key0 and key0 + 8
    const int c0 = dh * DW;                   // first head-dim column of this warp's dK, dV

    // K and V first in the plain instance, as they always were (computing the start below first moved the sm_80
    // D = 256 build into a 4-byte spill); the document instance loads them only if some query tile sees them.
    const T *kg = static_cast<const T *>(p.k) + b * p.k_stride[0] + k0 * p.k_stride[1] + hk * p.k_stride[2];
    const T *vg = static_cast<const T *>(p.v) + b * p.v_stride[0] + k0 * p.v_stride[1] + hk * p.v_stride[2];
    if constexpr (!DOC) {
        load_tile<T, BK, D, LDT, NT>(ks, kg, p.k_stride[1], p.k_stride[3], nk, p.head_dim, cfg.vec_k);
        load_tile<T, BK, D, LDT, NT>(vs, vg, p.v_stride[1], p.v_stride[3], nk, p.head_dim, cfg.vec_v);
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
    // Document mask: the first query tile with a row that may see the tile; seq_q: none (K, V are not even loaded).
    int64_t q0_start = qt_first * BQ;
    if constexpr (DOC) {
        q0_start = doc_next_tile<BQ>(p, cfg, b, q0_start, key_first + nk - 1);
        if (q0_start < p.seq_q) {
            load_tile<T, BK, D, LDT, NT>(ks, kg, p.k_stride[1], p.k_stride[3], nk, p.head_dim, cfg.vec_k);
            load_tile<T, BK, D, LDT, NT>(vs, vg, p.v_stride[1], p.v_stride[3], nk, p.head_dim, cfg.vec_v);
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
    const int64_t n_steps = (int64_t)cfg.group * n_qt;
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
    // query tile of the head, after its last tile the first tile of the next head. Under the document mask the next
    // tile is the next one doc_next_tile keeps, and the steps end with the group's heads (their count is not known
    // ahead).
    const int64_t q0_first = q0_start;
    const int32_t h_end = (hk + 1) * cfg.group;
    int32_t h = DOC && q0_start >= p.seq_q ? h_end : hk * cfg.group;
    int64_t q0 = q0_first;
    if (async && (DOC ? h < h_end : n_steps > 0))
        prefetch(h, q0, 0);
    int buf = 0;
    for (int64_t step = 0; DOC ? h < h_end : step < n_steps; ++step, buf ^= async ? 1 : 0) {
        int32_t h_next = h;
        int64_t q0_next = q0 + BQ;
        if constexpr (DOC)
            q0_next = doc_next_tile<BQ>(p, cfg, b, q0_next, key_first + nk - 1);
        if (q0_next >= p.seq_q) {
            q0_next = q0_first;
            ++h_next;
        }
        const int nq = (int)min((int64_t)BQ, p.seq_q - q0); // query rows of this tile
        const float *lseg = static_cast<const float *>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
        const float *deltag = cfg.delta + (b * p.heads + h) * p.seq_q;
        float *dqg = cfg.dq_acc + ((b * p.heads + h) * p.seq_q + q0) * p.head_dim; // row q0 of the tile
        // Causal: key kr sees query qc iff k_pos0 + k0 + kr <= q_pos0 + q0 + qc, i.e. kr - qc <= the diagonal offset,
        // clamped here to [-BQ, BK] (kr - qc lies in (-BQ, BK)) so the per-element test is 32-bit.
        const int diag = p.causal ? (int)max((int64_t)-BQ, min((int64_t)BK, p.q_pos0 + q0 - p.k_pos0 - k0)) : BK;
        const T *qs = q_tile(buf), *dos = do_tile(buf);
        // No barrier is needed before refilling a Q/dO buffer or LSE, D: their last readers (the dV/dK phase
        // of an earlier step) are behind that step's "dS^T complete" barrier, and dS^T is rewritten only
        // after the "ready" barrier below, which every warp reaches only after its previous dQ phase.
        if (async) {
            if (DOC ? h_next < h_end : step + 1 < n_steps) { // a step follows this one
                prefetch(h_next, q0_next, buf ^ 1);
                cp_async_wait<1>(); // this thread's copies for this step are done
            } else {
                cp_async_wait<0>();
            }
        } else {
            load_tile<T, BQ, D, LDT, NT>(q_tile(0), q_src(h, q0), p.q_stride[1], p.q_stride[3], nq, p.head_dim, false);
            load_tile<T, BQ, D, LDT, NT>(do_tile(0), do_src(h, q0), p.do_stride[1], p.do_stride[3], nq, p.head_dim, false);
        }
        for (int r = threadIdx.x; r < BQ; r += NT) {
            lse_s[r] = r < nq ? lseg[(q0 + r) * p.lse_stride[2]] * kLog2e : -INFINITY;
            delta_s[r] = r < nq ? deltag[q0 + r] : 0.0f;
        }
        const bool doc_cut = DOC && doc_tile_cut<BQ>(cfg, b, q0, key_first); // uniform
        if (doc_cut) // rewritten under the same rule as LSE and D (see above)
            doc_tile_starts<BQ, BK, NT>(doc_s, p, b, q0, nq, key_first);
        __syncthreads(); // K, V (first step), Q, dO, LSE, D, document starts ready

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

        // P^T, then dS^T = P^T (dP^T - D), in place; masked and out-of-range entries are 0.
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kr = key0 + 8 * (e / 2), qc = 8 * j + 2 * t + (e & 1);
                const float l2 = lse_s[qc];
                bool ok = kr < nk && l2 != -INFINITY && kr - qc <= diag;
                if constexpr (DOC)
                    ok = ok && (!doc_cut || kr >= doc_s[qc]);
                const float pv = ok ? fast_exp2(st[j][e] * cfg.scale_log2 - l2) : 0.0f;
                st[j][e] = pv;
                dpt[j][e] = pv * (dpt[j][e] - delta_s[qc]);
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

    // dK = scale dS^T Q and dV; one thread owns each element, so plain stores (accumulate: add to old values).
    T *dkg = static_cast<T *>(p.dk) + b * p.dk_stride[0] + k0 * p.dk_stride[1] + hk * p.dk_stride[2];
    T *dvg = static_cast<T *>(p.dv) + b * p.dv_stride[0] + k0 * p.dv_stride[1] + hk * p.dv_stride[2];
#pragma unroll
    for (int j = 0; j < DW / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = key0 + 8 * (e / 2), col = c0 + 8 * j + 2 * t + (e & 1);
            if (r >= nk || col >= p.head_dim)
                continue;
            T *pk = dkg + r * p.dk_stride[1] + col * p.dk_stride[3];
            T *pv = dvg + r * p.dv_stride[1] + col * p.dv_stride[3];
            float gk = dk[j][e] * cfg.scale, gv = dv[j][e];
            if (p.accumulate) {
                gk += to_f32(*pk);
                gv += to_f32(*pv);
            }
            *pk = from_f32<T>(gk);
            *pv = from_f32<T>(gv);
        }
}

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
    static constexpr int doc = delta + smem_round(BQ * 4); // document mask: each row's first key in the tile
    static constexpr int bytes = doc + smem_round(BQ * 4);
};

// DOC: the document mask, as in attn_bwd_mma_kernel.
template <typename T, int D, bool DOC>
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
    int *doc_s = reinterpret_cast<int *>(smem + L::doc);         // [BQ] first key of each row (document mask)

    const int64_t bid = blockIdx.x;
    const int64_t kt = bid % cfg.n_ktiles;
    const int32_t hk = (int32_t)(bid / cfg.n_ktiles % p.kv_heads);
    const int64_t b = bid / cfg.n_ktiles / p.kv_heads;
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
    // Document mask: the first query tile with a row that may see the tile; seq_q: none (K, V are not even loaded).
    int64_t q0_start = i_first / BQ * BQ;
    if constexpr (DOC)
        q0_start = doc_next_tile<BQ>(p, cfg, b, q0_start, key_first + nk - 1);

    const T *kg = static_cast<const T *>(p.k) + b * p.k_stride[0] + k0 * p.k_stride[1] + hk * p.k_stride[2];
    const T *vg = static_cast<const T *>(p.v) + b * p.v_stride[0] + k0 * p.v_stride[1] + hk * p.v_stride[2];
    if (!DOC || q0_start < p.seq_q) {
        load_tile<T, BK, D, LDT, NT>(ks, kg, p.k_stride[1], p.k_stride[3], nk, p.head_dim, cfg.vec_k);
        load_tile<T, BK, D, LDT, NT>(vs, vg, p.v_stride[1], p.v_stride[3], nk, p.head_dim, cfg.vec_v);
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
    const int64_t n_steps = (int64_t)cfg.group * n_qt;
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
    // Under the document mask the steps walk the tiles doc_next_tile keeps and end with the group's heads.
    const int32_t h_end = (hk + 1) * cfg.group;
    int32_t h = DOC && q0_start >= p.seq_q ? h_end : hk * cfg.group;
    int64_t q0 = q0_first;
    if (async && (DOC ? h < h_end : n_steps > 0))
        prefetch(h, q0, 0);
    int buf = 0;
    for (int64_t step = 0; DOC ? h < h_end : step < n_steps; ++step, buf ^= async ? 1 : 0) {
        int32_t h_next = h;
        int64_t q0_next = q0 + BQ;
        if constexpr (DOC)
            q0_next = doc_next_tile<BQ>(p, cfg, b, q0_next, key_first + nk - 1);
        if (q0_next >= p.seq_q) {
            q0_next = q0_first;
            ++h_next;
        }
        const bool more = DOC ? h_next < h_end : step + 1 < n_steps; // a step follows this one
        const int nq = (int)min((int64_t)BQ, p.seq_q - q0);
        const float *lseg = static_cast<const float *>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
        const float *deltag = cfg.delta + (b * p.heads + h) * p.seq_q;
        float *dqg = cfg.dq_acc + ((b * p.heads + h) * p.seq_q + q0) * p.head_dim;
        // key kr sees query qr iff kr - qr <= diag (clamped to [-BQ, BK], where kr - qr lies in (-BQ, BK))
        const int diag = p.causal ? (int)max((int64_t)-BQ, min((int64_t)BK, p.q_pos0 + q0 - p.k_pos0 - k0)) : BK;
        if (async) {
            cp_async_wait<0>(); // this step's tiles, prefetched during the previous step
        } else {
            __syncthreads(); // buffer 0's last readers (the previous step's product 2) are done
            load_tile<T, BQ, D, LDT, NT>(q_tile(0), q_src(h, q0), p.q_stride[1], p.q_stride[3], nq, p.head_dim, false);
            load_tile<T, BQ, D, LDT, NT>(do_tile(0), do_src(h, q0), p.do_stride[1], p.do_stride[3], nq, p.head_dim, false);
        }
        for (int r = threadIdx.x; r < BQ; r += NT) {
            lse_s[r] = r < nq ? lseg[(q0 + r) * p.lse_stride[2]] * kLog2e : -INFINITY;
            delta_s[r] = r < nq ? deltag[q0 + r] : 0.0f;
        }
        const bool doc_cut = DOC && doc_tile_cut<BQ>(cfg, b, q0, key_first); // uniform
        if (doc_cut) // rewritten under the same rule as LSE and D
            doc_tile_starts<BQ, BK, NT>(doc_s, p, b, q0, nq, key_first);
        __syncthreads(); // K, V (first step), Q, dO, LSE, D, document starts ready; the previous step's readers of P,
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
        // qr keeps keys kr <= last, one compare per entry.
        const float scale_log2 = cfg.scale_log2;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const int qr = sm + 16 * i + g + 8 * hi;
                const float l2 = lse_s[qr], dr = delta_s[qr];
                const int last = l2 == -INFINITY ? -1 : min(nk - 1, qr + diag);
                int first = 0; // document mask: the row's first key in the tile
                if constexpr (DOC)
                    first = doc_cut ? doc_s[qr] : 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float pv[2], sv[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kr = sn + 8 * j + 2 * t + e;
                        bool ok = kr <= last;
                        if constexpr (DOC)
                            ok = ok && kr >= first;
                        pv[e] = ok ? fast_exp2(s[i][j][2 * hi + e] * scale_log2 - l2) : 0.0f;
                        sv[e] = pv[e] * (dp[i][j][2 * hi + e] - dr);
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
                T *pk = dkg + r * p.dk_stride[1] + col * p.dk_stride[3];
                T *pv = dvg + r * p.dv_stride[1] + col * p.dv_stride[3];
                float gk = dk[i][j][e] * cfg.scale, gv = dv[i][j][e];
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

// ------------------------------------------------------------------------------------------------
// Merge

__global__ void attn_merge_kernel(const hexiseq_attn_merge_params m) {
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; // (b * heads + h) * seq + s
    const int lane = threadIdx.x % 32;
    if (row >= m.batch * m.heads * m.seq)
        return;
    const int64_t s = row % m.seq;
    const int64_t h = row / m.seq % m.heads;
    const int64_t b = row / m.seq / m.heads;
    const int64_t la_at = b * m.lse_acc_stride[0] + h * m.lse_acc_stride[1] + s * m.lse_acc_stride[2];
    const int64_t lp_at = b * m.lse_part_stride[0] + h * m.lse_part_stride[1] + s * m.lse_part_stride[2];
    const int64_t oa_at = b * m.o_acc_stride[0] + s * m.o_acc_stride[1] + h * m.o_acc_stride[2];
    const int64_t op_at = b * m.o_part_stride[0] + s * m.o_part_stride[1] + h * m.o_part_stride[2];
    const int32_t la_dt = m.acc_dtype == HEXISEQ_DTYPE_F64 ? HEXISEQ_DTYPE_F64 : HEXISEQ_DTYPE_F32;
    const int32_t lp_dt = m.part_dtype == HEXISEQ_DTYPE_F64 ? HEXISEQ_DTYPE_F64 : HEXISEQ_DTYPE_F32;
    const double la = load_any(m.lse_acc, la_dt, la_at);
    const double lp = load_any(m.lse_part, lp_dt, lp_at);
    if (lp == -INFINITY)
        return; // the partial saw no key: exact no-op
    double wa = 0.0, wp = 1.0, lnew = lp;
    if (la != -INFINITY) { // logaddexp without overflow: the larger term factors out, the weights are <= 1
        const double hi = la > lp ? la : lp;
        lnew = hi + log1p(exp(-fabs(la - lp)));
        wa = exp(la - lnew);
        wp = exp(lp - lnew);
    }
    for (int32_t c = lane; c < m.head_dim; c += 32) {
        const double op = load_any(m.o_part, m.part_dtype, op_at + c * m.o_part_stride[3]);
        // la = -inf: the accumulator row is replaced (never read: it may hold anything, even NaN)
        const double oa = la == -INFINITY ? 0.0 : load_any(m.o_acc, m.acc_dtype, oa_at + c * m.o_acc_stride[3]);
        store_any(m.o_acc, m.acc_dtype, oa_at + c * m.o_acc_stride[3], wa * oa + wp * op);
    }
    __syncwarp(); // every lane read la before lane 0 rewrites it
    if (lane == 0)
        store_any(m.lse_acc, la_dt, la_at, lnew);
}


// x[i] = value for i < n (grid-stride).
__global__ void attn_fill_kernel(double *x, int64_t n, double value) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = value;
}

// The last step of a forward split into key pieces, for one slice of query rows (p: the call's params with o, lse at
// the slice's first row and seq_q its row count): o[b, i, h, c] = acc[b, i, h, c] rounded to p.dtype (acc: double,
// contiguous [batch, seq_q, heads, head_dim]; 0 for a row whose lse_acc is -inf) and lse[b, h, i] = lse_acc (double,
// contiguous [batch, heads, seq_q]), one thread per element of acc.
__global__ void attn_fwd_store_kernel(const hexiseq_attn_params p, const double *acc, const double *lse_acc) {
    const int64_t seq = p.seq_q;
    const int64_t n = p.batch * seq * p.heads * p.head_dim;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = idx % p.head_dim;
        const int64_t h = idx / p.head_dim % p.heads;
        const int64_t i = idx / p.head_dim / p.heads % seq;
        const int64_t b = idx / p.head_dim / p.heads / seq;
        const double lse = lse_acc[(b * p.heads + h) * seq + i];
        // a row no piece saw anything of was never written by the merge: O = 0
        store_any(p.o, p.dtype, b * p.o_stride[0] + i * p.o_stride[1] + h * p.o_stride[2] + c * p.o_stride[3],
                  lse == -INFINITY ? 0.0 : acc[idx]);
        if (c == 0)
            static_cast<float *>(p.lse)[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = (float)lse;
    }
}

// ------------------------------------------------------------------------------------------------
// Host side: validation and launches

// The shared rules (csrc/attention_check.c, the extension's copy: see kernels/entry.cu), then what this CUDA build serves.
// q_doc's values are not checked: they are device memory here, and reading them would cost a copy and a stream
// synchronisation. The kernels apply the visibility rule start <= key <= query as it stands, so a start outside
// [0, q_pos0 + i] reads no memory out of place: past its own position the row sees nothing, below 0 it is causal.
hexiseq_status check_params(const hexiseq_attn_params *p, int backward) {
    HEXISEQ_CHECK(hexiseq_attn_check_params(p, backward));
    // What this CUDA build serves.
    if (p->dtype != HEXISEQ_DTYPE_F16 && p->dtype != HEXISEQ_DTYPE_BF16)
        return hexiseq_fail(HEXISEQ_ERR_UNSUPPORTED,
                            "dtype %s: the CUDA attention kernels take float16 and bfloat16 only (fp32 accumulation); "
                            "run float32/float64 on the CPU kernels",
                            p->dtype == HEXISEQ_DTYPE_F64 ? "float64" : "float32");
    return HEXISEQ_OK;
}

// 16-byte loads of rows of this tensor are legal (see the file comment).
bool vec_ok(const void *base, const int64_t *stride, int32_t d) {
    return stride[3] == 1 && d % 8 == 0 && (uintptr_t)base % 16 == 0 && stride[0] % 8 == 0 && stride[1] % 8 == 0 &&
           stride[2] % 8 == 0;
}

hexiseq_status cuda_fail(cudaError_t e, const char *what) {
    return hexiseq_fail(HEXISEQ_ERR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

// After a launch: a bad configuration or a missing kernel image shows up here.
hexiseq_status check_launch(const char *kernel) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return cuda_fail(e, kernel);
    return HEXISEQ_OK;
}

// Smallest compiled head dim >= d.
int padded_head_dim(int32_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

// Launch a kernel that needs more than the default 48 KiB of dynamic shared memory: opt in, launch, check.
template <typename Launch>
hexiseq_status launch_with_smem(void (*kernel)(hexiseq_attn_params, Launch), const char *name, int64_t blocks,
                                int threads, int bytes, cudaStream_t stream, const hexiseq_attn_params &p,
                                const Launch &cfg) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) {
        char what[160];
        snprintf(what, sizeof what, "cudaFuncSetAttribute(%s, MaxDynamicSharedMemorySize = %d bytes)", name, bytes);
        return cuda_fail(e, what);
    }
    HEXISEQ_LAUNCH(kernel, (unsigned)blocks, threads, bytes, stream, p, cfg);
    char what[96];
    snprintf(what, sizeof what, "%s launch", name);
    return check_launch(what);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The current device's opt-in shared-memory limit per block (227 KiB on sm_90, 163 on sm_80, 99 on sm_86/89);
// 0 if it cannot be read (the smaller kernel variant is then chosen, and its launch reports any real error).
int smem_optin_limit() {
    int dev = 0, bytes = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
        return 0;
    return bytes;
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
    if (p.q_doc != nullptr)
        return launch_with_smem(attn_fwd_kernel<T, TO, D, BK, true>, "attn_fwd_kernel", blocks, kFwdThreads, L::bytes,
                                stream, p, cfg);
    return launch_with_smem(attn_fwd_kernel<T, TO, D, BK, false>, "attn_fwd_kernel", blocks, kFwdThreads, L::bytes,
                            stream, p, cfg);
}

// The key tile (BK keys per CTA) depends on the instance, so the grid is sized here (backward_typed has checked
// it against the grid limit for the smallest key tile).
template <typename T, int D, int BK = bwd_default_bk(D)>
hexiseq_status launch_bwd_mma(const hexiseq_attn_params &p, BwdLaunch cfg, cudaStream_t stream) {
    using L = BwdMmaTiles<D, BK>;
    cfg.n_ktiles = ceil_div(p.seq_k, BK);
    const int64_t blocks = cfg.n_ktiles * p.kv_heads * p.batch;
    if (p.q_doc != nullptr)
        return launch_with_smem(attn_bwd_mma_kernel<T, D, BK, true>, "attn_bwd_mma_kernel", blocks, L::THREADS,
                                L::bytes, stream, p, cfg);
    return launch_with_smem(attn_bwd_mma_kernel<T, D, BK, false>, "attn_bwd_mma_kernel", blocks, L::THREADS, L::bytes,
                            stream, p, cfg);
}

template <typename T, int D> hexiseq_status launch_bwd_staged(const hexiseq_attn_params &p, BwdLaunch cfg,
                                                              cudaStream_t stream) {
    using L = BwdStagedTiles<D>;
    cfg.n_ktiles = ceil_div(p.seq_k, L::BK);
    const int64_t blocks = cfg.n_ktiles * p.kv_heads * p.batch;
    if (p.q_doc != nullptr)
        return launch_with_smem(attn_bwd_staged_kernel<T, D, true>, "attn_bwd_staged_kernel", blocks, L::THREADS,
                                L::bytes, stream, p, cfg);
    return launch_with_smem(attn_bwd_staged_kernel<T, D, false>, "attn_bwd_staged_kernel", blocks, L::THREADS,
                            L::bytes, stream, p, cfg);
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

    const int D = padded_head_dim(p->head_dim);
    const int64_t rows = p->batch * p->heads * p->seq_q;
    const int64_t main_blocks = ceil_div(p->seq_k, 64) * p->kv_heads * p->batch; // the most: 64-key tiles
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

    // Scratch: D [rows], the fp32 dQ accumulator [rows][d] and, with a document mask, its three [batch][chunks]
    // bound arrays; stream-ordered.
    const size_t delta_bytes = (size_t)rows * sizeof(float);
    const size_t acc_bytes = (size_t)rows * (size_t)p->head_dim * sizeof(float);
    cfg.doc_chunks = p->q_doc != nullptr ? ceil_div(p->seq_q, kDocChunk) : 0;
    const size_t doc_bytes = (size_t)(p->batch * cfg.doc_chunks) * sizeof(int64_t);
    auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    void *scratch = nullptr;
    cudaError_t e = cudaMallocAsync(&scratch, up(delta_bytes) + up(acc_bytes) + 3 * up(doc_bytes), stream);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaMallocAsync of the backward scratch (D and the fp32 dQ accumulator)");
    cfg.delta = static_cast<float *>(scratch);
    cfg.dq_acc = reinterpret_cast<float *>(static_cast<char *>(scratch) + up(delta_bytes));
    if (p->q_doc != nullptr) {
        int64_t *doc = reinterpret_cast<int64_t *>(static_cast<char *>(scratch) + up(delta_bytes) + up(acc_bytes));
        cfg.doc_min = doc;
        cfg.doc_max = reinterpret_cast<int64_t *>(reinterpret_cast<char *>(doc) + up(doc_bytes));
        cfg.doc_suf = reinterpret_cast<int64_t *>(reinterpret_cast<char *>(doc) + 2 * up(doc_bytes));
    }

    hexiseq_status s = HEXISEQ_OK;
    e = cudaMemsetAsync(cfg.dq_acc, 0, acc_bytes, stream);
    if (e != cudaSuccess)
        s = cuda_fail(e, "cudaMemsetAsync of the dQ accumulator");
    if (s == HEXISEQ_OK) {
        HEXISEQ_LAUNCH(attn_bwd_delta_kernel<T>, (unsigned)delta_blocks, kThreads, 0, stream, *p, cfg);
        s = check_launch("attn_bwd_delta_kernel launch");
    }
    if (s == HEXISEQ_OK && p->q_doc != nullptr) {
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
    e = cudaFreeAsync(scratch, stream);
    if (e != cudaSuccess && s == HEXISEQ_OK)
        s = cuda_fail(e, "cudaFreeAsync of the backward scratch");
    return s;
}

} // namespace

namespace {
// Forward or backward: the shared checks, then the kernels for the dtype.
hexiseq_status attention_cuda(const hexiseq_attn_params *p, void *stream, int backward) {
    hexiseq_clear_error();
    HEXISEQ_CHECK(check_params(p, backward));
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (p->dtype == HEXISEQ_DTYPE_F16)
        return backward ? backward_typed<__half>(p, st) : forward_typed<__half>(p, st);
    return backward ? backward_typed<__nv_bfloat16>(p, st) : forward_typed<__nv_bfloat16>(p, st);
}
} // namespace

extern "C" hexiseq_status hexiseq_attn_forward_cuda(const hexiseq_attn_params *p, void *stream) {
    return attention_cuda(p, stream, 0);
}

extern "C" hexiseq_status hexiseq_attn_backward_cuda(const hexiseq_attn_params *p, void *stream) {
    return attention_cuda(p, stream, 1);
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
