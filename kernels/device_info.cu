// CUDA runtime queries: the runtime version and the visible devices, behind hexiseq.cuda_device_count (binding/cuda.c).
#include <cuda_runtime.h>

#include "launch.h"

extern "C" hexiseq_status hexiseq_cuda_runtime_info(int *runtime_version, int *device_count) {
    if (!runtime_version || !device_count)
        return hexiseq_fail(HEXISEQ_ERR_NULL, "runtime_version and device_count must not be NULL");
    *runtime_version = CUDART_VERSION;
    int n = 0;
    // cudaGetDeviceCount fails without a driver or GPU: that is "no device", not an error.
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); // clear the sticky error
        n = 0;
    }
    *device_count = n;
    return HEXISEQ_OK;
}
