// kernels/forward.cu compiled unchanged for the CPU emulator (emu.h), with this file's dynamic shared memory. The
// forward and the backward kernels are two files so that their compiles (minutes under the sanitizers) run side by
// side; kernels/entry.cu and device_info.cu stay out: the test links the launchers against csrc/ directly.
#include "emu.h"

HEXISEQ_EMU_SHARED_MEMORY

// the helpers the kernels share (host.cuh, tile.cuh, ...) are not all used by each of the two files
#pragma GCC diagnostic ignored "-Wunused-function"
#include "forward.cu"
