/* Names of the planning strategies, for messages: below the dispatcher (strategy.c) and the baselines
 * (baselines.c), which both print them. */
#include "hexiseq.h"

const char *hexiseq_strategy_name(hexiseq_strategy s) {
    switch (s) {
    case HEXISEQ_STRATEGY_RING: return "ring";
    case HEXISEQ_STRATEGY_ULYSSES: return "ulysses";
    case HEXISEQ_STRATEGY_USP: return "usp";
    case HEXISEQ_STRATEGY_HEXISEQ: return "hexiseq";
    default: return "unknown";
    }
}
