// A CPU emulator for the slice of CUDA that the attention kernels of kernels/ use, so the CUDA kernels' logic (tiling,
// masking, causal offsets, GQA, strides, odd sizes, online softmax, the backward's accumulators, the merge)
// is tested on machines without a GPU. It is a test tool, not a second implementation: the kernel source is
// compiled unchanged as C++ against these headers (and cuda_*.h here) instead of the CUDA ones.
//
// How it runs a launch: the blocks of the grid run one after another; the threads of a block run as fibers
// (cooperative user-level threads, each with its own stack) that switch only at synchronisation points:
// __syncthreads, __syncwarp, warp shuffles, mma.sync and ldmatrix. So a thread runs without interruption from one
// synchronisation point to the next, and which thread runs next is a parameter (hexiseq_emu::set_schedule:
// lockstep, run-ahead from either end, pseudo-random). A kernel whose result changes with the schedule has a
// data race between two barriers; the tests run every case under all four and compare the outputs bit for bit.
//
// What it checks on top of the results:
//   * deadlocks (threads waiting at barriers that can never complete, e.g. __syncthreads in divergent code);
//   * warp collectives (shuffles, __syncwarp, mma.sync, ldmatrix) with a lane that has exited, or a partial
//     mask;
//   * dynamic shared memory: the launch's size must not exceed the cudaFuncSetAttribute opt-in nor the sm_80
//     opt-in limit (163 KiB, the smallest of the targets); it is filled with 0xFF bytes (NaN) before each
//     block so reads of unwritten shared memory poison the result, and the bytes past the launch's size are
//     checked after each block for stray writes (and poisoned for AddressSanitizer builds);
//   * ldmatrix and cp.async addresses: 16-byte aligned, inside the launch's shared memory; cp.async copies
//     land only when a wait lets them (so reading early reads stale bytes); ldmatrix bank conflicts counted;
//   * stream-ordered scratch (cudaMallocAsync) comes back filled with 0xFF bytes, not zeros.
// A violation prints the kernel, block and thread and aborts the process: a test binary fails loudly.
//
// mma.sync gathers the warp's fragments through a shared buffer and each lane computes its own 4 outputs in
// fp32 (products of 16-bit inputs are exact in fp32; the summation order over k is 0..15, one legal order).
#ifndef HEXISEQ_CUDA_EMU_H
#define HEXISEQ_CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <functional>

#include "half.h" // the project's fp16/bf16 conversions (round to nearest even)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define HEXISEQ_CUDA_EMU 1 // kernels/tile.cuh, backward.cuh: use the emulator's versions of its inline-PTX wrappers

#define CUDART_VERSION 13000

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }

// ------------------------------------------------------------------------------------------------
// 16-bit floating-point types: the bit pattern, converted with the project's round-to-nearest-even helpers.

struct __half {
    uint16_t bits;
};
struct __nv_bfloat16 {
    uint16_t bits;
};
inline float __half2float(__half h) { return hexiseq_f16_to_f32(h.bits); }
inline __half __float2half_rn(float f) { return __half{hexiseq_f32_to_f16(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return hexiseq_bf16_to_f32(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{hexiseq_f32_to_bf16(f)}; }
// the fast division intrinsic: an IEEE division here (the device's is within 2 ulp of it for the operands used)
inline float __fdividef(float a, float b) { return a / b; }

// ------------------------------------------------------------------------------------------------
// The scheduler (emu.cpp)

namespace hexiseq_emu {

// Which runnable thread of a block runs next (blocks always run in order, so fp32 atomics sum in one order):
//   ROUND_ROBIN   every runnable thread once per pass, in index order: the block advances almost in lockstep;
//   LOWEST_FIRST  always the lowest-numbered runnable thread: warp 0 runs ahead until it waits at a
//                 __syncthreads, then warp 1, ... (the earliest warps run far ahead of the others);
//   HIGHEST_FIRST the same from the last warp down;
//   RANDOM        a pseudo-random runnable thread each time (seed below).
// A missing barrier shows as a result that differs between schedules: lockstep hides it when the writer and
// the reader are many synchronisation points apart, run-ahead exposes it.
enum Schedule { SCHEDULE_ROUND_ROBIN = 0, SCHEDULE_LOWEST_FIRST = 1, SCHEDULE_HIGHEST_FIRST = 2, SCHEDULE_RANDOM = 3 };
void set_schedule(Schedule s, uint64_t seed);

// The dynamic shared memory of a launch: each file that compiles kernels (kernels_forward.cpp,
// kernels_backward.cpp: two, so that the two slowest compiles run side by side) defines its own array with
// HEXISEQ_EMU_SHARED_MEMORY before including them, where their `extern __shared__ smem[]` sees it, and the
// launches made in that file pass it. 227 KiB: sm_90's opt-in maximum; launches above sm_80's 163 KiB are
// refused by the emulator anyway.
constexpr size_t kSharedMemoryBytes = 227 * 1024;

// Per-thread state the emulated built-ins read.
struct ThreadState {
    uint3 idx;          // threadIdx
    int warp, lane;     // threadIdx.x / 32, threadIdx.x % 32
    unsigned collective; // how many warp collectives this thread has entered (picks the exchange buffer)
};
ThreadState *current_thread();
extern uint3 block_idx;
extern dim3 block_dim, grid_dim;

void sync_block();                                 // __syncthreads
void sync_warp(unsigned mask, const char *what);   // __syncwarp and every warp collective
void *warp_exchange_buffer(size_t bytes);          // this warp's exchange buffer for the current collective
[[noreturn]] void fail(const char *fmt, ...);       // report a violation with the current kernel/block/thread

// Runs body once per thread of every block of the grid (after the launch checks in emu.cpp).
// name: the launch expression's kernel; where: the launching function (names the template instance).
// shared: the launching file's dynamic shared memory (kSharedMemoryBytes).
int launch(const void *kernel, const char *name, const char *where, dim3 grid, dim3 block, size_t smem,
           unsigned char *shared, const std::function<void()> &body);
int set_max_dynamic_smem(const void *kernel, int bytes);

} // namespace hexiseq_emu

#define threadIdx (::hexiseq_emu::current_thread()->idx)
#define blockIdx (::hexiseq_emu::block_idx)
#define blockDim (::hexiseq_emu::block_dim)
#define gridDim (::hexiseq_emu::grid_dim)

inline void __syncthreads() { hexiseq_emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { hexiseq_emu::sync_warp(mask, "__syncwarp"); }

// Shuffle: every lane deposits its value, the warp meets, every lane reads its partner's. Each collective
// uses one of two buffers by parity, so no lane can overwrite a value another lane has not read yet (it would
// have to pass the next collective's barrier first, which waits for that lane).
template <typename T> inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    hexiseq_emu::ThreadState *t = hexiseq_emu::current_thread();
    if (lane_mask < 0 || lane_mask > 31)
        hexiseq_emu::fail("__shfl_xor_sync lane mask %d outside 0..31", lane_mask);
    uint64_t *slots = static_cast<uint64_t *>(hexiseq_emu::warp_exchange_buffer(32 * sizeof(uint64_t)));
    memcpy(&slots[t->lane], &value, sizeof(T));
    hexiseq_emu::sync_warp(mask, "__shfl_xor_sync");
    T out;
    memcpy(&out, &slots[t->lane ^ lane_mask], sizeof(T));
    return out;
}

// __shfl_down_sync: lane l reads lane l + delta's value, its own where that is past the warp (as the hardware does
// with width 32).
template <typename T> inline T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    hexiseq_emu::ThreadState *t = hexiseq_emu::current_thread();
    if (delta > 31)
        hexiseq_emu::fail("__shfl_down_sync delta %u outside 0..31", delta);
    uint64_t *slots = static_cast<uint64_t *>(hexiseq_emu::warp_exchange_buffer(32 * sizeof(uint64_t)));
    memcpy(&slots[t->lane], &value, sizeof(T));
    hexiseq_emu::sync_warp(mask, "__shfl_down_sync");
    T out;
    memcpy(&out, &slots[t->lane + (int)delta < 32 ? t->lane + (int)delta : t->lane], sizeof(T));
    return out;
}

template <typename T> inline T atomicAdd(T *address, T value) { // fibers never interleave inside a statement
    T old = *address;
    *address = old + value;
    return old;
}

namespace hexiseq_emu {
bool in_shared_memory(const void *p, size_t bytes);
// red.relaxed.gpu.global.add.v2.f32 (kernels/backward.cuh's red_add_f32x2): p[0] += x, p[1] += y, each float
// atomically, as two atomicAdd; the address must be 8-byte aligned and global (not shared).
inline void red_add_f32x2(float *p, float x, float y) {
    if ((uintptr_t)p % 8 != 0 || in_shared_memory(p, 1))
        fail("red.global.add.v2.f32 address %p is not an 8-byte aligned global address", (void *)p);
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
}
} // namespace hexiseq_emu

// ------------------------------------------------------------------------------------------------
// Register-level tensor-core instructions (kernels/tile.cuh calls them through small wrappers that are
// inline PTX on the GPU and these functions here). Fragment layouts are the PTX ISA's ("Matrix Fragments for
// mma.m16n8k16 with floating point type", "ldmatrix"), with g = lane / 4 and t = lane % 4 and 16-bit
// elements packed two per 32-bit register, the lower-indexed element in the low half:
//   A (16x16, row): reg 0 = (row g, cols 2t, 2t+1), reg 1 = (row g+8, same cols), reg 2 = (row g, cols 2t+8,
//                   2t+9), reg 3 = (row g+8, cols 2t+8, 2t+9)
//   B (16x8, col):  reg 0 = (rows 2t, 2t+1; col g), reg 1 = (rows 2t+8, 2t+9; col g)
//   C (16x8, fp32): c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
//   ldmatrix .x4: lanes 8i .. 8i+7 give the row addresses of 8x8 matrix i (16 bytes each, 16-byte aligned, in
//                 shared memory); lane l receives in reg i the elements (row l/4, cols 2(l%4), 2(l%4)+1) of
//                 matrix i, or with .trans those of its transpose (rows 2(l%4), 2(l%4)+1 of column l/4).

namespace hexiseq_emu {
inline float half_bits_to_float(uint16_t bits, bool bf16) {
    return bf16 ? hexiseq_bf16_to_f32(bits) : hexiseq_f16_to_f32(bits);
}
// Shared-memory bank conflicts of the ldmatrix calls so far: the hardware reads each 8x8 matrix (8 rows of 16
// bytes) in one pass over the 32 four-byte banks when the 8 rows fall in distinct banks; every extra pass a
// matrix needs is counted here (a performance defect, not a correctness one).
extern uint64_t ldmatrix_calls, ldmatrix_extra_passes;
} // namespace hexiseq_emu

// d += A B on the warp (one m16n8k16 tile). BF16 selects the input type (else float16).
template <bool BF16> inline void hexiseq_emu_mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    hexiseq_emu::ThreadState *th = hexiseq_emu::current_thread();
    uint32_t *x = static_cast<uint32_t *>(hexiseq_emu::warp_exchange_buffer(32 * 6 * sizeof(uint32_t)));
    uint32_t *mine = x + th->lane * 6;
    mine[0] = a[0], mine[1] = a[1], mine[2] = a[2], mine[3] = a[3], mine[4] = b0, mine[5] = b1;
    hexiseq_emu::sync_warp(0xffffffffu, "mma.sync.m16n8k16");
    auto elem = [&](int lane, int reg, int half) {
        const uint32_t w = x[lane * 6 + reg];
        return hexiseq_emu::half_bits_to_float((uint16_t)(half ? w >> 16 : w & 0xffffu), BF16);
    };
    auto a_at = [&](int row, int col) { // owner lane, register and half of A(row, col)
        return elem((row % 8) * 4 + (col % 8) / 2, row / 8 + 2 * (col / 8), col % 2);
    };
    auto b_at = [&](int k, int n) { return elem(n * 4 + (k % 8) / 2, 4 + k / 8, k % 2); };
    const int g = th->lane / 4, t = th->lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float acc = d[i];
        for (int k = 0; k < 16; ++k)
            acc += a_at(row, k) * b_at(k, col);
        d[i] = acc;
    }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
template <bool TRANS> inline void hexiseq_emu_ldmatrix_x4(uint32_t (&r)[4], const void *row_address) {
    hexiseq_emu::ThreadState *th = hexiseq_emu::current_thread();
    if ((uintptr_t)row_address % 16 != 0 || !hexiseq_emu::in_shared_memory(row_address, 16))
        hexiseq_emu::fail("ldmatrix row address %p is not a 16-byte aligned shared-memory row", row_address);
    const uint16_t **rows = static_cast<const uint16_t **>(hexiseq_emu::warp_exchange_buffer(32 * sizeof(void *)));
    rows[th->lane] = static_cast<const uint16_t *>(row_address);
    hexiseq_emu::sync_warp(0xffffffffu, TRANS ? "ldmatrix.x4.trans" : "ldmatrix.x4");
    const int l = th->lane;
    if (l == 0) { // bank conflicts, counted once per warp
        hexiseq_emu::ldmatrix_calls++;
        for (int i = 0; i < 4; ++i) {
            int use[32] = {0}, passes = 1;
            for (int r = 0; r < 8; ++r)
                for (int w = 0; w < 4; ++w) {
                    const int bank = (int)(((uintptr_t)rows[8 * i + r] / 4 + w) % 32);
                    passes = use[bank] + 1 > passes ? use[bank] + 1 : passes;
                    use[bank]++;
                }
            hexiseq_emu::ldmatrix_extra_passes += (uint64_t)(passes - 1);
        }
    }
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!TRANS) {
            lo = rows[8 * i + l / 4][2 * (l % 4)];
            hi = rows[8 * i + l / 4][2 * (l % 4) + 1];
        } else {
            lo = rows[8 * i + 2 * (l % 4)][l / 4];
            hi = rows[8 * i + 2 * (l % 4) + 1][l / 4];
        }
        r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
}

// cp.async (16 bytes, global -> shared; with valid = false the 16 bytes are zero-filled and nothing is read).
// The copy is not done when issued: it is done when a cp.async.wait_group lets its group complete, so a kernel
// that reads the destination before waiting reads stale bytes (and fails the tests). A thread may not exit
// with copies in flight.
namespace hexiseq_emu {
void cp_async16(void *dst, const void *src, bool valid);
void cp_async_commit();
void cp_async_wait(int pending_groups_allowed);
} // namespace hexiseq_emu

inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }

// ------------------------------------------------------------------------------------------------
// Runtime API: the calls the kernels' launchers make, on host memory.

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
} cudaError_t;
typedef struct CUstream_st *cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };

cudaError_t cudaGetLastError();
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void *p, cudaStream_t stream);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
namespace hexiseq_emu {
void set_last_error(cudaError_t e);
// The emulated device's opt-in shared-memory limit per block: sm_80's 163 KiB unless set (an sm_86/89 GPU: 99 KiB).
void set_smem_optin_limit(int bytes);
}

template <typename... P> cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
        return cudaErrorInvalidValue;
    return (cudaError_t)hexiseq_emu::set_max_dynamic_smem((const void *)kernel, value);
}

// kernel<<<grid, block, smem, stream>>>(args...) for the emulator (the launchers in kernels/ launch through
// HEXISEQ_LAUNCH so that they compile as plain C++ here).
template <typename... P, typename... A>
void hexiseq_emu_launch(void (*kernel)(P...), const char *name, const char *where, dim3 grid, dim3 block, size_t smem,
                        unsigned char *shared, cudaStream_t, A &&...args) {
    const int e = hexiseq_emu::launch((const void *)kernel, name, where, grid, block, smem, shared,
                                      [&] { kernel(args...); });
    if (e != 0)
        hexiseq_emu::set_last_error((cudaError_t)e);
}
#define HEXISEQ_LAUNCH(kernel, grid, block, smem, stream, ...) \
    hexiseq_emu_launch(kernel, #kernel, __PRETTY_FUNCTION__, grid, block, smem, emu_shared_memory(), stream, \
                       __VA_ARGS__)

// A file's dynamic shared memory (see kSharedMemoryBytes): the kernels' `extern __shared__ smem[]`, in the same
// unnamed namespace, refers to this array, and the file's launches (HEXISEQ_LAUNCH) pass it.
#define HEXISEQ_EMU_SHARED_MEMORY                                                                                     \
    namespace {                                                                                                        \
    alignas(128) unsigned char smem[hexiseq_emu::kSharedMemoryBytes];                                                  \
    [[maybe_unused]] unsigned char *emu_shared_memory() { return smem; }                                               \
    }

#endif // HEXISEQ_CUDA_EMU_H
