// The CUDA attention kernels (kernels/forward.cu, kernels/backward.cu) compiled for the CPU emulator (emu.h): this
// file gives the kernels their dynamic shared memory (one array: blocks run one at a time) and includes the CUDA
// source files unchanged, both in this one translation unit (the headers they share are included once, by their
// guards). kernels/entry.cu and device_info.cu stay out: the test links the launchers against csrc/ directly.
#include "emu.h"

namespace {
// The kernels' `extern __shared__ unsigned char smem[]` (in this same unnamed namespace) refers to this.
// 227 KiB: sm_90's opt-in maximum; launches above sm_80's 163 KiB are refused by the emulator anyway.
alignas(128) unsigned char smem[227 * 1024];
} // namespace

#include "backward.cu"
#include "forward.cu"

unsigned char *hexiseq_emu::shared_memory(size_t *bytes) {
    *bytes = sizeof smem;
    return smem;
}
