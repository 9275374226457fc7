/* Status codes to Python exceptions: the one table mapping each hexiseq_status onto a class of hexiseq.errors,
 * filled at the module's init, and raise_status, which every file of the binding uses to report a core error. */
#include "binding.h"

/* Raise the exception class mapped to `status` with the core's last-error text; returns NULL. */
PyObject *raise_status(PyObject *module, hexiseq_status status) {
    core_state *st = get_state(module);
    PyObject *cls = (status > 0 && status < HEXISEQ_STATUS_COUNT) ? st->errors[status] : NULL;
    const char *detail = hexiseq_last_error();
    PyErr_SetString(cls ? cls : PyExc_RuntimeError, detail[0] ? detail : hexiseq_status_string(status));
    return NULL;
}

int core_errors_exec(PyObject *module) {
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
    return 0;
}
