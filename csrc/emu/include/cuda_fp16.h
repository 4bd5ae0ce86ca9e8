// Stand-in for cuda_fp16.h in the CPU emulator (csrc/emu/rheo_emu.h): the __half storage type
// and its conversions, rounding to nearest even like the device's __float2half_rn.
#pragma once
#include "../rheo_emu.h"
#include "../emu_half.h"
