/* What the files of the CPython binding (hexiseq/binding/, built into the extension hexiseq._core) share. Private
 * to the extension: every name here has hidden visibility (setup.py compiles with -fvisibility=hidden), so none
 * leaks out of _core.so.
 *
 *   module.c     the module: state, build_info, init; assembles the methods below
 *   errors.c     status codes to the exception classes of hexiseq.errors (raise_status)
 *   plan.c       the planner: catalog, clusters, models, evaluate, plan_strategy (NumPy arrays in and out)
 *   enums.c      the core's enums and constants by name
 *   attention.c  attention over DLPack tensors, CPU and CUDA
 *   cuda.c       the loader of the CUDA kernels library (libhexiseq_cuda.so) and cuda_device_count */
#ifndef HEXISEQ_CORE_BINDING_H
#define HEXISEQ_CORE_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "hexiseq.h"
#include "launch.h"

typedef struct {
    PyObject *errors[HEXISEQ_STATUS_COUNT]; /* exception class per hexiseq_status, [0] unused */
    PyObject *type_error; /* hexiseq.errors.ArgumentTypeError: an argument of the wrong kind */
} core_state;

static inline core_state *get_state(PyObject *module) { return (core_state *)PyModule_GetState(module); }

/* Raise the exception class mapped to `status` with the core's last-error text; returns NULL. (errors.c) */
PyObject *raise_status(PyObject *module, hexiseq_status status);

/* Fills the module state's exception classes from hexiseq.errors. 0 or -1. (errors.c) */
int core_errors_exec(PyObject *module);

/* Each file's functions, NULL-terminated; module.c adds them to the module. */
extern PyMethodDef core_plan_methods[];
extern PyMethodDef core_attention_methods[];
extern PyMethodDef core_cuda_methods[];

/* The planner's part of the module's init: imports the NumPy C API, which only plan.c uses, and adds the core's
 * enums by name (STRATEGIES, SHARDINGS, STATE_SHARES, CHUNKINGS). 0 or -1. */
int core_plan_exec(PyObject *module);

/* Adds the core's enums by name and its constants (TILE_TOKENS, HOST_LINK_EFF, ...) to the module. 0 or -1.
 * (enums.c) */
int core_enums_exec(PyObject *module);

/* The CUDA kernels' entry table, the library opened on first use (with the GIL held). NULL with an exception set
 * when it cannot be had: UnsupportedError on a build without CUDA kernels, or for a library that does not load or
 * is from another build. (cuda.c) */
const hexiseq_cuda_entries *core_cuda_entries(PyObject *module);

#endif /* HEXISEQ_CORE_BINDING_H */
