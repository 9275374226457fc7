/* A monotonic clock (not part of the public API): what the planners' time limits and the batch assignment's read. */
#ifndef HEXISEQ_CLOCK_H
#define HEXISEQ_CLOCK_H

/* Seconds since an unspecified start, never going back (CLOCK_MONOTONIC). */
double hexiseq_now_s(void);

#endif /* HEXISEQ_CLOCK_H */
