// The CUDA kernels library's one export, hexiseq_cuda_entry_table (kernels/launch.h), and the host forwarding
// behind it. The table is filled from the launchers themselves, so their signatures are checked here against the
// function types of launch.h, the same ones the extension calls through.
//
// The library has no status helpers and no params validation of its own: the launchers' calls of hexiseq_fail,
// hexiseq_clear_error and hexiseq_attn_check_* land below and go to the extension's copies (csrc/common/status.c,
// csrc/attention/attention_check.c), attached once at load. This is the smallest change that leaves one error buffer: the
// launchers keep their code and their contract, and the binding reads their text where it reads the CPU kernels'.
// The emulator test builds the launchers without this file, linked against csrc/ directly.
#include <stdarg.h>

#include "launch.h"

namespace {
// Set once by attach() before any other entry runs; never changed afterwards.
const hexiseq_cuda_host *host = nullptr;

void attach(const hexiseq_cuda_host *h) { host = h; }
} // namespace

extern "C" hexiseq_status hexiseq_fail(hexiseq_status status, const char *fmt, ...) {
    if (!host)
        return status; // never attached: no buffer to write the text into
    va_list ap;
    va_start(ap, fmt);
    host->vfail(status, fmt, ap);
    va_end(ap);
    return status;
}

extern "C" void hexiseq_clear_error(void) {
    if (host)
        host->clear_error();
}

extern "C" hexiseq_status hexiseq_attn_check_params(const hexiseq_attn_params *p, int backward) {
    return host ? host->check_params(p, backward) : HEXISEQ_ERR_INTERNAL;
}

extern "C" hexiseq_status hexiseq_attn_check_merge(const hexiseq_attn_merge_params *m) {
    return host ? host->check_merge(m) : HEXISEQ_ERR_INTERNAL;
}

extern "C" const hexiseq_cuda_entries hexiseq_cuda_entry_table = {
    HEXISEQ_CUDA_ENTRY_VERSION,
    (uint32_t)sizeof(hexiseq_cuda_entries),
    (uint32_t)sizeof(hexiseq_attn_params),
    (uint32_t)sizeof(hexiseq_attn_merge_params),
    attach,
    hexiseq_cuda_runtime_info,
    hexiseq_attn_forward_cuda,
    hexiseq_attn_backward_cuda,
    hexiseq_attn_merge_cuda,
};
