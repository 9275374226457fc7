/* The assertion macro shared by the C tests: counts passes and failures, prints each failure with its place. */
#ifndef HEXISEQ_TEST_CHECK_H
#define HEXISEQ_TEST_CHECK_H

#include <stdio.h>

static int n_passed, n_failed;

#define EXPECT(cond, ...)                                                        \
    do {                                                                         \
        if (cond) {                                                              \
            ++n_passed;                                                          \
        } else {                                                                 \
            ++n_failed;                                                          \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                 \
            fprintf(stderr, __VA_ARGS__);                                        \
            fprintf(stderr, "\n");                                               \
        }                                                                        \
    } while (0)

#endif /* HEXISEQ_TEST_CHECK_H */
