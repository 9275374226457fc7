/* The monotonic clock of clock.h. */
#define _POSIX_C_SOURCE 199309L
#include <time.h>

#include "clock.h"

double hexiseq_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
