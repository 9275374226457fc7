/* The DLPack tensor-exchange ABI, declared by HexiSeq from the DLPack specification, version 1.0
 * (dmlc/dlpack include/dlpack/dlpack.h and docs/source/python_spec.rst, DLPACK_MAJOR_VERSION 1,
 * DLPACK_MINOR_VERSION 0). Only what a consumer needs is declared. Written here rather than vendored;
 * tests/test_dlpack.py checks it against the capsules of NumPy and PyTorch. */
#ifndef HEXISEQ_DLPACK_H
#define HEXISEQ_DLPACK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version this header describes. A DLManagedTensorVersioned with another major version has a
 * different layout after its first three fields: the consumer may read only `version` and must call
 * `deleter`. A newer minor version only adds enumeration values. */
#define HEXISEQ_DLPACK_MAJOR_VERSION 1u
#define HEXISEQ_DLPACK_MINOR_VERSION 0u

/* Names of the PyCapsules carrying the two managed-tensor structs, before and after a consumer takes
 * ownership (python_spec.rst: the consumer renames the capsule so its destructor does nothing). */
#define HEXISEQ_DLPACK_CAPSULE_VERSIONED "dltensor_versioned"
#define HEXISEQ_DLPACK_CAPSULE_VERSIONED_USED "used_dltensor_versioned"
#define HEXISEQ_DLPACK_CAPSULE_LEGACY "dltensor"
#define HEXISEQ_DLPACK_CAPSULE_LEGACY_USED "used_dltensor"

typedef struct {
    uint32_t major; /* a change means a change of the DLManagedTensorVersioned layout */
    uint32_t minor; /* a change means new enumeration values only */
} DLPackVersion;

/* Where the data lives. The values are fixed by the specification (gaps are codes it retired). */
typedef enum {
    kDLCPU = 1,          /* host memory */
    kDLCUDA = 2,         /* CUDA device memory */
    kDLCUDAHost = 3,     /* CUDA pinned host memory (cudaMallocHost): readable by the CPU */
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13, /* CUDA unified memory (cudaMallocManaged) */
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id; /* ordinal of the device of that type; 0 for the host */
} DLDevice;

/* Type code of DLDataType.code. */
typedef enum {
    kDLInt = 0,          /* signed integer */
    kDLUInt = 1,         /* unsigned integer */
    kDLFloat = 2,        /* IEEE 754 binary floating point (bits 16, 32, 64) */
    kDLOpaqueHandle = 3, /* opaque pointer-sized handle */
    kDLBfloat = 4,       /* bfloat16 (bits 16) */
    kDLComplex = 5,      /* complex of two floats (bits is the size of the pair) */
    kDLBool = 6          /* boolean (bits 8) */
} DLDataTypeCode;

typedef struct {
    uint8_t code;   /* a DLDataTypeCode */
    uint8_t bits;   /* bits of one lane, e.g. 32 for float32 */
    uint16_t lanes; /* 1 for scalar elements; > 1 for vector types */
} DLDataType;

/* A strided view of memory. It owns nothing. */
typedef struct {
    void *data;      /* base address; on CUDA an opaque device pointer, not meant to be offset by the consumer */
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;   /* [ndim] */
    int64_t *strides; /* [ndim] in elements (not bytes); NULL means compact row-major (C order) */
    uint64_t byte_offset; /* bytes from data to the first element */
} DLTensor;

/* Legacy (pre-1.0, unversioned) managed tensor: capsule name "dltensor". */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx; /* the producer's state, opaque to the consumer */
    /* Called by the consumer exactly once when it no longer needs dl_tensor; may be NULL. */
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* DLManagedTensorVersioned.flags bits. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0) /* the consumer must not write the data */
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1) /* the producer made a copy the consumer owns alone */

/* Versioned managed tensor (DLPack >= 1.0): capsule name "dltensor_versioned". `version` comes first so
 * that a consumer can read it whatever the major version. */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    /* Called by the consumer exactly once when done; may be NULL. Safe to call on a major-version mismatch. */
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags; /* DLPACK_FLAG_BITMASK_* */
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_DLPACK_H */
