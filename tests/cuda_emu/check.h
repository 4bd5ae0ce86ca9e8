// CHECK for the emulator's test programs: prints the failed condition with its place and counts
// it in `failures` (each program returns nonzero when any failed).
#pragma once

#include <cstdio>

namespace {

int failures = 0;

#define CHECK(cond)                                                \
  do {                                                             \
    if (!(cond)) {                                                 \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);  \
      ++failures;                                                  \
    }                                                              \
  } while (0)

}  // namespace
