/* C declarations of the CUDA launchers in kernels/: the only way the rest of HexiSeq reaches the GPU. */
#ifndef HEXISEQ_KERNELS_LAUNCH_H
#define HEXISEQ_KERNELS_LAUNCH_H

#include "attention.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA runtime version this was built against (e.g. 13000) and visible devices (0 without a driver or GPU).
 * Never fails: a machine without a GPU reports 0 devices. */
HEXISEQ_API hexiseq_status hexiseq_cuda_runtime_info(int *runtime_version, int *device_count);

/* CUDA attention launchers: the GPU counterparts of hexiseq_attn_{forward,backward,merge}_cpu (csrc/attention.h),
 * with the same params structs and the same validation (same messages). Every pointer in *p is device memory
 * of the current CUDA device. `stream` is a cudaStream_t (NULL: the legacy default stream); the kernels are
 * enqueued on it and the call returns without waiting, so results are ready when the stream reaches them.
 * Served: dtype float16 and bfloat16 (fp32 accumulation), head_dim 1..256, any element strides, causal or not,
 * GQA/MQA; float32/float64 give HEXISEQ_ERR_UNSUPPORTED (the CPU kernels take them). The merge takes every
 * dtype on both sides. Failures: as the CPU versions, plus HEXISEQ_ERR_CUDA with the CUDA error text when a
 * launch, the shared-memory opt-in or the stream-ordered scratch allocation of the backward fails.
 * The backward's dq is summed with fp32 atomics: it is not bit-for-bit deterministic across runs. */
HEXISEQ_API hexiseq_status hexiseq_attn_forward_cuda(const hexiseq_attn_params *p, void *stream);
HEXISEQ_API hexiseq_status hexiseq_attn_backward_cuda(const hexiseq_attn_params *p, void *stream);
HEXISEQ_API hexiseq_status hexiseq_attn_merge_cuda(const hexiseq_attn_merge_params *m, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_KERNELS_LAUNCH_H */
