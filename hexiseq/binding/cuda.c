/* The loader of the CUDA kernels. They live in a separate shared library, libhexiseq_cuda.so beside this module,
 * opened the first time a CUDA tensor arrives (or cuda_device_count is asked). A process that never touches CUDA
 * never loads the CUDA runtime: linked into this module, its static teardown at interpreter exit raced with the
 * threads of torch.distributed and now and then aborted the process.
 *
 * The library exports one symbol, its entry table (kernels/launch.h), fetched with one dlsym and checked for
 * version and sizes before anything in it is called, then given this extension's status helpers and params
 * validation (hexiseq_cuda_host): the launchers write their failures into the same per-thread error buffer as
 * the CPU kernels, so raise_status reports both the same way. */
#include "binding.h"

#include <string.h>

#ifdef HEXISEQ_WITH_CUDA
#include <dlfcn.h>

/* Lent to the library for as long as the process runs (the library is never closed once attached). */
static const hexiseq_cuda_host cuda_host = {
    hexiseq_vfail,
    hexiseq_clear_error,
    hexiseq_attn_check_params,
    hexiseq_attn_check_merge,
};

static const hexiseq_cuda_entries *cuda_table; /* set once the library is open, attached and checked */

/* The path of libhexiseq_cuda.so: the directory of this module's file. A PyMem block, or NULL with an exception. */
static char *cuda_library_path(PyObject *module) {
    PyObject *file = PyModule_GetFilenameObject(module);
    if (!file)
        return NULL;
    const char *so = PyUnicode_AsUTF8(file);
    if (!so) {
        Py_DECREF(file);
        return NULL;
    }
    const char *slash = strrchr(so, '/');
    size_t dir = slash ? (size_t)(slash - so + 1) : 0;
    static const char name[] = "libhexiseq_cuda.so";
    char *path = PyMem_Malloc(dir + sizeof name);
    if (!path) {
        Py_DECREF(file);
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(path, so, dir);
    memcpy(path + dir, name, sizeof name);
    Py_DECREF(file);
    return path;
}

/* The table of an open library when it is the one this extension was built with; else NULL with an exception.
 * The version and sizes are read before anything else, so a table of another layout is never followed further. */
static const hexiseq_cuda_entries *cuda_check_table(PyObject *module, void *handle, const char *path) {
    PyObject *unsupported = get_state(module)->errors[HEXISEQ_ERR_UNSUPPORTED];
    const hexiseq_cuda_entries *t = (const hexiseq_cuda_entries *)dlsym(handle, HEXISEQ_CUDA_ENTRY_SYMBOL);
    if (!t) {
        PyErr_Format(unsupported,
                     "the CUDA kernels library %s has no %s: it is from another build of hexiseq; rebuild hexiseq so "
                     "that the extension and the library come from one build",
                     path, HEXISEQ_CUDA_ENTRY_SYMBOL);
        return NULL;
    }
    if (t->version != HEXISEQ_CUDA_ENTRY_VERSION || t->size != sizeof *t ||
        t->attn_params_size != sizeof(hexiseq_attn_params) ||
        t->merge_params_size != sizeof(hexiseq_attn_merge_params)) {
        PyErr_Format(unsupported,
                     "the CUDA kernels library %s is from another build of hexiseq (entry table version %u, %u bytes, "
                     "params %u and %u bytes; this extension reads version %u, %u bytes, params %u and %u bytes); "
                     "rebuild hexiseq so that the extension and the library come from one build",
                     path, (unsigned)t->version, (unsigned)t->size, (unsigned)t->attn_params_size,
                     (unsigned)t->merge_params_size, (unsigned)HEXISEQ_CUDA_ENTRY_VERSION, (unsigned)sizeof *t,
                     (unsigned)sizeof(hexiseq_attn_params), (unsigned)sizeof(hexiseq_attn_merge_params));
        return NULL;
    }
    return t;
}

const hexiseq_cuda_entries *core_cuda_entries(PyObject *module) {
    if (cuda_table) /* set and read with the GIL held, so no race */
        return cuda_table;
    char *path = cuda_library_path(module);
    if (!path)
        return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        PyErr_Format(get_state(module)->errors[HEXISEQ_ERR_UNSUPPORTED], "cannot load the CUDA kernels (%s): %s", path,
                     dlerror());
        PyMem_Free(path);
        return NULL;
    }
    const hexiseq_cuda_entries *t = cuda_check_table(module, h, path);
    PyMem_Free(path);
    if (!t) {
        dlclose(h);
        return NULL;
    }
    t->attach(&cuda_host);
    cuda_table = t;
    return t;
}

/* cuda_device_count() -> devices the CUDA runtime sees (0 without a driver or GPU); loads the CUDA kernels. */
static PyObject *core_cuda_device_count(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    const hexiseq_cuda_entries *cu = core_cuda_entries(module);
    if (!cu)
        return NULL;
    int runtime = 0, devices = 0;
    hexiseq_status s = cu->runtime_info(&runtime, &devices);
    if (s != HEXISEQ_OK)
        return raise_status(module, s);
    return PyLong_FromLong(devices);
}
#else
#ifndef HEXISEQ_CUDA_SKIPPED
#define HEXISEQ_CUDA_SKIPPED "built without setup.py's CUDA decision"
#endif
const hexiseq_cuda_entries *core_cuda_entries(PyObject *module) {
    PyErr_SetString(get_state(module)->errors[HEXISEQ_ERR_UNSUPPORTED],
                    "this hexiseq was built without its CUDA kernels (" HEXISEQ_CUDA_SKIPPED "); to build them, "
                    "reinstall from the source tree on a machine with nvcc: HEXISEQ_CUDA=1 pip install . "
                    "(HEXISEQ_CUDA_ARCHS=90 for Hopper only); or move the tensors to the CPU");
    return NULL;
}

static PyObject *core_cuda_device_count(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    return PyLong_FromLong(0);
}
#endif

PyMethodDef core_cuda_methods[] = {
    {"cuda_device_count", core_cuda_device_count, METH_NOARGS, "CUDA devices visible (loads the CUDA kernels)."},
    {NULL, NULL, 0, NULL},
};
