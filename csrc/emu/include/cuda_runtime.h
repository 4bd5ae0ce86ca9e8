// Stand-in for the CUDA toolkit's cuda_runtime.h when a .cu file is compiled as host C++ for the
// CPU emulator (csrc/emu/rheo_emu.h). Only the emulated build puts this directory on the path.
#pragma once
#include "../rheo_emu.h"
