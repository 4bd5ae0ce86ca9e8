// Stand-in for cuda_bf16.h in the CPU emulator (csrc/emu/rheo_emu.h): the __nv_bfloat16 storage
// type and its conversions, rounding to nearest even like the device's __float2bfloat16_rn.
#pragma once
#include "../rheo_emu.h"
#include "../emu_half.h"
