/* Status strings and the per-thread last-error buffer: the only one in the process, since the CUDA kernels
 * library writes it through the extension (kernels/launch.h, hexiseq_cuda_host). */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[512];

const char *hexiseq_status_string(hexiseq_status status) {
    switch (status) {
    case HEXISEQ_OK: return "success";
    case HEXISEQ_ERR_NULL: return "null argument";
    case HEXISEQ_ERR_INVALID: return "invalid argument";
    case HEXISEQ_ERR_UNKNOWN_GPU: return "unknown GPU model";
    case HEXISEQ_ERR_LAYOUT: return "invalid layout";
    case HEXISEQ_ERR_MEMORY: return "does not fit in device memory";
    case HEXISEQ_ERR_NOMEM: return "host allocation failed";
    case HEXISEQ_ERR_UNSUPPORTED: return "unsupported by this build";
    case HEXISEQ_ERR_CUDA: return "CUDA error";
    case HEXISEQ_ERR_INTERNAL: return "internal error";
    case HEXISEQ_ERR_CANCELLED: return "cancelled";
    case HEXISEQ_STATUS_COUNT: break;
    }
    return "unknown status";
}

const char *hexiseq_last_error(void) { return last_error; }

void hexiseq_clear_error(void) { last_error[0] = '\0'; }

hexiseq_status hexiseq_vfail(hexiseq_status status, const char *fmt, va_list ap) {
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    return status;
}

hexiseq_status hexiseq_fail(hexiseq_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    hexiseq_vfail(status, fmt, ap);
    va_end(ap);
    return status;
}
