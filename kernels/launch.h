/* C declarations of the CUDA launchers in kernels/: the only way the rest of HexiSeq reaches the GPU. */
#ifndef HEXISEQ_KERNELS_LAUNCH_H
#define HEXISEQ_KERNELS_LAUNCH_H

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA runtime version this was built against (e.g. 13000) and visible devices (0 without a driver or GPU).
 * Never fails: a machine without a GPU reports 0 devices. */
HEXISEQ_API hexiseq_status hexiseq_cuda_runtime_info(int *runtime_version, int *device_count);

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_KERNELS_LAUNCH_H */
