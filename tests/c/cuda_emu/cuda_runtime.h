// Emulator stand-in for the CUDA header of the same name: see emu.h.
#include "emu.h"
