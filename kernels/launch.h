/* The CUDA kernels library's interface: the only way the rest of HexiSeq reaches the GPU.
 *
 * libhexiseq_cuda.so exports one symbol, hexiseq_cuda_entry_table (HEXISEQ_CUDA_ENTRY_SYMBOL): a versioned table
 * of its entry points, fetched by the extension with one dlsym. The function types below are the single
 * declaration of each entry point: the table's fields are pointers to them, and the launchers themselves (C++
 * only, see the end) are declared through the same types, so a change on either side fails to compile. */
#ifndef HEXISEQ_KERNELS_LAUNCH_H
#define HEXISEQ_KERNELS_LAUNCH_H

#include <stdarg.h>
#include <stdint.h>

#include "attention.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA runtime version this was built against (e.g. 13000) and visible devices (0 without a driver or GPU).
 * Never fails: a machine without a GPU reports 0 devices. */
typedef hexiseq_status hexiseq_cuda_info_fn(int *runtime_version, int *device_count);

/* CUDA attention launchers: the GPU counterparts of hexiseq_attn_{forward,backward,merge}_cpu (csrc/attention/attention.h),
 * with the same params structs and the same validation (same messages). Every pointer in *p is device memory
 * of the current CUDA device. `stream` is a cudaStream_t (NULL: the legacy default stream); the kernels are
 * enqueued on it and the call returns without waiting, so results are ready when the stream reaches them.
 * Served: dtype float16 and bfloat16 (fp32 accumulation), head_dim 1..256, any element strides, causal or not,
 * GQA/MQA, the document mask (q_doc, device memory: its layout is checked, its values are not; the kernels apply
 * start <= key <= query as it stands, so out-of-range starts read nothing out of place); float32/float64 give
 * HEXISEQ_ERR_UNSUPPORTED (the CPU kernels take them). The merge takes every dtype on both sides. Failures: as the CPU versions, plus HEXISEQ_ERR_CUDA with the CUDA error text when a
 * launch, the shared-memory opt-in or the stream-ordered scratch allocation of the backward fails.
 * The backward's dq is summed with fp32 atomics: it is not bit-for-bit deterministic across runs. */
typedef hexiseq_status hexiseq_cuda_attn_fn(const hexiseq_attn_params *p, void *stream);
typedef hexiseq_status hexiseq_cuda_merge_fn(const hexiseq_attn_merge_params *m, void *stream);

/* What the library borrows from the extension that loads it. The extension holds the one copy of the status
 * helpers (csrc/common/status.c) and of the params validation (csrc/attention/attention_check.c); the library forwards its calls of
 * hexiseq_fail, hexiseq_clear_error and hexiseq_attn_check_* here. So there is one per-thread error buffer, which
 * the launchers write directly and the binding reads, and one set of validation rules and messages, while the
 * launchers keep validating like the CPU entry points (the emulator test calls them directly, linked against
 * csrc/, where the same names are the real functions). */
typedef struct hexiseq_cuda_host {
    hexiseq_status (*vfail)(hexiseq_status status, const char *fmt, va_list ap);
    void (*clear_error)(void);
    hexiseq_status (*check_params)(const hexiseq_attn_params *p, int backward);
    hexiseq_status (*check_merge)(const hexiseq_attn_merge_params *m);
} hexiseq_cuda_host;

/* Bumped whenever this table or anything it passes across (the params structs, hexiseq_cuda_host, the status
 * codes) changes meaning; sizes are checked besides, so a library from another build is refused, not called.
 * 2: check_params no longer reads q_doc's values (the launchers pass device memory there); an extension of version 1
 * would read them on the host. 3: the params carry a sliding window and logit soft-capping. */
#define HEXISEQ_CUDA_ENTRY_VERSION 3u
#define HEXISEQ_CUDA_ENTRY_SYMBOL "hexiseq_cuda_entry_table"

typedef struct hexiseq_cuda_entries {
    uint32_t version;            /* HEXISEQ_CUDA_ENTRY_VERSION of the build */
    uint32_t size;               /* sizeof(hexiseq_cuda_entries) */
    uint32_t attn_params_size;   /* sizeof(hexiseq_attn_params) */
    uint32_t merge_params_size;  /* sizeof(hexiseq_attn_merge_params) */
    /* Called once, before any other entry, with a host that outlives every later call (the extension's static
     * one). Not thread-safe against the other entries: the extension calls it under the GIL when it loads. */
    void (*attach)(const hexiseq_cuda_host *host);
    hexiseq_cuda_info_fn *runtime_info;
    hexiseq_cuda_attn_fn *attn_forward;
    hexiseq_cuda_attn_fn *attn_backward;
    hexiseq_cuda_merge_fn *attn_merge;
} hexiseq_cuda_entries;

HEXISEQ_API extern const hexiseq_cuda_entries hexiseq_cuda_entry_table;

#ifdef __cplusplus
/* The launchers by name, for the C++ that defines them (the .cu files of kernels/), fills the table (kernels/entry.cu) and
 * tests them directly against the CPU emulator (tests/c/test_cuda_emu.cpp). Not exported: the C extension reaches
 * them only through the table. */
hexiseq_cuda_info_fn hexiseq_cuda_runtime_info;
hexiseq_cuda_attn_fn hexiseq_attn_forward_cuda;
hexiseq_cuda_attn_fn hexiseq_attn_backward_cuda;
hexiseq_cuda_merge_fn hexiseq_attn_merge_cuda;
#endif

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_KERNELS_LAUNCH_H */
