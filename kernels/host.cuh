// Host side shared by the CUDA attention launchers: the params checks, 16-byte load legality, CUDA error text, and
// the launch of a kernel above 48 KiB of dynamic shared memory.
#ifndef HEXISEQ_KERNELS_HOST_CUH
#define HEXISEQ_KERNELS_HOST_CUH

#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>

#include "attention.h"
#include "launch.h"

// Every launch goes through this macro so that tests/c/cuda_emu (a CPU emulator of the CUDA subset used
// here, which compiles these files as plain C++) can substitute its own launcher for the <<<>>> syntax.
#ifndef HEXISEQ_LAUNCH
#define HEXISEQ_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

namespace {

// The shared rules (csrc/attention/attention_check.c, the extension's copy: see kernels/entry.cu), then what this CUDA build serves.
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

// 16-byte loads of rows of this tensor are legal (see the strides in tile.cuh's comment).
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
// The current device's multiprocessor count; 108 (an A100's) if it cannot be read.
int sm_count() {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1)
        return 108;
    return n;
}
} // namespace

#endif // HEXISEQ_KERNELS_HOST_CUH
