/* Storage the cost terms share: the size above which alike ring steps (cost_ring.c) and alike all-to-all peers
 * (cost_a2a.c) are priced once, which the scheduler's LP also reads (declared in internal.h). */
#include "internal.h"

int32_t hexiseq_grouped_above = 32;
