/* The CPython binding of the HexiSeq C core: the module, its error classes and its init. Argument parsing,
 * NumPy arrays in and out and status codes to exceptions; it holds no algorithm. The functions live by concern
 * in the other _core_*.c files (see _core.h), each with its method table, added to the module here. */
#include "_core.h"

#include <string.h>

/* ------------------------------------------------------------------ errors */

/* Raise the exception class mapped to `status` with the core's last-error text; returns NULL. */
PyObject *raise_status(PyObject *module, hexiseq_status status) {
    core_state *st = get_state(module);
    PyObject *cls = (status > 0 && status < HEXISEQ_STATUS_COUNT) ? st->errors[status] : NULL;
    const char *detail = hexiseq_last_error();
    PyErr_SetString(cls ? cls : PyExc_RuntimeError, detail[0] ? detail : hexiseq_status_string(status));
    return NULL;
}

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
#else
    PyObject *cuda = Py_False;
    int runtime = 0;
#endif
#if defined(__clang__)
    const char *compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
    const char *compiler = "gcc " __VERSION__;
#else
    const char *compiler = "unknown";
#endif
    return Py_BuildValue("{s:s,s:O,s:i,s:s,s:O}", "version", HEXISEQ_VERSION, "cuda", cuda, "cuda_runtime", runtime,
                         "compiler", compiler, "openmp", openmp);
}

/* ------------------------------------------------------------------ module */

static PyMethodDef core_methods[] = {
    {"build_info", core_build_info, METH_NOARGS, "What this extension was built with."},
    {NULL, NULL, 0, NULL},
};

static int core_exec(PyObject *module) {
    /* The functions, one table per file of the binding (_core.h). */
    PyMethodDef *tables[] = {core_methods, core_plan_methods, core_attention_methods, core_cuda_methods};
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; ++i)
        if (PyModule_AddFunctions(module, tables[i]) < 0)
            return -1;
    if (core_plan_exec(module) < 0)
        return -1;
    core_state *st = get_state(module);
    PyObject *errors = PyImport_ImportModule("hexiseq.errors");
    if (!errors)
        return -1;
    static const struct {
        hexiseq_status status;
        const char *name;
    } map[] = {
        {HEXISEQ_ERR_NULL, "InternalError"},      {HEXISEQ_ERR_INVALID, "InvalidArgumentError"},
        {HEXISEQ_ERR_UNKNOWN_GPU, "UnknownGPUError"}, {HEXISEQ_ERR_LAYOUT, "LayoutError"},
        {HEXISEQ_ERR_MEMORY, "MemoryFitError"},   {HEXISEQ_ERR_NOMEM, "InternalError"},
        {HEXISEQ_ERR_UNSUPPORTED, "UnsupportedError"}, {HEXISEQ_ERR_CUDA, "CudaError"},
        {HEXISEQ_ERR_INTERNAL, "InternalError"},
        /* a cancelled plan raises the pending KeyboardInterrupt before it gets here: reaching it is a bug */
        {HEXISEQ_ERR_CANCELLED, "InternalError"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; ++i) {
        st->errors[map[i].status] = PyObject_GetAttrString(errors, map[i].name);
        if (!st->errors[map[i].status]) {
            Py_DECREF(errors);
            return -1;
        }
    }
    st->type_error = PyObject_GetAttrString(errors, "ArgumentTypeError");
    Py_DECREF(errors);
    if (!st->type_error)
        return -1;
    if (PyModule_AddStringConstant(module, "VERSION", HEXISEQ_VERSION) < 0)
        return -1;
    /* The core's enum values by name, so Python never restates them: STRATEGIES by hexiseq_strategy_name,
     * SHARDINGS by the names hexiseq.Sharding uses. */
    PyObject *strategies = PyDict_New(), *shardings = PyDict_New();
    int bad = !strategies || !shardings;
    for (int i = 0; !bad && i < HEXISEQ_STRATEGY_COUNT; ++i) {
        PyObject *v = PyLong_FromLong(i);
        bad = !v || PyDict_SetItemString(strategies, hexiseq_strategy_name((hexiseq_strategy)i), v) < 0;
        Py_XDECREF(v);
    }
    static const struct {
        const char *name;
        int value;
    } shard_names[] = {{"full", HEXISEQ_SHARD_FULL}, {"grad_opt", HEXISEQ_SHARD_GRAD_OPT},
                       {"opt", HEXISEQ_SHARD_OPT}, {"none", HEXISEQ_SHARD_NONE}};
    for (size_t i = 0; !bad && i < sizeof shard_names / sizeof shard_names[0]; ++i) {
        PyObject *v = PyLong_FromLong(shard_names[i].value);
        bad = !v || PyDict_SetItemString(shardings, shard_names[i].name, v) < 0;
        Py_XDECREF(v);
    }
    if (bad) {
        Py_XDECREF(strategies);
        Py_XDECREF(shardings);
        return -1;
    }
    if (PyModule_AddObject(module, "STRATEGIES", strategies) < 0) { /* steals the reference on success */
        Py_DECREF(strategies);
        Py_DECREF(shardings);
        return -1;
    }
    if (PyModule_AddObject(module, "SHARDINGS", shardings) < 0) {
        Py_DECREF(shardings);
        return -1;
    }
    return 0;
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
