/* The CPython binding of the HexiSeq C core: the module, build_info and its init. The binding parses arguments,
 * moves NumPy arrays and DLPack tensors and maps status codes to exceptions (errors.c); it holds no algorithm. The functions live by concern
 * in the other files of this folder (see binding.h), each with its method table, added to the module here. */
#include "binding.h"

#include <string.h>

/* ------------------------------------------------------------------ functions */

static PyObject *core_build_info(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
#ifdef _OPENMP
    PyObject *openmp = Py_True;
#else
    PyObject *openmp = Py_False;
#endif
#ifdef HEXISEQ_WITH_CUDA
    PyObject *cuda = Py_True;
    int runtime = HEXISEQ_CUDA_RUNTIME;
    const char *archs = HEXISEQ_CUDA_ARCHS, *skipped = "";
#else
    PyObject *cuda = Py_False;
    int runtime = 0;
    const char *archs = "";
#ifdef HEXISEQ_CUDA_SKIPPED
    const char *skipped = HEXISEQ_CUDA_SKIPPED; /* why setup.py built no CUDA kernels */
#else
    const char *skipped = "built without setup.py's CUDA decision";
#endif
#endif
#if defined(__clang__)
    const char *compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
    const char *compiler = "gcc " __VERSION__;
#else
    const char *compiler = "unknown";
#endif
    return Py_BuildValue("{s:s,s:O,s:i,s:s,s:s,s:s,s:O}", "version", HEXISEQ_VERSION, "cuda", cuda, "cuda_runtime",
                         runtime, "cuda_archs", archs, "cuda_skipped", skipped, "compiler", compiler, "openmp", openmp);
}

/* ------------------------------------------------------------------ module */

static PyMethodDef core_methods[] = {
    {"build_info", core_build_info, METH_NOARGS, "What this extension was built with."},
    {NULL, NULL, 0, NULL},
};

static int core_exec(PyObject *module) {
    /* The functions, one table per file of the binding (binding.h). */
    PyMethodDef *tables[] = {core_methods, core_plan_methods, core_attention_methods, core_cuda_methods};
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; ++i)
        if (PyModule_AddFunctions(module, tables[i]) < 0)
            return -1;
    if (core_errors_exec(module) < 0 || core_plan_exec(module) < 0)
        return -1;
    return PyModule_AddStringConstant(module, "VERSION", HEXISEQ_VERSION) < 0 ? -1 : 0;
}

static int core_traverse(PyObject *module, visitproc visit, void *arg) {
    core_state *st = get_state(module);
    for (int i = 0; i < HEXISEQ_STATUS_COUNT; ++i)
        Py_VISIT(st->errors[i]);
    Py_VISIT(st->type_error);
    return 0;
}

static int core_clear(PyObject *module) {
    core_state *st = get_state(module);
    for (int i = 0; i < HEXISEQ_STATUS_COUNT; ++i)
        Py_CLEAR(st->errors[i]);
    Py_CLEAR(st->type_error);
    return 0;
}

static void core_free(void *module) { core_clear((PyObject *)module); }

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "hexiseq._core", "Binding of the HexiSeq C core.", sizeof(core_state), NULL,
    core_slots, core_traverse, core_clear, core_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
