/* The core's enum values by name as module attributes (STRATEGIES, SHARDINGS, STATE_SHARES, CHUNKINGS,
 * MEMORY_FEATURES) and its constants, so that Python never restates them. */
#include "binding.h"

typedef struct {
    const char *name; /* the name Python uses (hexiseq.Strategy, hexiseq.Sharding, Training.state_shares, ...) */
    int value;        /* the core's enum value */
} enum_entry;

/* module.<attr> = {name: value, ...}. 0 or -1. */
static int add_enum(PyObject *module, const char *attr, const enum_entry *entries, size_t n) {
    PyObject *table = PyDict_New();
    for (size_t i = 0; table && i < n; ++i) {
        PyObject *v = PyLong_FromLong(entries[i].value);
        int bad = !v || PyDict_SetItemString(table, entries[i].name, v) < 0;
        Py_XDECREF(v);
        if (bad)
            Py_CLEAR(table);
    }
    if (!table)
        return -1;
    if (PyModule_AddObject(module, attr, table) < 0) { /* steals the reference on success */
        Py_DECREF(table);
        return -1;
    }
    return 0;
}

/* The core's enum values by name, so that Python never restates them (one table each, read by planner/model.py
 * and planner/plan.py): STRATEGIES by hexiseq_strategy_name, the others by the names the Python API uses. */
int core_enums_exec(PyObject *module) {
    enum_entry strategies[HEXISEQ_STRATEGY_COUNT];
    for (int i = 0; i < HEXISEQ_STRATEGY_COUNT; ++i)
        strategies[i] = (enum_entry){hexiseq_strategy_name((hexiseq_strategy)i), i};
    static const enum_entry shardings[] = {{"full", HEXISEQ_SHARD_FULL}, {"grad_opt", HEXISEQ_SHARD_GRAD_OPT},
                                           {"opt", HEXISEQ_SHARD_OPT}, {"none", HEXISEQ_SHARD_NONE}};
    static const enum_entry state_shares[] = {{"even", HEXISEQ_STATES_EVEN}, {"memory", HEXISEQ_STATES_BY_MEMORY}};
    static const enum_entry chunkings[] = {{"zigzag", HEXISEQ_CHUNK_ZIGZAG}, {"contiguous", HEXISEQ_CHUNK_CONTIGUOUS}};
    static const enum_entry features[] = {{"offload", HEXISEQ_OFFLOAD}, {"tile_mlp", HEXISEQ_TILE_MLP},
                                          {"tile_loss", HEXISEQ_TILE_LOSS}};
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))
    int rc = add_enum(module, "STRATEGIES", strategies, N_OF(strategies)) < 0 ||
                     add_enum(module, "SHARDINGS", shardings, N_OF(shardings)) < 0 ||
                     add_enum(module, "STATE_SHARES", state_shares, N_OF(state_shares)) < 0 ||
                     add_enum(module, "CHUNKINGS", chunkings, N_OF(chunkings)) < 0 ||
                     add_enum(module, "MEMORY_FEATURES", features, N_OF(features)) < 0 ||
                     PyModule_AddIntConstant(module, "TILE_TOKENS", HEXISEQ_TILE_TOKENS) < 0 ||
                     PyModule_AddObject(module, "HOST_LINK_EFF", PyFloat_FromDouble(HEXISEQ_HOST_LINK_EFF)) < 0 ||
                     PyModule_AddObject(module, "HOST_MEMORY_FACTOR", PyFloat_FromDouble(HEXISEQ_HOST_MEMORY_FACTOR)) < 0
                 ? -1
                 : 0;
#undef N_OF
    return rc;
}
