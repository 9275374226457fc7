/* Status codes and the last-error text shared by every C entry point of HexiSeq. */
#ifndef HEXISEQ_STATUS_H
#define HEXISEQ_STATUS_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define HEXISEQ_API __attribute__((visibility("default")))
#else
#define HEXISEQ_API
#endif

/* Every entry point returns one of these. Results come back through out-parameters. */
typedef enum {
    HEXISEQ_OK = 0,
    HEXISEQ_ERR_NULL = 1,        /* a required pointer argument was NULL */
    HEXISEQ_ERR_INVALID = 2,     /* an argument has a value out of its domain */
    HEXISEQ_ERR_UNKNOWN_GPU = 3, /* a GPU model name not in the catalog */
    HEXISEQ_ERR_LAYOUT = 4,      /* a plan layout is inconsistent (shares, heads, devices) */
    HEXISEQ_ERR_MEMORY = 5,      /* no plan fits device memory */
    HEXISEQ_ERR_NOMEM = 6,       /* host allocation failed */
    HEXISEQ_ERR_UNSUPPORTED = 7, /* valid request this build cannot serve (dtype, head dim, device) */
    HEXISEQ_ERR_CUDA = 8,        /* a CUDA runtime call failed */
    HEXISEQ_ERR_INTERNAL = 9,    /* a bug: an invariant did not hold */
    HEXISEQ_ERR_CANCELLED = 10,  /* a progress callback asked the call to stop */
    HEXISEQ_STATUS_COUNT = 11    /* how many codes there are (not a status) */
} hexiseq_status;

/* Static text for a code ("invalid argument", ...). Never NULL. */
HEXISEQ_API const char *hexiseq_status_string(hexiseq_status status);

/* Detail of the last failure on this thread, naming the field and the value
 * (e.g. "nodes[1].count must be >= 1, got -3"). Empty string when none. */
HEXISEQ_API const char *hexiseq_last_error(void);

/* Internal: record the detail for the calling thread and return `status`. */
hexiseq_status hexiseq_fail(hexiseq_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Internal: hexiseq_fail with a va_list (what the CUDA kernels library forwards its failures to). */
hexiseq_status hexiseq_vfail(hexiseq_status status, const char *fmt, va_list ap)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 0)))
#endif
    ;

/* Internal: clear the detail (called at the top of public entry points). */
void hexiseq_clear_error(void);

/* Propagate a failure: evaluate `expr` once, return its status if not OK. */
#define HEXISEQ_CHECK(expr)                              \
    do {                                                 \
        hexiseq_status hexiseq_check_s_ = (expr);        \
        if (hexiseq_check_s_ != HEXISEQ_OK)              \
            return hexiseq_check_s_;                     \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif /* HEXISEQ_STATUS_H */
